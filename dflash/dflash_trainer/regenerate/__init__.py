"""Regeneration: the target writes the answers a drafter trains on (`dflash-regenerate`, README "DFlash recipe
end to end").

plan (source rows -> jobs with resume keys) -> engine (`engine_hf`: the target in this process;
`engine_openai`: an OpenAI-compatible server) -> answers (ids, text, the training row) -> shards (the
output directory) -> summary. `baseline` keeps the first batched `generate` path for the benchmark
(`bench`); `regenerate_rows` answers a list of rows in memory (the embedded default's data).
"""

from .baseline import generate_batched
from .driver import regenerate_rows

__all__ = ["generate_batched", "regenerate_rows"]
