"""Resumable sample storage and the ADM evaluator's `.npz` format.

A run writes every finished batch as one small part file (`part-<first index>.npz` with `indices`,
`labels`, `images`), atomically, into a hidden parts folder next to the output. A killed run therefore
keeps all finished batches; the rerun skips their indices. `run.json` in the parts folder records the
settings that determine the pixels, so parts from a different configuration are never mixed in.

Once every index is present, `assemble_npz` streams the parts into one `.npz` in index order:
`arr_0` uint8 [N, H, W, 3] (what guided-diffusion's `evaluations/evaluator.py` reads) and `arr_1` int64 [N]
class labels (as guided-diffusion's own sampling script writes them). It is written through a zip stream,
one part in memory at a time, so a 50K x 256px run (9.8 GB) does not need 9.8 GB of RAM. Each part is read
whole, front to back, once (no seeking inside a zip member, which before Python 3.12 re-reads from the start).
"""
from __future__ import annotations

import itertools
import json
import logging
import shutil
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import atomic_write, atomic_write_json, remove_stale_temps

RUN_FILE = "run.json"
PART_GLOB = "part-*.npz"
_CACHE_PARTS = 4


def parts_dir_for(npz: str | Path | None, out: str | Path | None) -> Path:
    """Where a run keeps its finished batches: `.NAME.parts/` beside the npz, else `OUT/.parts/`."""
    if npz is not None:
        npz = Path(npz)
        return npz.parent / f".{npz.name}.parts"
    assert out is not None, "a run writes an npz or an output folder"
    return Path(out) / ".parts"


def _diff_keys(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


# fingerprint keys (sample/outputs.py `run_record`) that are not a flag's name: the setting that changes them
_KEY_SETTINGS = {"checkpoint_sha256": "the checkpoint (--ckpt)", "model_config": "the model (--ckpt)",
                 "scaling_factor": "the latent normalization", "shift_factor": "the latent normalization",
                 "normalization": "the latent normalization", "image_size": "the image size (--vae)",
                 "labels_sha256": "the classes (--class-labels, --labels, --num-samples or --seed)",
                 "label_sampling": "--labels", "sde_steps": "the SDE's step count (an older version)",
                 "format": "the record's format (an older version)",
                 "version": "the record's format (an older version)",
                 "guidance_model_sha256": "the guidance model (--guidance-model)"}


def describe_changes(recorded: dict[str, Any] | None, now: dict[str, Any]) -> str:
    """The settings in which fingerprint `now` differs from `recorded`, as flags with both values where they are
    short ("--cfg-scale 1.5 -> 4.0, the checkpoint (--ckpt)"); "unknown" without a readable record."""
    if not isinstance(recorded, dict):
        return "unknown: no readable record of its settings"
    shown: list[str] = []
    for key in _diff_keys(recorded, now):
        if key in _KEY_SETTINGS:
            text = _KEY_SETTINGS[key]
        else:
            text = "--" + key.replace("_", "-")
            old, new = recorded.get(key), now.get(key)
            if all(v is None or isinstance(v, (bool, int, float, str)) for v in (old, new)):
                text += f" {_value(old)} -> {_value(new)}"
        if text not in shown:
            shown.append(text)
    return ", ".join(shown)


def _value(v: Any) -> str:
    return "(none)" if v is None else str(v)


class PartStore:
    """The finished batches of one run (see the module docstring)."""

    def __init__(self, folder: str | Path, fingerprint: dict[str, Any], total: int):
        self.folder = Path(folder)
        self.fingerprint = json.loads(json.dumps(fingerprint))  # normalise tuples etc. as JSON would
        self.total = int(total)

    def open(self, *, overwrite: bool = False, log: logging.Logger | None = None) -> list[int]:
        """Create or reopen the folder (one process only, before sampling); returns the finished indices.

        A folder from a different configuration is an error naming the differing settings, unless
        `overwrite`, which deletes it.
        """
        run_file = self.folder / RUN_FILE
        if self.folder.exists():
            recorded = self._recorded(run_file)
            if recorded != self.fingerprint:
                if not overwrite:
                    what = describe_changes(recorded, self.fingerprint)
                    raise UserError(f"{self.folder} holds finished samples of a different run (changed: {what}). "
                                    "Rerun with the same settings to resume it, or pass --overwrite to discard it.")
                shutil.rmtree(self.folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(self.folder)
        if not run_file.is_file():
            atomic_write_json(run_file, self.fingerprint)
        done = sorted(self._scan(log))
        return done

    def _recorded(self, run_file: Path) -> dict[str, Any] | None:
        try:
            return json.loads(run_file.read_text())
        except FileNotFoundError:
            # A folder without run.json holds nothing of ours unless it has parts (then it is foreign).
            return self.fingerprint if not any(self.folder.glob(PART_GLOB)) else None
        except (OSError, ValueError):
            return None

    def _read_indices(self, path: Path) -> np.ndarray:
        with np.load(path, allow_pickle=False) as z:
            idx = np.asarray(z["indices"], dtype=np.int64)  # reads only this small member
        if idx.ndim != 1 or len(idx) == 0:
            raise ValueError("empty or malformed index list")
        if idx.min() < 0 or idx.max() >= self.total:
            raise ValueError(f"indices outside 0..{self.total - 1}")
        return idx

    def _scan(self, log: logging.Logger | None) -> set[int]:
        done: set[int] = set()
        for path in sorted(self.folder.glob(PART_GLOB)):
            try:
                idx = self._read_indices(path)
            except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
                # Parts are written atomically, so this is outside damage; redoing the batch is safe.
                if log is not None:
                    log.warning("discarding unreadable part %s (%s); its samples will be redone", path, e)
                path.unlink(missing_ok=True)
                continue
            done.update(int(i) for i in idx)
        return done

    def write(self, indices: Sequence[int], labels: np.ndarray, images: np.ndarray) -> Path:
        """Atomically store one finished batch (images uint8 [b, H, W, 3])."""
        idx = np.asarray(indices, dtype=np.int64)
        assert images.dtype == np.uint8 and images.ndim == 4 and len(images) == len(idx) == len(labels)
        path = self.folder / f"part-{int(idx[0]):09d}.npz"
        with atomic_write(path) as f:
            np.savez(f, indices=idx, labels=np.asarray(labels, dtype=np.int64), images=images)
        return path

    def locations(self) -> dict[int, tuple[Path, int]]:
        """index -> (part file, row) for every stored sample."""
        where: dict[int, tuple[Path, int]] = {}
        for path in sorted(self.folder.glob(PART_GLOB)):
            for row, i in enumerate(self._read_indices(path).tolist()):
                where.setdefault(int(i), (path, row))
        return where

    def iter_images(self, indices: Sequence[int]) -> Iterator[tuple[np.ndarray, int]]:
        """(image uint8 [H, W, 3], label) for each index in order, loading few parts at a time."""
        where = self.locations()
        missing = [i for i in indices if i not in where]
        if missing:
            raise UserError(f"{self.folder}: samples {missing[:5]}{'...' if len(missing) > 5 else ''} are missing; "
                            "rerun the same command to produce them")
        cache: OrderedDict[Path, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        for i in indices:
            path, row = where[i]
            if path not in cache:
                try:
                    with np.load(path, allow_pickle=False) as z:
                        cache[path] = (z["images"], z["labels"])
                except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
                    raise UserError(f"part {path} is unreadable ({e}); delete it and rerun to redo it") from e
                if len(cache) > _CACHE_PARTS:
                    cache.popitem(last=False)
            cache.move_to_end(path)
            images, labels = cache[path]
            yield images[row], int(labels[row])

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _write_member(zf: zipfile.ZipFile, name: str, shape: tuple[int, ...], dtype: np.dtype,
                  chunks: Iterator[np.ndarray]) -> None:
    """Write one `.npy` member of shape/dtype from consecutive C-ordered chunks (numpy's npz layout)."""
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape}
    expected = int(np.prod(shape)) * np.dtype(dtype).itemsize
    written = 0
    with zf.open(name + ".npy", "w", force_zip64=True) as fid:
        np.lib.format.write_array_header_1_0(fid, header)
        for chunk in chunks:
            data = np.ascontiguousarray(chunk, dtype=dtype).tobytes()
            fid.write(data)
            written += len(data)
    assert written == expected, f"{name}: wrote {written} bytes, expected {expected}"


def assemble_npz(store: PartStore, path: str | Path, labels: np.ndarray) -> tuple[int, int, int]:
    """Write `path` (arr_0 uint8 [N, H, W, 3], arr_1 int64 [N]) from the store; returns (N, H, W).

    `labels` are the run's expected class labels; a part whose labels disagree is reported, not used.
    """
    n = store.total
    items = store.iter_images(range(n))  # one pass: every part is read once, in index order
    first = next(items)
    h, w, c = first[0].shape

    def images() -> Iterator[np.ndarray]:
        for i, (img, label) in enumerate(itertools.chain([first], items)):
            if img.shape != (h, w, c):
                raise UserError(f"{store.folder}: sample {i} has shape {img.shape}, expected {(h, w, c)}; "
                                "delete the parts folder and rerun")
            if label != int(labels[i]):
                raise UserError(f"{store.folder}: sample {i} has class {label}, expected {int(labels[i])}; "
                                "delete the parts folder and rerun")
            yield img

    with atomic_write(path) as f:
        with zipfile.ZipFile(f, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            _write_member(zf, "arr_0", (n, h, w, c), np.dtype(np.uint8), images())
            _write_member(zf, "arr_1", (n,), np.dtype(np.int64), iter([np.asarray(labels, dtype=np.int64)]))
    return n, h, w
