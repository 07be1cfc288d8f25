"""dflash_trainer: train DFlash block-diffusion drafters for speculative decoding.

Imported as ``dflash_trainer`` (it lives in ``dflash/dflash_trainer``) so it never shadows z-lab's ``dflash``
inference package, which users install beside it to serve what we train.
"""

__version__ = "0.1.0"
