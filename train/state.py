"""The Trainer's own counters (`TrainState`: step, epoch, position in the epoch, skipped shards), the weights
fingerprint that proves every rank holds the same model, and `comm_guard` for the loop's collectives.

What a checkpoint holds is composed by the named parts of train.parts (TrainState's part is
train.progress_parts.ProgressPart).
"""
from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, field

import torch

from dit_pipeline.common import distributed as dist
from dit_pipeline.common import sharding
from dit_pipeline.train.partition import DataLayout


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
    carried: DataLayout | None = None  # the layout `epoch` is read under when a resume changed it (train.handover)


def weights_fingerprint(model: torch.nn.Module) -> str:
    """Cheap digest of all parameters (float64 sums), to prove every rank holds the same weights."""
    with torch.no_grad():  # a sharded run: this rank's shards (train.parallel.Parallel.replica_groups compares)
        sums = torch.stack([sharding.local_part(p).sum(dtype=torch.float64) for p in model.parameters()]).cpu()
    return hashlib.sha256(sums.numpy().tobytes()).hexdigest()[:16]
