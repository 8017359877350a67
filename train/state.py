"""The Trainer's state and its checkpoint: `state_dict()` builds what a checkpoint holds, `load_state_dict()`
continues from one, `checkpoint()` writes one (a collective).

The format's name, version and required keys are defined once, in `dit.formats` (dit/weights.py reads the
same files); `train.checkpoint` writes, prunes and safely reads the files. A checkpoint is checked against
this run (model, shard set, global batch, tensor names and shapes, optimizer layout) before anything is
loaded, so a mismatch never half-loads. The data position is stored as (epoch, step in epoch) together with
the data layout; a resume under another layout maps the position (`train.partition.map_position`).
"""
from __future__ import annotations

import contextlib
import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dit_pipeline.common import distributed as dist
from dit_pipeline.common.log import get_logger
from dit_pipeline.dit.formats import CHECKPOINT_FORMAT, CHECKPOINT_VERSION
from dit_pipeline.train.checkpoint import check_resumable, rng_state, set_rng_state
from dit_pipeline.train.partition import DataLayout, map_position


PeerLost = dist.PeerLost  # a collective failed because another rank died or hung


def comm_guard(what: str, step: int) -> contextlib.AbstractContextManager[None]:
    """Turn a failed collective into one clear line (instead of a backend traceback) on surviving ranks."""
    return dist.peer_guard(f"{what} at step {step}", logs="RUN/logs/rank*.log")


@dataclass
class TrainState:
    step: int = 0              # optimizer steps done
    epoch: int = 0
    step_in_epoch: int = 0     # optimizer steps done within `epoch`
    overflow_steps: int = 0    # fp16 steps skipped by the GradScaler
    bad_shards: int = 0        # distinct shards skipped with --skip-bad-shards (all ranks)
    bad_shard_names: list[str] = field(default_factory=list)  # those shards: no later epoch reads them
    exact: bool = True         # False after a resume with a different data layout (logged)


def weights_fingerprint(model: torch.nn.Module) -> str:
    """Cheap digest of all parameters (float64 sums), to prove every rank holds the same weights."""
    with torch.no_grad():
        sums = torch.stack([p.sum(dtype=torch.float64) for p in model.parameters()]).cpu()
    return hashlib.sha256(sums.numpy().tobytes()).hexdigest()[:16]


class CheckpointMixin:
    """The checkpoint half of `train.loop.Trainer` (kept apart so that each file stays readable)."""

    def state_dict(self: Any) -> dict[str, Any]:
        """Everything a checkpoint holds (docs/ARCHITECTURE.md); rank 0 only (it holds the EMA)."""
        p, s, m = self.p, self.state, self.source.manifest
        epoch, in_epoch = self.data_position()
        return {
            "format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION,
            "model": p.model.state_dict(), "ema": p.ema.state_dict(), "opt": p.opt.state_dict(),
            "scaler": p.scaler.state_dict() if p.scaler.is_enabled() else None,
            "step": s.step, "epoch": epoch,
            "data": {"epoch": epoch, "step_in_epoch": in_epoch, **self.layout.to_dict(),
                     "overflow_steps": s.overflow_steps, "bad_shards": s.bad_shards,
                     "bad_shard_names": list(s.bad_shard_names)},
            "rng": rng_state(), "model_config": p.model.config, "objective": self.cfg.objective,
            "latent": {"scaling_factor": m.scaling_factor, "shift_factor": m.shift_factor,
                       "vae": m.extraction.get("vae"), "class_names": list(m.class_names or [])},
            "config": self.cfg.to_dict(), "manifest_fingerprint": self.source.fingerprint,
        }

    def load_state_dict(self: Any, ckpt: dict[str, Any], where: Path) -> None:
        """Continue from `ckpt` (read from `where`): checked against this run first, then loaded."""
        p = self.p
        check_resumable(ckpt, where, model=p.model, fingerprint=self.source.fingerprint,
                        global_batch=self.cfg.global_batch_size, objective=self.cfg.objective)
        p.model.load_state_dict(ckpt["model"], strict=True)
        if p.ema is not None:
            p.ema.load_state_dict(ckpt["ema"], strict=True)
        p.opt.load_state_dict(ckpt["opt"])
        if p.scaler.is_enabled() and ckpt.get("scaler") is not None:
            p.scaler.load_state_dict(ckpt["scaler"])
        if ckpt.get("rng"):
            set_rng_state(ckpt["rng"])
        data = ckpt["data"]
        s = self.state
        # before the position is mapped: the epoch plans count the skipped shards as empty (a checkpoint
        # written before the names were kept has none: its count stays as it was)
        s.bad_shard_names = [str(n) for n in data.get("bad_shard_names", [])]
        epoch, step_in_epoch, exact = self._map_position(data)
        get_logger().info(f"resumed from {where} at step {ckpt['step']} (epoch {epoch}, step {step_in_epoch} "
                          "in epoch)")
        s.step, s.epoch, s.step_in_epoch, s.exact = int(ckpt["step"]), epoch, step_in_epoch, exact
        s.overflow_steps = int(data.get("overflow_steps", 0))
        s.bad_shards = max(len(s.bad_shard_names), int(data.get("bad_shards", 0)))
        self.last_saved = s.step
        self.meter.reset()  # the first log interval is timed from after the resume
        self.own.reset()

    def _map_position(self: Any, data: dict[str, Any]) -> tuple[int, int, bool]:
        """(epoch, step in epoch, exact) where this run continues; warns when the data layout changed."""
        # a field the checkpoint lacks counts as changed (-1): the position is mapped, never silently reused
        saved = DataLayout(**{k: int(data.get(k, -1)) for k in DataLayout.__dataclass_fields__})
        steps = self.plan(int(data["epoch"])).steps
        pos = map_position(int(data["epoch"]), int(data["step_in_epoch"]), saved, self.layout, steps)
        if not pos.exact:
            changed = ", ".join(f"{k} {getattr(saved, k)} -> {getattr(self.layout, k)}"
                                for k in DataLayout.__dataclass_fields__
                                if getattr(saved, k) != getattr(self.layout, k))
            get_logger().warning(
                f"resuming with a different data layout ({changed}): the reading order of epoch {pos.epoch} "
                f"changes, so training continues at step {pos.step_in_epoch} of {steps} of that epoch in the "
                "new order; within this epoch some samples may be seen twice and others not at all. Later "
                "epochs are complete. The run is no longer identical to an uninterrupted one.")
        return pos.epoch, pos.step_in_epoch, pos.exact

    def checkpoint(self: Any) -> Path | None:
        """Collective: all ranks compare weight fingerprints; rank 0 writes the checkpoint."""
        s = self.state
        fp = weights_fingerprint(self.p.model)
        self.metrics.write_rank({"step": s.step, "weights_fingerprint": fp})
        with comm_guard("the weights check before a checkpoint", s.step):
            every = dist.all_gather_object(fp)
        if len(set(every)) > 1:
            raise RuntimeError(f"step {s.step}: ranks hold different weights (fingerprints {every}); DDP "
                               "replicas diverged, which is a bug or a hardware fault")
        path = None
        if dist.is_main():
            t0 = time.perf_counter()
            path = self.ckpts.save(self.state_dict())
            get_logger().info(f"saved checkpoint {path} (+ EMA weights) in {time.perf_counter() - t0:.1f}s")
        self.last_saved = s.step
        return path
