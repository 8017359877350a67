"""The trainer's periodic hooks as a typed protocol: `HookContext` (what a hook sees after a step) and
`PeriodicHook` (what the loop calls).

Defined here at the bottom of the import picture so that the hooks' owners (sample/ for the grids,
evaluate/ for FID) type their hooks against it without importing train/; train/hooks.py builds them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch


class MetricsWriter(Protocol):
    """What a hook writes its numbers through (train.metrics.MetricsLog; rank 0 writes the shared file)."""

    def write(self, record: dict[str, Any]) -> None: ...


@dataclass
class HookContext:
    step: int                          # optimizer steps done
    epoch: int
    rank: int
    world_size: int
    run_dir: Path
    device: torch.device
    model: torch.nn.Module             # the raw DiT (no DDP/compile wrapper), in train mode
    ema: torch.nn.Module | None        # fp32 EMA DiT on rank 0, None elsewhere
    model_config: dict[str, Any]       # DiT.config
    latent: dict[str, Any]             # {"scaling_factor", "shift_factor", ["normalization",] "vae", "class_names"}
    num_classes: int
    config: dict[str, Any]             # the resolved TrainConfig as a dict
    class_names: list[str] | None = None  # the manifest's (sorted class-folder names), None when unknown
    metrics: MetricsWriter | None = None  # write({"step": ..., name: value}) (rank 0 writes metrics.jsonl)


class PeriodicHook(Protocol):
    """Called on every rank whenever `ctx.step % every == 0` (its return value is not used); it may also have
    `setup(ctx)`, called once before the first step (see train/hooks.py)."""

    every: int

    def __call__(self, ctx: HookContext) -> Any: ...
