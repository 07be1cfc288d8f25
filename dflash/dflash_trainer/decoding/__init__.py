"""Speculative decoding: the reference loops (eager, any device) and the fast loops (static slot cache,
CUDA-graph steps) that the evaluation and the trainer's tau use, and the prompt-width buckets."""
