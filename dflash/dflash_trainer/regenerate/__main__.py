"""python -m dflash_trainer.regenerate (and torchrun -m dflash_trainer.regenerate)."""

import sys

from .cli import main

sys.exit(main())
