"""Prompt widths for static-shape decoding (the regeneration engine, the evaluation loops): each is padded
up to one of a few buckets, at most 1.5x, so that a static cache and a recorded step serve many prompts."""

BUCKETS = sorted({2**k for k in range(4, 18)} | {3 * 2**k for k in range(3, 16)})


def bucket(length: int) -> int:
    return next((b for b in BUCKETS if b >= length), -(-length // 8192) * 8192)
