"""Run control inside the training container (and on the local machine): preflight, supervision, status.

Standard library only: it runs with the training venv's interpreter before anything else is checked,
and `make train-status` must work even when the trainer itself cannot be imported.
"""
