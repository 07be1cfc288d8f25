"""The frozen training environment: lock, wheelhouse, image, Proxmox template, drift doctor.

Imported as `dflash_image`. The rebuild (with digest, manifest, pylock) runs under a bare system Python
in the image build and in stock containers, so it uses only the standard library. The doctor runs
inside the frozen venv, isolated, with the standard library and the venv's own `packaging`.
"""
