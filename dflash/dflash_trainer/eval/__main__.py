"""python -m dflash_trainer.eval: dflash-eval, started and ended as the console script is (infra/entry.py)."""
from ..infra.entry import evaluate

evaluate()
