"""The named stateful parts of a training run: each owns its checkpoint keys.

A part knows three things about its keys (torchtitan's `checkpointer.build(states=...)`, edm2's
`CheckpointIO(net=..., optimizer=..., ema=...)`):
- `state_dict()`: its keys' values for a checkpoint (JSON-compatible values or tensors only, so the file loads
  with `torch.load(weights_only=True)`);
- `check(ckpt, where)`: whether a checkpoint can continue this run, a `UserError` naming the mismatch. Every
  part's check runs before any part loads, so a refused checkpoint never half-loads;
- `load_state_dict(ckpt)`: continue from the checkpoint.
`required` names the keys a complete checkpoint holds for the part; the others may be absent in files written
before the key existed (the protocol: train/part_types.py). `train.checkpoint` composes the parts into one file
(format name and version, atomic write, retention, safe read); `build_parts` is the one list of them, so a new
checkpoint key is a new part listed here (or a key of an existing one) and nothing else.

The parts live by what they hold: what the run is (objective, shard set, config: train/setting_parts.py), its
trained state (model, EMA, projector, optimizer, scaler: train/model_parts.py), where it continues (progress,
RNG: train/progress_parts.py), and a feature's own part beside the feature (guard, mix, REG, text).

A part built for checking only (train.resume, before any GPU work) gets a meta-device model and no live
optimizer: its check needs the run's shapes and settings, never live state.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from dit_pipeline.dit.family import DiffusionTransformer as DiT  # any family's model
from dit_pipeline.dit.repa import REPAModel
from dit_pipeline.train.guard import GuardPart
from dit_pipeline.train.mixpart import MixPart
from dit_pipeline.train.model_parts import EmaPart, ModelPart, OptimizerPart, ProjectorPart, ScalerPart
from dit_pipeline.train.part_types import Checkpoint, Part
from dit_pipeline.train.progress_parts import ProgressPart, RngPart
from dit_pipeline.train.reg import RegPart
from dit_pipeline.train.setting_parts import ConfigPart, ObjectivePart, ShardSetPart
from dit_pipeline.train.text import TextPart

# Every part type, in the order their checks run (the first mismatch is the one reported): what the run is
# (objective, model, shard set, global batch) before the state that must fit it.
PART_TYPES: tuple[type[Part], ...] = (ObjectivePart, RegPart, ModelPart, ShardSetPart, ConfigPart, EmaPart,
                                      ProjectorPart, OptimizerPart, ScalerPart, TextPart, ProgressPart, MixPart, RngPart,
                                      GuardPart)
REQUIRED_KEYS: tuple[str, ...] = tuple(k for t in PART_TYPES for k in t.required)


def build_parts(*, objective: str, config: dict[str, Any], shard_set: ShardSetPart,
                model: DiT, ema: DiT | None = None, head: REPAModel | None = None,
                teacher: dict[str, Any] | None = None,
                opt: torch.optim.Optimizer | None = None, scaler: torch.amp.GradScaler | None = None,
                progress: ProgressPart | None = None, guard: GuardPart | None = None,
                text: dict[str, Any] | None = None, reg: RegPart | None = None,
                mix: MixPart | None = None) -> list[Part]:
    """The parts of one run, in PART_TYPES order. For checking only (no live optimizer yet), `model` (and the
    alignment `head` around it) may live on the meta device and ema/opt/scaler/progress be None."""
    trained = head if head is not None else model
    trainable = sum(1 for q in trained.parameters() if q.requires_grad)
    parts: list[Part] = [ObjectivePart(objective, config), reg if reg is not None else RegPart(None),
                         ModelPart(model), shard_set, ConfigPart(config), EmaPart(ema, model.config),
                         ProjectorPart(head, teacher),
                         OptimizerPart(opt, trainable, str(config.get("optimizer", "adamw")), trained),
                         ScalerPart(scaler),
                         TextPart(text)]
    if progress is not None:
        parts.append(progress)
    if mix is not None:  # a data mix's record, counts and history (train/mixpart.py), after the progress it moves
        parts.append(mix)
    if progress is not None:
        parts.append(RngPart())
    if guard is not None:  # the divergence guard's state (train/guard.py)
        parts.append(guard)
    return parts


def compose(parts: Sequence[Part]) -> dict[str, Any]:
    """The checkpoint content of `parts` (without format and version); each key written by one part."""
    out: dict[str, Any] = {}
    for part in parts:
        values = part.state_dict()  # every key of the part, or none of an optional part that is off
        assert set(values) <= set(part.keys) and not set(values) & set(out), type(part).__name__
        out.update(values)
    return out


def check_all(parts: Sequence[Part], ckpt: Checkpoint, where: str) -> None:
    """Every part's resume rule, in order; the first mismatch raises (nothing is loaded before this passes)."""
    for part in parts:
        part.check(ckpt, where)


def load_all(parts: Sequence[Part], ckpt: Checkpoint, where: str) -> None:
    """Continue every part from `ckpt`, after all of their checks passed."""
    check_all(parts, ckpt, where)
    for part in parts:
        part.load_state_dict(ckpt)
