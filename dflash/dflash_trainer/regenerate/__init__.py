"""Regeneration: the target writes the answers a drafter trains on (`dflash-regenerate`, README "DFlash recipe
end to end").

plan (source rows -> jobs with resume keys) -> engine (`engine_hf`: the target in this process;
`engine_openai`: an OpenAI-compatible server) -> answers (ids, text, the training row) -> shards (the
output directory) -> summary. `baseline` keeps the first batched `generate` path for the benchmark
(`bench`); `regenerate_rows` answers a list of rows in memory (the embedded default's data).
"""

__all__ = ["generate_batched", "regenerate_rows"]


def __getattr__(name: str):
    """Imported on first use (torch comes with them): `python -m dflash_trainer.regenerate` then has its signal
    handlers in before the imports that take seconds (infra/entry.py)."""
    if name == "generate_batched":
        from .baseline import generate_batched

        return generate_batched
    if name == "regenerate_rows":
        from .driver import regenerate_rows

        return regenerate_rows
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
