"""The frozen training environment: lock, wheelhouse, image, Proxmox template, drift doctor.

Imported as `dflash_image`. The modules that run inside the training container (doctor, pylock,
markers) use only the standard library, because the locked environment is all they can count on.
"""
