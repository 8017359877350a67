"""The parts of the training checkpoint that hold the trained state (train/parts.py lists them): the model and
its config (`model`, `model_config`), the EMA (`ema`), the alignment projectors (`projector`, with --repa), the
optimizer (`opt`) and fp16's GradScaler (`scaler`). Their tensors load whole or as this rank's shards through
train/parallel.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.dit.family import DiffusionTransformer as DiT  # any family's model
from dit_pipeline.dit.repa import REPAModel
from dit_pipeline.dit.weight_match import check_state_dict
from dit_pipeline.dit.weights import WeightsError
from dit_pipeline.train.optim import check_state
from dit_pipeline.train.parallel import load_module, load_optimizer, optimizer_state
from dit_pipeline.train.part_types import Checkpoint, NoCheck


def _tensors_fit(state_dict: Any, model_config: dict[str, Any], where: str) -> None:
    try:
        check_state_dict(state_dict, model_config, where=where)
    except WeightsError as e:
        raise UserError(f"{e}. Nothing was loaded.") from None


@dataclass
class ModelPart:
    """`model` (the raw DiT's state_dict, official names) and `model_config` (DiT.config)."""

    model: DiT
    keys: ClassVar[tuple[str, ...]] = ("model", "model_config")
    required: ClassVar[tuple[str, ...]] = ("model", "model_config")

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "model_config": self.model.config}

    def check(self, ckpt: Checkpoint, where: str) -> None:
        want, have = self.model.config, ckpt["model_config"]
        keys = [k for k in dict.fromkeys([*want, *have]) if k != "model"]  # block options appear only when on
        diff = [f"{k}: checkpoint {have.get(k)!r}, this run {want.get(k)!r}" for k in keys
                if have.get(k) != want.get(k)]
        if diff:
            raise UserError(f"checkpoint {where} is for a different model ({have.get('model') or 'custom'}): "
                            + "; ".join(diff) + ". Use the same --model and overrides, or a new --run-dir.")
        _tensors_fit(ckpt["model"], want, f"{where} [model]")

    def load_state_dict(self, ckpt: Checkpoint) -> None:
        load_module(self.model, ckpt["model"])  # whole tensors, or this rank's shards (train.parallel)


@dataclass
class EmaPart:
    """`ema`: the fp32 EMA weights (official names), held by rank 0 only under DDP (`ema` None elsewhere), by
    every rank as its shards under the sharded modes (train.parallel)."""

    ema: DiT | None
    model_config: dict[str, Any]
    keys: ClassVar[tuple[str, ...]] = ("ema",)
    required: ClassVar[tuple[str, ...]] = ("ema",)

    def state_dict(self) -> dict[str, Any]:
        assert self.ema is not None, "the EMA lives on the ranks that write checkpoints"
        return {"ema": self.ema.state_dict()}

    def check(self, ckpt: Checkpoint, where: str) -> None:
        _tensors_fit(ckpt["ema"], self.model_config, f"{where} [ema]")

    def load_state_dict(self, ckpt: Checkpoint) -> None:
        if self.ema is not None:
            load_module(self.ema, ckpt["ema"])


@dataclass
class ProjectorPart:
    """`projector` (runs with --repa): the alignment projectors' state_dict, the aligned block and the teacher.
    Absent from checkpoints of runs without alignment; a checkpoint and a run must agree on having it."""

    head: REPAModel | None              # None: this run trains without --repa
    teacher: dict[str, Any] | None = None  # the teacher's identity (common.teacher), recorded
    keys: ClassVar[tuple[str, ...]] = ("projector",)
    required: ClassVar[tuple[str, ...]] = ()

    def state_dict(self) -> dict[str, Any]:
        if self.head is None:
            return {}
        return {"projector": {"state_dict": self.head.projectors.state_dict(), **self.head.config,
                              "teacher": self.teacher}}

    def check(self, ckpt: Checkpoint, where: str) -> None:
        saved = ckpt.get("projector")
        if self.head is None:
            if saved is not None:
                raise UserError(f"checkpoint {where} was trained with --repa (its projector is in the file); pass "
                                "--repa again to continue it, or use a new --run-dir")
            return
        if saved is None:
            raise UserError(f"checkpoint {where} was trained without --repa; continue it without --repa, or use a "
                            "new --run-dir to train with alignment")
        want = self.head.config
        diff = [f"{k}: checkpoint {saved.get(k)!r}, this run {v!r}" for k, v in want.items() if saved.get(k) != v]
        if diff:
            raise UserError(f"checkpoint {where} aligns differently ({'; '.join(diff)}); use the same --repa-depth "
                            "and teacher, or a new --run-dir")
        mine = self.head.projectors.state_dict()
        theirs = saved["state_dict"]
        if set(theirs) != set(mine) or any(theirs[k].shape != v.shape for k, v in mine.items()):
            raise UserError(f"checkpoint {where}: its projector's tensors do not fit this run's. Nothing was loaded.")

    def load_state_dict(self, ckpt: Checkpoint) -> None:
        if self.head is not None:
            load_module(self.head.projectors, ckpt["projector"]["state_dict"])


@dataclass
class OptimizerPart:
    """`opt`: the optimizer's state_dict over the trainable tensors (the DiT's, then the projector's with
    --repa): AdamW's one parameter group, or with --optimizer muon {"muon": ..., "adamw": ...} (train.optim). A DDP
    run keeps torch's layout (tensors by index); a sharded run's are keyed by parameter name (train.parallel), and
    either continues in either mode."""

    opt: torch.optim.Optimizer | None
    trainable: int                      # trainable tensors of the model
    kind: str = "adamw"                 # --optimizer
    module: torch.nn.Module | None = None  # the module whose trainable tensors it updates (their names)
    keys: ClassVar[tuple[str, ...]] = ("opt",)
    required: ClassVar[tuple[str, ...]] = ("opt",)

    def state_dict(self) -> dict[str, Any]:
        assert self.opt is not None and self.module is not None
        return {"opt": optimizer_state(self.module, self.opt)}

    def check(self, ckpt: Checkpoint, where: str) -> None:
        problem = check_state(ckpt["opt"], self.kind, self.trainable, where)
        if problem:
            raise UserError(problem)

    def load_state_dict(self, ckpt: Checkpoint) -> None:
        assert self.opt is not None and self.module is not None
        load_optimizer(self.module, self.opt, ckpt["opt"])


@dataclass
class ScalerPart(NoCheck):
    """`scaler`: fp16's GradScaler state (None when the run does not use one)."""

    scaler: torch.amp.GradScaler | None
    keys: ClassVar[tuple[str, ...]] = ("scaler",)
    required: ClassVar[tuple[str, ...]] = ()

    def state_dict(self) -> dict[str, Any]:
        on = self.scaler is not None and self.scaler.is_enabled()
        return {"scaler": self.scaler.state_dict() if on else None}  # type: ignore[union-attr]

    def load_state_dict(self, ckpt: Checkpoint) -> None:
        if self.scaler is not None and self.scaler.is_enabled() and ckpt.get("scaler") is not None:
            self.scaler.load_state_dict(ckpt["scaler"])
