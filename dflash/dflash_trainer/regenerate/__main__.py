"""python -m dflash_trainer.regenerate (and torchrun -m dflash_trainer.regenerate): dflash-regenerate, started and
ended as the console script is (infra/entry.py)."""

from ..infra.entry import regenerate

regenerate()
