"""Run control inside the training container (and on the local machine): preflight, supervision, status and
logs of the jobs (training, regeneration, evaluation); `dflash-run` (jobs.py says what a job is).

Shipped in the trainer's wheel, and the standard library only: `make train-status` and `make train-stop`
must work even when the trainer's own dependencies (torch, transformers) fail to import, and it imports
in a blink (the role calls it for every status).
"""
