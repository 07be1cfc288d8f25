"""python -m dflash_trainer.export: dflash-export, started and ended as the console script is (infra/entry.py)."""
from ..infra.entry import export

export()
