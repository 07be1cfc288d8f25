"""Training scalars to TensorBoard (when installed) and Weights & Biases (when installed and configured).

W&B is on when `train.wandb_project` (or the WANDB_PROJECT environment variable) names a project. Its
credentials come from wandb's own login or WANDB_API_KEY and never pass through this code or its logs.
"""

from __future__ import annotations

import os
from pathlib import Path


class Metrics:
    def __init__(self, tb_dir: Path, run_config: dict, wandb_project: str | None = None, run_name: str | None = None,
                 log=print):
        self.tb = None
        self.wandb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(tb_dir))
        except ImportError:
            log("tensorboard is not installed: no TensorBoard logs (pip install tensorboard)")
        project = wandb_project or os.environ.get("WANDB_PROJECT")
        if project:
            try:
                import wandb
            except ImportError:
                log(f"W&B project {project!r} is configured but wandb is not installed: logging to TensorBoard "
                    "only (pip install wandb, or unset train.wandb_project / WANDB_PROJECT)")
            else:
                self.wandb = wandb.init(project=project, name=run_name, config=run_config, dir=str(tb_dir.parent))
                log(f"W&B: run {getattr(self.wandb, 'name', '?')} in project {project}")

    def scalars(self, values: dict[str, float], step: int) -> None:
        """values: 'group/name' -> number."""
        if self.tb is not None:
            for key, value in values.items():
                self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(dict(values), step=step)

    def summary(self, values: dict) -> None:
        if self.wandb is not None:
            for key, value in values.items():
                if isinstance(value, int | float | str) or value is None:
                    self.wandb.summary[key] = value

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
