"""python -m dflash_run: the same as the dflash-run command."""

import sys

from .cli import main

sys.exit(main())
