"""What `dit-eval` reads: an ADM `.npz` of images, a folder of images, a features file, or a statistics file.

- ADM `.npz` (what `dit-sample --npz` writes and the ADM reference batches are): `arr_0` uint8 [N, H, W, 3]. It
  is streamed member by member (a 50K x 256px file is 9.8 GB), batches read by seeking in the zip member.
  Precomputed `mu`, `sigma` (pool) and `mu_s`, `sigma_s` (spatial) in the same file are used for FID and sFID,
  as the ADM evaluator does; that is how `VIRTUAL_imagenet256_labeled.npz` carries statistics of the whole
  ImageNet training set next to 10,000 images (used for precision and recall).
- A folder: every .png/.jpg/.jpeg/.webp/.bmp under it (recursively, sorted by relative path), all of one size,
  converted to RGB.
- A features file written by `dit-eval` (`*.features.npz`, see evaluate/features.py): used as is.
- A statistics-only `.npz` (`mu`, `sigma`, optionally `mu_s`, `sigma_s`, no `arr_0`): FID (and sFID) only.
Every problem is a `UserError` naming the file and what to do.
"""
from __future__ import annotations

import hashlib
import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import sha256_file
from dit_pipeline.evaluate.metrics import NEIGHBOURHOOD_K, Statistics

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
FEATURES_FORMAT = "dit-pipeline.eval-features"
STAT_KEYS = ("mu", "sigma", "mu_s", "sigma_s")


@dataclass
class Source:
    """One side of an evaluation (samples or reference)."""

    path: Path
    kind: str                                      # "npz", "folder", "features", "statistics"
    count: int = 0                                 # images (0 for statistics)
    image_hw: tuple[int, int] | None = None
    files: list[Path] = field(default_factory=list)  # folder images, in order
    stats: dict[str, Statistics] = field(default_factory=dict)  # precomputed: "pool", "spatial"
    _data_offset: int = 0

    def describe(self) -> str:
        what = f"{self.count} images of {self.image_hw[0]}x{self.image_hw[1]}" if self.image_hw else self.kind
        return f"{self.path} ({what})"

    def content_hash(self) -> str:
        """sha256 of what determines the features: the file's bytes, or the folder's names and bytes."""
        if self.kind != "folder":
            return sha256_file(self.path)
        h = hashlib.sha256()
        for f in self.files:
            h.update(f"{f.relative_to(self.path).as_posix()}\0{sha256_file(f)}\n".encode())
        return h.hexdigest()

    def read(self, start: int, stop: int) -> np.ndarray:
        """Images [start, stop) as uint8 [n, H, W, 3]."""
        if self.kind == "folder":
            return np.stack([_read_image(f, self.image_hw) for f in self.files[start:stop]])
        h, w = self.image_hw
        row = h * w * 3
        with zipfile.ZipFile(self.path) as zf, zf.open("arr_0.npy") as f:
            f.seek(self._data_offset + start * row)
            data = f.read((stop - start) * row)
        if len(data) != (stop - start) * row:
            raise UserError(f"{self.path}: arr_0 ends early (images {start}..{stop - 1} missing); the file is "
                            "truncated, write it again")
        return np.frombuffer(data, np.uint8).reshape(stop - start, h, w, 3)


def _read_image(path: Path, hw: tuple[int, int] | None) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(path) as im:
            arr = np.asarray(im.convert("RGB"))
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise UserError(f"{path}: not a readable image ({e}); remove it or replace it") from None
    if hw is not None and arr.shape[:2] != tuple(hw):
        raise UserError(f"{path} is {arr.shape[0]}x{arr.shape[1]} but the other images of its folder are "
                        f"{hw[0]}x{hw[1]}; evaluate images of one size (resize them the way you generated them)")
    return arr


def _finite(path: Path, name: str, arr: np.ndarray) -> np.ndarray:
    if not np.issubdtype(arr.dtype, np.floating) or not np.isfinite(arr).all():
        bad = "NaN or Inf values" if np.issubdtype(arr.dtype, np.floating) else f"dtype {arr.dtype}"
        raise UserError(f"{path}: {name} has {bad}; the statistics are unusable, compute them again")
    return arr.astype(np.float64)


def _statistics(path: Path, z: Any) -> dict[str, Statistics]:
    stats = {}
    for key, mu, sigma, dim in (("pool", "mu", "sigma", None), ("spatial", "mu_s", "sigma_s", None)):
        if mu in z.files and sigma in z.files:
            m, s = _finite(path, mu, z[mu]), _finite(path, sigma, z[sigma])
            if m.ndim != 1 or s.shape != (len(m), len(m)):
                raise UserError(f"{path}: {mu} {list(m.shape)} and {sigma} {list(s.shape)} do not form statistics "
                                "(need [D] and [D, D])")
            stats[key] = Statistics(m, s)
    return stats


def _arr0_header(path: Path) -> tuple[tuple[int, ...], np.dtype, bool, int]:
    with zipfile.ZipFile(path) as zf, zf.open("arr_0.npy") as f:
        version = np.lib.format.read_magic(f)
        reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = reader(f)
        return shape, dtype, fortran, f.tell()


def open_source(path: str | Path, what: str) -> Source:
    """Inspect SAMPLES or REF (`what` names it in errors) without reading the images."""
    p = Path(path).expanduser()
    if p.is_dir():
        return _open_folder(p, what)
    if not p.is_file():
        raise UserError(f"{what} {p} does not exist (give an .npz of images, a folder of images, or a statistics "
                        "file)")
    try:
        with np.load(p, allow_pickle=False) as z:
            names = set(z.files)
            if "format" in names and str(z["format"]) == FEATURES_FORMAT:
                return Source(p, "features", count=int(z["pool"].shape[0]))
            stats = _statistics(p, z)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise UserError(f"{what} {p} is not a readable .npz ({str(e)[:200]})") from None
    if "arr_0" not in names:
        if "pool" not in stats:
            raise UserError(f"{what} {p} has neither images (arr_0) nor statistics (mu, sigma): found "
                            f"{sorted(names) or 'nothing'}")
        return Source(p, "statistics", stats=stats)
    return _open_npz(p, what, stats)


def _open_npz(p: Path, what: str, stats: dict[str, Statistics]) -> Source:
    shape, dtype, fortran, offset = _arr0_header(p)
    if dtype != np.uint8:
        nan = ""
        if np.issubdtype(dtype, np.floating):
            with np.load(p, allow_pickle=False) as z:
                nan = " and contains NaN" if np.isnan(z["arr_0"]).any() else ""
        raise UserError(f"{what} {p}: arr_0 is {dtype}{nan}; the ADM format is uint8 pixels 0..255 "
                        "[N, H, W, 3] (dit-sample --npz writes it)")
    if len(shape) != 4 or shape[-1] != 3 or fortran or 0 in shape:
        raise UserError(f"{what} {p}: arr_0 has shape {list(shape)}; the ADM format is uint8 [N, H, W, 3] (NHWC, "
                        "RGB, N >= 1)")
    return Source(p, "npz", count=int(shape[0]), image_hw=(int(shape[1]), int(shape[2])), stats=stats,
                  _data_offset=offset)


def _open_folder(p: Path, what: str) -> Source:
    files = sorted((f for f in p.rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES and f.is_file()
                    and not any(part.startswith(".") for part in f.relative_to(p).parts)),
                   key=lambda f: f.relative_to(p).as_posix())
    if not files:
        raise UserError(f"{what} {p} holds no images ({', '.join(IMAGE_SUFFIXES)})")
    first = _read_image(files[0], None)
    return Source(p, "folder", count=len(files), image_hw=(first.shape[0], first.shape[1]), files=files)


def read_features_file(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(arrays {"pool", "spatial", "logits"}, meta) of a features file."""
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: np.asarray(z[k], np.float32) for k in ("pool", "spatial", "logits")}
            meta = json.loads(str(z["meta"]))
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as e:
        raise UserError(f"{path} is not a readable features file ({str(e)[:200]}); delete it to recompute") from None
    if not all(np.isfinite(a).all() for a in arrays.values()):
        raise UserError(f"{path}: the features contain NaN or Inf; delete the file to recompute them")
    return arrays, meta


def check_comparable(samples: Source, ref: Source) -> None:
    """The errors that must come before any Inception work (UserError naming the input)."""
    k = NEIGHBOURHOOD_K
    for what, s in (("SAMPLES", samples), ("REF", ref)):
        if s.kind != "statistics" and s.count < 2:
            raise UserError(f"{what} {s.path} has {s.count} image(s); FID needs at least 2 (50,000 for numbers "
                            "comparable with papers)")
    if samples.kind == "statistics":
        raise UserError(f"SAMPLES {samples.path} holds only statistics; give the samples' images (.npz or folder) "
                        "or their features file, so that the Inception Score can be computed")
    if ref.kind != "statistics":
        small = [(w, s) for w, s in (("SAMPLES", samples), ("REF", ref)) if s.count <= k]
        if small:
            w, s = small[0]
            raise UserError(f"{w} {s.path} has {s.count} images: precision and recall (k = {k} nearest "
                            f"neighbours) need at least {k + 1} on each side")
    check_resolution(samples.image_hw, ref)


def check_resolution(samples_hw: tuple[int, int] | None, ref: Source, what: str = "SAMPLES") -> None:
    """UserError when the samples (`what`) and REF have different resolutions (dit-eval, and FID during
    training before it starts); nothing to check against a statistics file."""
    if samples_hw and ref.image_hw and tuple(samples_hw) != tuple(ref.image_hw):
        raise UserError(f"{what} are {samples_hw[0]}x{samples_hw[1]} but REF {ref.path} is "
                        f"{ref.image_hw[0]}x{ref.image_hw[1]}: compare against the reference batch of the "
                        "samples' resolution (e.g. VIRTUAL_imagenet256_labeled.npz for 256x256)")
