"""Weights & Biases as an optional metrics sink (`dit-train --wandb`, extra `dit-pipeline[wandb]`), rank 0 only.

The same scalars as TensorBoard, under the same names (train.metrics.scalar_tags), plus `train/step`, the
optimizer step, which every chart uses as its x axis (`define_metric(..., step_metric="train/step")`): W&B's
own `_step` only counts `log` calls and never goes back, while the optimizer step does after a resume from an
earlier checkpoint or a divergence-guard rollback (train/guard.py), whose steps are logged again.

The W&B run id is kept in `RUN/wandb-id`, written before the first record, so a resumed run (any later
invocation on the same folder) or a rolled-back one continues the same W&B run (`resume="allow"`). The files go
to `RUN/wandb/`. `WANDB_MODE=offline` needs no network (`wandb sync RUN/wandb/offline-run-*` uploads later);
the tests run it so.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from dit_pipeline.common.io import atomic_write_bytes
from dit_pipeline.common.log import get_logger

ID_FILE = "wandb-id"


def run_id(run_dir: Path) -> str:
    """The run folder's W&B run id, made (random, 8 base-36 characters as W&B's own) and kept at first use."""
    path = run_dir / ID_FILE
    if path.is_file():
        kept = path.read_text(encoding="utf-8").strip()
        if kept:
            return kept
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    new = "".join(secrets.choice(alphabet) for _ in range(8))  # os.urandom: no global random state drawn
    atomic_write_bytes(path, (new + "\n").encode())
    return new


class WandbSink:
    """One W&B run per run folder (see the module docstring); opened at the first record."""

    def __init__(self, run_dir: Path, project: str, config: dict[str, Any]):
        self.run_dir, self.project, self.config = Path(run_dir), project, config
        self._run: Any = None

    def _open(self) -> Any:
        import wandb

        rid = run_id(self.run_dir)
        run = wandb.init(project=self.project, id=rid, resume="allow", dir=str(self.run_dir),
                         name=self.run_dir.name, config=self.config,
                         settings=wandb.Settings(console="off", silent=True))
        run.define_metric("train/step")
        run.define_metric("*", step_metric="train/step")
        mode = os.environ.get("WANDB_MODE", "online")
        get_logger().info(f"W&B run {rid} (project {self.project}, {mode}) in {self.run_dir / 'wandb'}"
                          + (f"; upload with `wandb sync {self.run_dir / 'wandb'}/offline-run-*`"
                             if mode == "offline" else ""))
        return run

    def log(self, scalars: dict[str, float], step: int) -> None:
        if self._run is None:
            self._run = self._open()
        self._run.log({**scalars, "train/step": step})

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
