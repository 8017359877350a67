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
last K plus every `keep_every` steps (with their EMA files). Reading goes through `dit.weights.read_torch_file`,
the one safe read that `dit-sample` uses too.
"""
from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import IO, Any, Sequence, cast

import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.faults import fault_point
from dit_pipeline.common.io import atomic_write, atomic_write_json, missing_file, remove_stale_temps
from dit_pipeline.dit.formats import CHECKPOINT_FORMAT as FORMAT
from dit_pipeline.dit.formats import CHECKPOINT_VERSION as VERSION
from dit_pipeline.dit.weights import (WeightsError, embed_record, make_sidecar, read_torch_file, sidecar_path,
                                      text_record)
from dit_pipeline.train.parts import REQUIRED_KEYS, Part, compose

FAULT_MID_SAVE = "train.ckpt_mid_save"
_NAME_RE = re.compile(r"^step-(\d{7,})\.pt$")
_EMA_RE = re.compile(r"^step-(\d{7,})-ema\.(pt|json)$")  # the EMA weights and their sidecar


def checkpoint_name(step: int) -> str:
    return f"step-{step:07d}.pt"


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
        """Steps of the complete checkpoints, ascending."""
        if not self.folder.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.folder.iterdir() if (m := _NAME_RE.match(p.name)))

    def path(self, step: int) -> Path:
        return self.folder / checkpoint_name(step)

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.path(steps[-1]) if steps else None

    def clean_partial(self) -> list[Path]:
        """Remove temp files of saves that were killed; returns them."""
        return remove_stale_temps(self.folder)

    def save_parts(self, parts: Sequence[Part]) -> Path:
        """`save` of the checkpoint the run's parts compose (train.parts), under this format's name and version."""
        return self.save({"format": FORMAT, "version": VERSION, **compose(parts)})

    def save(self, state: dict[str, Any]) -> Path:
        """Write the EMA-only file, then the full checkpoint, then prune old ones; returns the path."""
        step = int(state["step"])
        path = self.path(step)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            record = make_sidecar(state["model_config"], state.get("latent"), step,
                                  objective=state.get("objective"), time_shift=state.get("time_shift"),
                                  prediction=state.get("prediction"), meanflow=state.get("meanflow"),
                                  text=text_record(state.get("text")))
            # the EMA file holds its record too (dit.weights.embed_record), so a copy without the sidecar loads
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
        for p in sorted(self.folder.iterdir(), key=lambda p: (_NAME_RE.match(p.name) is None, p.name)):
            m = _NAME_RE.match(p.name) or _EMA_RE.match(p.name)
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
            m = _NAME_RE.match(p.name) or _EMA_RE.match(p.name)
            if m is None:
                continue
            step = int(m.group(1))
            # An EMA file newer than every complete checkpoint belongs to a save that was interrupted;
            # it is kept so a concurrent reader never loses it, and overwritten when that step is redone.
            orphan_ok = _EMA_RE.match(p.name) and steps and step > steps[-1]
            if step not in keep and not orphan_ok:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    removed.append(p)
        return removed


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read one of our checkpoints safely (`dit.weights.read_torch_file`: CRC-32s, then weights_only, mapped
    into memory) and check its format, version and required keys; UserError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path}: {missing_file(path)}; pass a checkpoint file to --resume, or "
                        "--resume auto to use the newest one in the run folder")
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
