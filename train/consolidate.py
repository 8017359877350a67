"""`dit-train --consolidate RUN/checkpoints/step-N.dcp`: a sharded run's checkpoint as the files a DDP run writes.

It writes `step-N.pt` (every key of the checkpoint in one file: the model, the EMA, the optimizer in torch's
index layout, the records; DDP resumes from it, dit-sample and the export read it), `step-N-ema.pt` (the bare
EMA state_dict with its record embedded) and its sidecar `step-N-ema.json`, beside the folder, through the same
writer as a DDP run (train.checkpoint.CheckpointManager.save: temp names, fsync, rename; EMA files first).

Streaming: no process group, and never more than one tensor in memory. Every tensor gets a file of its own in a
temp folder beside the output, mapped as its storage (torch.from_file, shared: its pages belong to the page cache,
which the kernel writes back and drops as it needs); one torch.distributed.checkpoint read fills them from the
per-rank safetensors files of any number of ranks, one tensor piece at a time, and torch.save then copies those
files into the checkpoint. The temp folder is removed at the end (or at the next start of the run, if killed).
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from dit_pipeline.common import sharding
from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import TMP_PREFIX
from dit_pipeline.dit.formats import SHARDED_KEYS, SHARDED_SUFFIX
from dit_pipeline.train.checkpoint import (CheckpointManager, checkpoint_name, ema_name, is_sharded_checkpoint,
                                           load_sharded, replace_leaves)
from dit_pipeline.train.parallel import by_index


def consolidate(path: str | Path, *, quiet: bool = False) -> list[Path]:
    """Write the DDP files of the sharded checkpoint `path` beside it (module docstring); returns their paths."""
    path = Path(path).expanduser()
    if not is_sharded_checkpoint(path):
        raise UserError(f"--consolidate {path}: not a sharded checkpoint folder (RUN/checkpoints/step-N{SHARDED_SUFFIX}, "
                        "written by a run with --parallel zero2, fsdp or hsdp)")
    view = load_sharded(path)  # complete, every tensor's shape known; nothing read yet
    step = int(view["step"])
    outputs = [path.parent / checkpoint_name(step), path.parent / ema_name(step),
               path.parent / ema_name(step).replace(".pt", ".json")]
    there = [p.name for p in outputs if p.exists()]
    if there:
        raise UserError(f"--consolidate {path}: {', '.join(there)} already exist(s) in {path.parent}; nothing was "
                        "overwritten (move them away to consolidate again)")
    with tempfile.TemporaryDirectory(prefix=TMP_PREFIX + "consolidate-", dir=path.parent) as tmp:
        values: dict[str, torch.Tensor] = {}

        def backed(key: str, meta: torch.Tensor) -> torch.Tensor:
            """An empty tensor of `meta`'s shape on a file of its own (no anonymous memory)."""
            file = str(Path(tmp) / f"{len(values)}.bin")
            values[key] = (torch.from_file(file, shared=True, size=meta.numel(), dtype=meta.dtype).view(meta.shape)
                           if meta.numel() else torch.empty(meta.shape, dtype=meta.dtype))
            return values[key]

        state: dict[str, Any] = {k: replace_leaves(v, backed, k) if k in SHARDED_KEYS else v for k, v in view.items()}
        if not quiet:
            print(f"reading {len(values)} tensors of {path} ({sum(t.nbytes for t in values.values()) / 2**30:.2f} GiB)",
                  flush=True)
        sharding.load_tensors(values, path, collective=False)  # one read; its reader holds one tensor at a time
        state.pop("sharded")
        opt = state["opt"]
        if isinstance(opt, dict) and "param_groups" in opt:  # torch's index layout, as a DDP run writes it
            state["opt"] = by_index(opt, [n for g in opt["param_groups"] for n in g["params"]])
        CheckpointManager(path.parent).save(state, prune=False)
    return outputs
