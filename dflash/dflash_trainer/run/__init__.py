"""One training run: loading the target, data and drafter, the step and its compile step, the target
ranks' loop, evaluation before and after, the run directory, checkpoints, stop requests and the summary."""
