"""The training checkpoint as one object: format name and version, the crash-safe write, retention and the
safe read (docs/ARCHITECTURE.md, "Checkpoints").

What a checkpoint holds is composed by the run's named parts (train.parts: each owns its keys, their
state_dict / load_state_dict and the rule for resuming from them); this module turns them into files.
`RUN/checkpoints/step-0001000.pt` loads with `torch.load(weights_only=True)`. Beside it `step-0001000-ema.pt`
is a bare EMA state_dict in the official DiT release format, and `step-0001000-ema.json` its sidecar
(dit.make_sidecar: model_config, latent scale, step, objective), which `dit.load_dit_weights` reads so that
models of any size load from the bare file. The EMA file and its sidecar are written first and the full
checkpoint last, each to a temp name, fsynced and renamed (common.io), so the newest full checkpoint is
always complete; a SIGKILL mid-save leaves only a temp file, removed on the next start. Retention keeps the
last K plus every `keep_every` steps (with their EMA files). Reading goes through `dit.weight_files.read_torch_file`,
the one safe read that `dit-sample` uses too.

A sharded run (train/parallel.py) writes `step-0001000.dcp/` instead: every rank its shards of the tensors under
`dit.formats.SHARDED_KEYS` (model, EMA, optimizer, projector) into one safetensors file of its own through
torch.distributed.checkpoint, all at once, into a temp folder; then rank 0 writes `records.pt` (every other key,
each of those tensors replaced by a placeholder naming it, and the files written with their sizes) and renames the
folder into place: the rename is the commit, so a SIGKILL at any moment leaves the previous checkpoint the newest
complete one. Reading it needs no process group and no unpickling (safetensors headers and a weights_only
records file); its tensors load into any sharding, or whole (`materialize`). `dit-train --consolidate` turns it
into the files a DDP run writes (train/consolidate.py).
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path
from typing import IO, Any, Mapping, Sequence, cast

import torch

from dit_pipeline.common import distributed as dist
from dit_pipeline.common import sharding
from dit_pipeline.common.errors import UserError
from dit_pipeline.common.faults import fault_point
from dit_pipeline.common.io import (TMP_PREFIX, atomic_write, atomic_write_json, fsync_dir, missing_file,
                                    remove_stale_temps)
from dit_pipeline.dit.formats import CHECKPOINT_FORMAT as FORMAT
from dit_pipeline.dit.formats import CHECKPOINT_VERSION as VERSION
from dit_pipeline.dit.formats import SHARDED_KEYS, SHARDED_PLACEHOLDER, SHARDED_RECORDS, SHARDED_SUFFIX
from dit_pipeline.dit.weight_files import read_torch_file
from dit_pipeline.dit.weight_records import embed_record, make_sidecar, sidecar_path, text_record
from dit_pipeline.dit.weights import WeightsError
from dit_pipeline.train.parallel import tensor_leaves
from dit_pipeline.train.part_types import Part
from dit_pipeline.train.parts import REQUIRED_KEYS, compose

FAULT_MID_SAVE = "train.ckpt_mid_save"
_NAME_RE = re.compile(r"^step-(\d{7,})\.pt$")
_EMA_RE = re.compile(r"^step-(\d{7,})-ema\.(pt|json)$")  # the EMA weights and their sidecar
_SHARDED_RE = re.compile(r"^step-(\d{7,})" + re.escape(SHARDED_SUFFIX) + "$")  # a sharded checkpoint's folder
_OLD = TMP_PREFIX + "old-"  # a sharded checkpoint being replaced by a rewrite of its step (a rollback)


def checkpoint_name(step: int) -> str:
    return f"step-{step:07d}.pt"


def sharded_name(step: int) -> str:
    return f"step-{step:07d}{SHARDED_SUFFIX}"


def is_sharded_checkpoint(path: str | Path) -> bool:
    return Path(path).is_dir() and Path(path).name.endswith(SHARDED_SUFFIX)


def replace_leaves(tree: Any, fn: Any, prefix: str = "") -> Any:
    """`tree` with every tensor leaf (and placeholder) replaced by fn(path, leaf)."""
    if isinstance(tree, torch.Tensor) or (isinstance(tree, Mapping) and set(tree) == {SHARDED_PLACEHOLDER}):
        return fn(prefix, tree)
    if isinstance(tree, Mapping):
        return {k: replace_leaves(v, fn, f"{prefix}/{k}" if prefix else str(k)) for k, v in tree.items()}
    return tree


def split_sharded(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(the records: `state` with each tensor under SHARDED_KEYS replaced by a placeholder naming its path, the
    tensors by path) of a checkpoint's content."""
    tensors: dict[str, torch.Tensor] = {}

    def take(path: str, t: torch.Tensor) -> dict[str, str]:
        tensors[path] = t
        return {SHARDED_PLACEHOLDER: path}

    records = {k: replace_leaves(v, take, k) if k in SHARDED_KEYS else v for k, v in state.items()}
    return records, tensors


def ema_name(step: int) -> str:
    return f"step-{step:07d}-ema.pt"


class _FaultWriter:
    """File wrapper that passes the fault-injection point `train.ckpt_mid_save` once the temp file holds
    data (when `armed`), so tests can SIGKILL the writer in the middle of a real save (no sleeps, no races),
    and keeps the first write error: torch's zip writer reports a failed write (disk full) only as a
    position mismatch, so `_save` raises the real OSError instead."""

    def __init__(self, f: IO[bytes], armed: bool = True):
        self._f = f
        self._armed = armed
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            n = self._f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise
        if self._armed and n:
            self._armed = False
            self._f.flush()
            fault_point(FAULT_MID_SAVE)
        return n

    def flush(self) -> None:
        self._f.flush()


def _save(obj: Any, path: Path, *, fault: bool = False) -> None:
    with atomic_write(path, "wb") as f:
        writer = _FaultWriter(f, armed=fault)
        try:
            torch.save(obj, cast(IO[bytes], writer))  # it writes and flushes, which is all torch.save uses
        except Exception as e:
            if writer.error is not None:
                raise writer.error from e
            raise


class CheckpointManager:
    """Lists, writes and prunes the checkpoints of one run folder (writes happen on rank 0 only)."""

    def __init__(self, folder: str | Path, keep_last: int = 3, keep_every: int | None = None):
        self.folder = Path(folder)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.pinned: set[int] = set()  # kept whatever the retention: the divergence guard's rollback target

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints (files and sharded folders), ascending."""
        if not self.folder.is_dir():
            return []
        return sorted({int(m.group(1)) for p in self.folder.iterdir()
                       if (m := _NAME_RE.match(p.name) or _SHARDED_RE.match(p.name))})

    def path(self, step: int) -> Path:
        """The checkpoint of `step`: its sharded folder when there is one (a sharded run's own; a consolidated
        file beside it holds the same state), else its file."""
        sharded = self.folder / sharded_name(step)
        return sharded if sharded.is_dir() else self.folder / checkpoint_name(step)

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.path(steps[-1]) if steps else None

    def clean_partial(self) -> list[Path]:
        """Remove temp files of saves that were killed; returns them. A sharded checkpoint whose rewrite was killed
        between its two renames (save_sharded) is put back first."""
        if self.folder.is_dir():
            for old in self.folder.glob(_OLD + "*"):
                target = self.folder / old.name[len(_OLD):]
                if _SHARDED_RE.match(target.name) and not target.exists():
                    old.replace(target)
        return remove_stale_temps(self.folder)

    def save_parts(self, parts: Sequence[Part]) -> Path:
        """`save` of the checkpoint the run's parts compose (train.parts), under this format's name and version."""
        return self.save({"format": FORMAT, "version": VERSION, **compose(parts)})

    def save_sharded(self, parts: Sequence[Part], layout: dict[str, Any]) -> Path:
        """Collective (every rank of a sharded run): the checkpoint of `parts` as a sharded folder (module docstring);
        `layout` (mode, mesh, world size) is recorded. Returns its path on every rank."""
        records, tensors = split_sharded({"format": FORMAT, "version": VERSION, **compose(parts)})
        final = self.folder / sharded_name(int(records["step"]))
        tmp = self.folder / (TMP_PREFIX + final.name)

        def start() -> None:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir()
            except OSError as e:
                raise UserError(f"cannot write checkpoint {final} ({e.strerror or e}); the previous checkpoint is "
                                "intact. Fix the folder and rerun the same command to resume from it.") from None

        with dist.peer_guard(f"writing checkpoint {final.name}"):
            dist.on_rank0(start)
            sharding.save_tensors(tensors, tmp)  # every rank its own file, all at once
            fault_point(FAULT_MID_SAVE)      # every rank's tensors written, nothing committed
            dist.barrier()
            dist.on_rank0(lambda: self._commit(records, tmp, final, layout))
        return final

    def _commit(self, records: dict[str, Any], tmp: Path, final: Path, layout: dict[str, Any]) -> None:
        """Rank 0: the records, then the rename that makes the folder the newest checkpoint; then retention."""
        try:
            files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.suffix == ".safetensors"}
            _save({**records, "sharded": {**layout, "files": files}}, tmp / SHARDED_RECORDS)
            for p in tmp.iterdir():  # the tensors' files durable before the rename makes them the checkpoint
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
            fsync_dir(tmp)
            old = self.folder / (_OLD + final.name)
            if final.exists():  # a rewrite of the same step (a rollback): the old one stays until the new is in place
                final.replace(old)
            tmp.replace(final)
            fsync_dir(self.folder)
            if old.exists():
                shutil.rmtree(old)
        except OSError as e:
            last = self.latest()
            raise UserError(f"cannot write checkpoint {final} ({e.strerror or e}); the previous checkpoint "
                            f"({last.name if last else 'none yet'}) is intact. Free space (or fix the folder) and "
                            "rerun the same command to resume from it.") from None
        fault_point("train.ckpt_saved")
        self.prune()

    def save(self, state: dict[str, Any], *, prune: bool = True) -> Path:
        """Write the EMA-only file, then the full checkpoint, then prune old ones; returns the path."""
        step = int(state["step"])
        path = self.folder / checkpoint_name(step)  # the file (a sharded folder of the step may sit beside it)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            record = make_sidecar(state["model_config"], state.get("latent"), step,
                                  objective=state.get("objective"), time_shift=state.get("time_shift"),
                                  prediction=state.get("prediction"), meanflow=state.get("meanflow"),
                                  text=text_record(state.get("text")))
            # the EMA file holds its record too (dit.weight_records.embed_record), so a copy without the sidecar loads
            _save(embed_record(state["ema"], record), self.folder / ema_name(step))
            atomic_write_json(sidecar_path(self.folder / ema_name(step)), record)
            fault_point("train.ckpt_ema_written")  # EMA file in place, the full checkpoint not yet
            _save(state, path, fault=True)
        except OSError as e:  # disk full, quota, I/O error: the temp file is gone, older files untouched
            last = self.latest()
            raise UserError(f"cannot write checkpoint {path} ({e.strerror or e}); the previous checkpoint "
                            f"({last.name if last else 'none yet'}) is intact. Free space (or fix the folder) and "
                            "rerun the same command to resume from it.") from None
        fault_point("train.ckpt_saved")  # both in place, older ones not yet pruned
        if prune:
            self.prune()
        return path

    def to_keep(self, steps: list[int]) -> set[int]:
        keep = set(steps[-self.keep_last:]) if self.keep_last > 0 else set()
        if self.keep_every:
            keep |= {s for s in steps if s % self.keep_every == 0}
        return keep | (self.pinned & set(steps))

    def set_aside(self, after: int) -> list[Path]:
        """Move the checkpoints (and EMA files) of steps after `after` into `rolled-back/` (a divergence-guard
        rollback abandoned those steps: `latest()` must not resume them; they stay for a post-mortem)."""
        aside = self.folder / "rolled-back"
        moved = []
        # the full checkpoints first: what `latest()` sees never includes an abandoned step, even mid-way
        full = lambda p: _NAME_RE.match(p.name) or _SHARDED_RE.match(p.name)  # noqa: E731
        for p in sorted(self.folder.iterdir(), key=lambda p: (full(p) is None, p.name)):
            m = full(p) or _EMA_RE.match(p.name)
            if m is not None and int(m.group(1)) > after:
                aside.mkdir(exist_ok=True)
                p.replace(aside / p.name)
                moved.append(aside / p.name)
        return moved

    def prune(self) -> list[Path]:
        """Delete checkpoints outside the retention policy, and EMA files (weights and sidecar) whose
        checkpoint is gone."""
        steps = self.steps()
        keep = self.to_keep(steps)
        removed = []
        for p in sorted(self.folder.iterdir()):
            m = _NAME_RE.match(p.name) or _EMA_RE.match(p.name) or _SHARDED_RE.match(p.name)
            if m is None:
                continue
            step = int(m.group(1))
            # An EMA file newer than every complete checkpoint belongs to a save that was interrupted;
            # it is kept so a concurrent reader never loses it, and overwritten when that step is redone.
            orphan_ok = _EMA_RE.match(p.name) and steps and step > steps[-1]
            if step not in keep and not orphan_ok:
                with contextlib.suppress(FileNotFoundError):
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
                    removed.append(p)
        return removed


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read one of our checkpoints safely (`dit.weight_files.read_torch_file`: CRC-32s, then weights_only, mapped
    into memory) and check its format, version and required keys; UserError naming the file."""
    path = Path(path)
    if is_sharded_checkpoint(path):
        return load_sharded(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path}: {missing_file(path)}; pass a checkpoint file (or a sharded run's "
                        "step-N.dcp folder) to --resume, or --resume auto to use the newest one in the run folder")
    try:
        # mmap: the ranks of a node share one copy of the file in the page cache instead of each holding
        # the whole checkpoint (11 GB for DiT-XL/2 with AdamW) in its own memory.
        ckpt = read_torch_file(path, mmap=True)
    except WeightsError as e:  # corrupt zip, truncated file, refused pickle: all the same to the user
        raise UserError(f"checkpoint {path} is corrupt or not a dit-pipeline checkpoint ({e}). Nothing was "
                        "loaded. Delete or move it to resume from the previous checkpoint, or pass another one "
                        "with --resume PATH.") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise UserError(f"checkpoint {path} is not a dit-pipeline training checkpoint (no format "
                        f"{FORMAT!r}); to start from other weights use a new --run-dir")
    if ckpt.get("version") != VERSION:
        raise UserError(f"checkpoint {path} has format version {ckpt.get('version')!r}; this code reads "
                        f"version {VERSION}")
    missing = [k for k in REQUIRED_KEYS if k not in ckpt]
    if missing:
        raise UserError(f"checkpoint {path} lacks {missing}; it is incomplete. Nothing was loaded.")
    return ckpt


def load_sharded(path: Path) -> dict[str, Any]:
    """A sharded checkpoint's records with each of its tensors as a meta tensor of its whole shape and dtype (what
    every resume check needs; no tensor is read); UserError naming an incomplete or foreign folder."""
    records = path / SHARDED_RECORDS
    if not records.is_file():
        raise UserError(f"checkpoint {path} has no {SHARDED_RECORDS}, so it is not a complete sharded checkpoint. "
                        "Nothing was loaded. Delete or move it to resume from the previous checkpoint, or pass another "
                        "one with --resume PATH.")
    try:
        ckpt = read_torch_file(records, mmap=True)
    except WeightsError as e:
        raise UserError(f"checkpoint {path}: its {SHARDED_RECORDS} is corrupt ({e}). Nothing was loaded. Delete or "
                        "move the folder to resume from the previous checkpoint.") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT or not isinstance(ckpt.get("sharded"), dict):
        raise UserError(f"checkpoint {path} is not a dit-pipeline sharded training checkpoint (no format {FORMAT!r})")
    if ckpt.get("version") != VERSION:
        raise UserError(f"checkpoint {path} has format version {ckpt.get('version')!r}; this code reads version "
                        f"{VERSION}")
    files: dict[str, int] = ckpt["sharded"].get("files", {})
    bad = []
    for name, size in files.items():
        f, by = path / name, re.match(r"shard-(\d+)-", name)
        rank = f" (rank {int(by.group(1)) - 1}'s)" if by else ""
        if not f.is_file():
            bad.append(f"{name}{rank} is missing")
        elif f.stat().st_size != size:
            bad.append(f"{name}{rank} holds {f.stat().st_size} bytes of the {size} written")
    if bad:
        raise UserError(f"sharded checkpoint {path} of {ckpt['sharded'].get('world_size')} rank(s) is incomplete: "
                        f"{'; '.join(bad)}. Nothing was loaded. Restore the file, or move the folder aside to resume "
                        "from the previous checkpoint.")
    shapes = sharding.tensor_shapes(path)
    lost: list[str] = []

    def meta(key: str, leaf: Any) -> torch.Tensor:
        name = leaf[SHARDED_PLACEHOLDER] if isinstance(leaf, Mapping) else key
        if name not in shapes:
            lost.append(name)
            return torch.empty(0, device="meta")
        size, dtype = shapes[name]
        return torch.empty(size, dtype=dtype, device="meta")

    view = {k: replace_leaves(v, meta, k) if k in SHARDED_KEYS else v for k, v in ckpt.items()}
    missing = [k for k in REQUIRED_KEYS if k not in view] + lost[:5]
    if missing:
        raise UserError(f"sharded checkpoint {path} lacks {missing}; it is incomplete. Nothing was loaded.")
    return view


def materialize(ckpt: dict[str, Any], where: Path, targets: Mapping[str, torch.Tensor], *,
                collective: bool) -> dict[str, Any]:
    """`ckpt` with its tensors read: a file's as it is; a sharded checkpoint's (meta tensors from `load_sharded`)
    into `targets` where a live sharded tensor of this run is given by path (this rank's shards), every other one
    whole. `collective`: every rank of the run reads together (a sharded run)."""
    if "sharded" not in ckpt:
        return ckpt
    values: dict[str, torch.Tensor] = {}
    for key in SHARDED_KEYS:
        for path, t in tensor_leaves(ckpt.get(key), key):
            live = targets.get(path)
            values[path] = live if live is not None and live.shape == t.shape else torch.empty(t.shape, dtype=t.dtype)
    sharding.load_tensors(values, where, collective=collective)
    return {k: replace_leaves(v, lambda p, _: values[p], k) if k in SHARDED_KEYS else v for k, v in ckpt.items()}
