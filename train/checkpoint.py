"""Training checkpoints: the format of docs/ARCHITECTURE.md, crash-safe writing, retention and safe reading.

`RUN/checkpoints/step-0001000.pt` holds model, EMA, optimizer, scaler, step, epoch, data position, RNG states,
model_config, latent scaling, the TrainConfig as JSON-compatible dict and the manifest fingerprint; it loads
with `torch.load(weights_only=True)`. Beside it `step-0001000-ema.pt` is a bare EMA state_dict in the official
DiT release format, and `step-0001000-ema.json` its sidecar (dit.make_sidecar: model_config, latent scale,
step), which `dit.load_dit_weights` reads so that models of any size load from the bare file. The EMA file
and its sidecar are written first and the full checkpoint last, each to a temp name, fsynced and renamed
(common.io), so the newest full checkpoint is always complete; a SIGKILL mid-save leaves only a temp file,
removed on the next start. Retention keeps the last K plus every `keep_every` steps (with their EMA files).
"""
from __future__ import annotations

import contextlib
import random
import re
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.faults import fault_point
from dit_pipeline.common.io import atomic_write, atomic_write_json, remove_stale_temps
from dit_pipeline.dit.formats import CHECKPOINT_FORMAT as FORMAT
from dit_pipeline.dit.formats import CHECKPOINT_KEYS
from dit_pipeline.dit.formats import CHECKPOINT_VERSION as VERSION
from dit_pipeline.dit.weights import WeightsError, check_archive, check_state_dict, make_sidecar, sidecar_path

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
            torch.save(obj, writer)
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

    def save(self, state: dict[str, Any]) -> Path:
        """Write the EMA-only file, then the full checkpoint, then prune old ones; returns the path."""
        step = int(state["step"])
        path = self.path(step)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            _save(state["ema"], self.folder / ema_name(step))
            atomic_write_json(sidecar_path(self.folder / ema_name(step)),
                              make_sidecar(state["model_config"], state.get("latent"), step,
                                           objective=state.get("objective")))
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
        return keep

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
    """Read one of our checkpoints safely (weights_only) and check its format; UserError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist; pass an existing file to --resume, or "
                        "--resume auto to use the newest one in the run folder")
    try:
        check_archive(path)  # torch.load does not check the archive's CRCs: a flipped bit would load silently
        # mmap: the ranks of a node share one copy of the file in the page cache instead of each holding
        # the whole checkpoint (11 GB for DiT-XL/2 with AdamW) in its own memory.
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # corrupt zip, truncated file, refused pickle: all the same to the user
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        # a refused pickle: the line naming the refused global, not torch's generic weights_only preamble
        first = next((line for line in lines if "GLOBAL" in line), lines[0]).removeprefix("WeightsUnpickler error: ")
        raise UserError(f"checkpoint {path} is corrupt or not a dit-pipeline checkpoint ({type(e).__name__}: "
                        f"{first}). Nothing was loaded. Delete or move it to resume from the previous "
                        "checkpoint, or pass another one with --resume PATH.") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise UserError(f"checkpoint {path} is not a dit-pipeline training checkpoint (no format "
                        f"{FORMAT!r}); to start from other weights use a new --run-dir")
    if ckpt.get("version") != VERSION:
        raise UserError(f"checkpoint {path} has format version {ckpt.get('version')!r}; this code reads "
                        f"version {VERSION}")
    missing = [k for k in CHECKPOINT_KEYS if k not in ckpt]
    if missing:
        raise UserError(f"checkpoint {path} lacks {missing}; it is incomplete. Nothing was loaded.")
    return ckpt


def check_resumable(ckpt: dict[str, Any], path: Path, *, model: torch.nn.Module, fingerprint: str,
                    global_batch: int, objective: str = "ddpm") -> None:
    """Refuse a checkpoint of another objective, model, shard set or global batch, or with tensors or an
    optimizer that do not fit `model` (UserError; nothing is loaded before this passes)."""
    saved_objective = ckpt.get("objective", "ddpm")  # checkpoints before the key existed are ddpm
    if saved_objective != objective:
        raise UserError(f"checkpoint {path} was trained with --objective {saved_objective}, this run asks for "
                        f"--objective {objective}; resume with the same objective or use a new --run-dir")
    want, have = model.config, ckpt["model_config"]
    keys = [k for k in dict.fromkeys([*want, *have]) if k != "model"]  # block options appear only when on
    diff = [f"{k}: checkpoint {have.get(k)!r}, this run {want.get(k)!r}" for k in keys if have.get(k) != want.get(k)]
    if diff:
        raise UserError(f"checkpoint {path} is for a different model ({have.get('model') or 'custom'}): "
                        + "; ".join(diff) + ". Use the same --model and overrides, or a new --run-dir.")
    if ckpt["manifest_fingerprint"] != fingerprint:
        raise UserError(f"checkpoint {path} was trained on a different shard set (manifest fingerprint "
                        f"{str(ckpt['manifest_fingerprint'])[:12]}..., these shards {fingerprint[:12]}...). "
                        "Pass the same --shards, or a new --run-dir.")
    saved_batch = ckpt["config"].get("global_batch_size")
    if saved_batch != global_batch:
        raise UserError(f"checkpoint {path} was trained with --global-batch-size {saved_batch}, this run asks for "
                        f"{global_batch}; a resumed run must keep the global batch (start a new "
                        "--run-dir to change it)")
    try:
        check_state_dict(ckpt["model"], want, where=f"{path} [model]")
        check_state_dict(ckpt["ema"], want, where=f"{path} [ema]")
    except WeightsError as e:
        raise UserError(f"{e}. Nothing was loaded.") from None
    groups = ckpt["opt"].get("param_groups", [])
    n_params = sum(1 for q in model.parameters() if q.requires_grad)
    if len(groups) != 1 or len(groups[0].get("params", [])) != n_params:
        raise UserError(f"checkpoint {path}: optimizer state does not match this model ({n_params} trainable "
                        "tensors). Nothing was loaded.")


# ----------------------------------------------------------------------------------------------------------
# RNG states (the training randomness itself is derived from integers; these are kept for completeness
# so any code that uses the global generators also continues where it stopped).

def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    py_state = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "python": {"version": int(py_state[0]), "state": [int(x) for x in py_state[1]],
                   "gauss": py_state[2]},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np_s = state["numpy"]
    np.random.set_state(("MT19937", np_s["keys"].numpy().astype(np.uint32), np_s["pos"], np_s["has_gauss"],
                         np_s["cached_gaussian"]))
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
