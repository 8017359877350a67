"""The trainer's periodic hooks as a typed protocol: `HookContext` (what a hook sees after a step) and
`PeriodicHook` (what the loop calls).

Defined here at the bottom of the import picture so that the hooks' owners (sample/ for the grids,
evaluate/ for FID) type their hooks against it without importing train/; train/hooks.py builds them.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Protocol

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
    ema: torch.nn.Module | None        # fp32 EMA DiT on rank 0, None elsewhere (sharded: every rank, its shards)
    model_config: dict[str, Any]       # DiT.config
    latent: dict[str, Any]             # {"scaling_factor", "shift_factor", ["normalization",] "vae", "class_names"}
    num_classes: int
    config: dict[str, Any]             # the resolved TrainConfig as a dict
    class_names: list[str] | None = None  # the manifest's (sorted class-folder names), None when unknown
    metrics: MetricsWriter | None = None  # write({"step": ..., name: value}) (rank 0 writes metrics.jsonl)
    # The sharded modes (--parallel zero2/fsdp/hsdp): `model` and `ema` hold this rank's shards, so a pass of
    # either is a collective that every rank runs at the same time: `with ctx.evaluation(ctx.model) as m: m(x, t)`
    # (m: what runs the module's forward outside the training step; everything resharded after). Otherwise rank 0
    # holds both whole, and `evaluation(module)` yields the module itself.
    sharded: bool = False
    evaluation: Callable[[torch.nn.Module], ContextManager[torch.nn.Module]] = contextlib.nullcontext
    # A text run: its text encoder (rebuilt from the text set's identity, common/text_encoders.py) loaded on each
    # call, for prompts a hook encodes once (the grids'); None for every other run.
    text_encoder: Callable[[], Any] | None = None

    def runs_passes(self) -> bool:
        """Whether this rank runs a hook's passes of the model: rank 0, which holds the whole model and EMA; every
        rank under the sharded modes, together."""
        return self.rank == 0 or self.sharded


@contextlib.contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """`model` in eval mode (no label dropout: no global random draws, which a hook must not make) and back to its
    mode after."""
    was = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was)


class PeriodicHook(Protocol):
    """Called on every rank whenever `ctx.step % every == 0` (its return value is not used); it may also have
    `setup(ctx)`, called once before the first step (see train/hooks.py)."""

    every: int

    def __call__(self, ctx: HookContext) -> Any: ...
