"""What `dit-eval` reads: an ADM `.npz` of images, a folder of images, a features file, or a statistics file.

- ADM `.npz` (what `dit-sample --npz` writes and the ADM reference batches are): `arr_0` uint8 [N, H, W, 3]. It
  is streamed (a 50K x 256px file is 9.8 GB), each byte read once (`NpzReader`): a stored member at its offset
  in the raw file, a compressed one (`np.savez_compressed`) decompressed once from front to back.
  Precomputed `mu`, `sigma` (pool) and `mu_s`, `sigma_s` (spatial) in the same file are used for FID and sFID,
  as the ADM evaluator does; that is how `VIRTUAL_imagenet256_labeled.npz` carries statistics of the whole
  ImageNet training set next to 10,000 images (used for precision and recall).
- A folder: every .png/.jpg/.jpeg/.webp/.bmp under it (recursively, sorted by relative path), all of one size,
  converted to RGB. A folder `dit-sample --out` wrote gives the images of its `images/` (never its grid.png).
- A features file written by `dit-eval` (`*.features.npz`, see evaluate/features.py): used as is.
- A statistics-only `.npz` (`mu`, `sigma`, optionally `mu_s`, `sigma_s`, no `arr_0`): FID (and sFID) only; iMF's
  and JiT's statistics files name them `ref_mu`, `ref_sigma` (read as `mu`, `sigma`; `Source.stats_keys` says
  which).
Every problem is a `UserError` naming the file and what to do.

Which network made a file's statistics or features (`Source.extractor`, `Source.provenance`): a file `dit-eval
--make-ref` wrote records its extractor's identity (member `extractor`, JSON), a features file in its meta; the ADM
evaluator's reference batches are known by their members (`arr_0` with `mu`, `sigma`, `mu_s`, `sigma_s` of 2023
spatial values: the TF graph with its published weights), iMF's and JiT's statistics by `ref_mu`/`ref_sigma` (the
same graph's published weights, through their own code). evaluate/run.py refuses a reference whose network differs
from the evaluation's (`check_network`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator

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
    label_sampling: str | None = None              # npz: "uniform", "equal" or "given", from dit-sample's record
    class_counts: dict[str, int] | None = None     # npz with arr_1: classes present, min and max samples per class
    stats_keys: tuple[str, str] | None = None       # the keys the pool statistics were read from (mu, sigma or ref_*)
    extractor: dict[str, Any] | None = None         # the identity of the network that made its statistics/features
    provenance: str = "images"                      # who made its statistics, in words (recorded with the numbers)
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
        """Images [start, stop) as uint8 [n, H, W, 3] (one read; for many batches use `reader()`)."""
        with self.reader() as r:
            return r.read(start, stop)

    @contextlib.contextmanager
    def reader(self) -> Iterator["NpzReader | _FolderReader"]:
        """A reader whose `read(start, stop)` returns images [start, stop) as uint8 [n, H, W, 3]; reads in
        increasing order (what every rank's batches are) read each byte of an `.npz` once."""
        if self.kind == "folder":
            yield _FolderReader(self)
            return
        r = NpzReader(self.path, self.image_hw, self._data_offset)
        try:
            yield r
        finally:
            r.close()


class _FolderReader:
    def __init__(self, source: Source):
        self.source = source

    def read(self, start: int, stop: int) -> np.ndarray:
        return np.stack([_read_image(f, self.source.image_hw) for f in self.source.files[start:stop]])


_LOCAL_HEADER = struct.Struct("<4s22xHH")  # zip local file header: signature, ..., name length, extra length
_SKIP_CHUNK = 1 << 24


class NpzReader:
    """The pixels of an ADM `.npz`'s `arr_0`, read batch by batch, each byte of the file once.

    Reopening the zip member per batch and seeking is quadratic: before Python 3.12 a forward seek in a
    member reads and discards everything before the target, and in a compressed member it does on every
    version (a 50K x 256 px npz would be read about 390 times over in batches of 64). So a stored member (what
    `np.savez` and `dit-sample` write) is read at its offset in the raw file, and a compressed one is kept
    open and decompressed once, front to back; a read before the current position (no caller does that)
    starts the member again.
    """

    def __init__(self, path: Path, image_hw: tuple[int, int], data_offset: int):
        self.path, self._hw, self._row = path, tuple(image_hw), image_hw[0] * image_hw[1] * 3
        self._zf = zipfile.ZipFile(path)
        self._raw: BinaryIO | None = None
        self._member: BinaryIO | None = None
        try:
            info = self._zf.getinfo("arr_0.npy")
            self._available = info.file_size - data_offset  # pixel bytes the member holds
            self._data_offset, self._info = data_offset, info
            if info.compress_type == zipfile.ZIP_STORED and not info.flag_bits & 0x1:  # stored, not encrypted
                self._raw = open(path, "rb")
                self._raw.seek(info.header_offset)
                sig, name_len, extra_len = _LOCAL_HEADER.unpack(self._raw.read(_LOCAL_HEADER.size))
                if sig != b"PK\x03\x04":
                    raise zipfile.BadZipFile("arr_0.npy: bad local file header")
                # the local header's name and extra lengths may differ from the central directory's
                self._start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len + data_offset
            else:
                self._pos = 0  # offset in the decompressed .npy
        except Exception:
            self.close()
            raise

    def read(self, start: int, stop: int) -> np.ndarray:
        n = (stop - start) * self._row
        if stop * self._row > self._available:
            raise self._ends_early(start, stop)
        if self._raw is not None:
            self._raw.seek(self._start + start * self._row)
            data = self._raw.read(n)
        else:
            data = self._read_member(self._data_offset + start * self._row, n)
        if len(data) != n:
            raise self._ends_early(start, stop)
        return np.frombuffer(data, np.uint8).reshape(stop - start, *self._hw, 3)

    def _ends_early(self, start: int, stop: int) -> UserError:
        return UserError(f"{self.path}: arr_0 ends early (images {start}..{stop - 1} missing); the file is "
                         "truncated, write it again")

    def _read_member(self, offset: int, n: int) -> bytes:
        if self._member is None or offset < self._pos:
            if self._member is not None:
                self._member.close()
            self._member, self._pos = self._zf.open(self._info), 0
        while self._pos < offset:  # skip (decompress and drop) what this process does not need
            got = len(self._member.read(min(_SKIP_CHUNK, offset - self._pos)))
            if not got:
                break
            self._pos += got
        data = self._member.read(n) if self._pos == offset else b""
        self._pos += len(data)
        return data

    def close(self) -> None:
        for f in (self._member, self._raw, self._zf):
            if f is not None:
                f.close()


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
    for key, mu, sigma in (("pool", "mu", "sigma"), ("pool", "ref_mu", "ref_sigma"), ("spatial", "mu_s", "sigma_s")):
        if key not in stats and mu in z.files and sigma in z.files:
            m, s = _finite(path, mu, z[mu]), _finite(path, sigma, z[sigma])
            if m.ndim != 1 or s.shape != (len(m), len(m)):
                raise UserError(f"{path}: {mu} {list(m.shape)} and {sigma} {list(s.shape)} do not form statistics "
                                "(need [D] and [D, D])")
            stats[key] = Statistics(m, s)
    return stats


ADM_REFERENCE_NAMES = ("VIRTUAL_imagenet64_labeled.npz", "VIRTUAL_imagenet128_labeled.npz",
                       "VIRTUAL_imagenet256_labeled.npz", "VIRTUAL_imagenet512_labeled.npz",
                       "VIRTUAL_lsun_bedroom256.npz", "VIRTUAL_lsun_cat256.npz", "VIRTUAL_lsun_horse256.npz")
# The network of a file that records none but is known by its layout: the TF graph with its published weights.
PUBLISHED_NETWORK = {"network": "inception-2015-12-05", "weights": "published (TF graph)", "weights_sha256": None,
                     "random_seed": None, "input_size": 299}


def _provenance(p: Path, z: Any, names: set[str], stats: dict[str, Statistics]) -> tuple[dict[str, Any] | None, str]:
    """(the identity of the network that made the file's statistics, or None when unknown; the words for it)."""
    if "extractor" in names:
        try:
            ident = json.loads(str(z["extractor"]))
        except (ValueError, TypeError):
            ident = None
        if isinstance(ident, dict):
            return ident, f"dit-eval --make-ref, {ident.get('extractor')} with {ident.get('weights')}"
    if "pool" not in stats:
        return None, "images"
    spatial = stats.get("spatial")
    adm_layout = {"arr_0", "mu", "sigma"} <= names and spatial is not None and len(spatial.mu) == 2023
    if adm_layout and p.name in ADM_REFERENCE_NAMES:
        return dict(PUBLISHED_NETWORK), f"the ADM evaluator's reference batch {p.name}: TF graph inception-2015-12-05"
    if adm_layout:
        return None, ("ADM's layout without a network record (an ADM reference batch under another name, or a "
                      "dit-eval --make-ref file from before it recorded its network)")
    if "ref_mu" in names:
        return dict(PUBLISHED_NETWORK), ("iMF's / JiT's statistics layout (ref_mu, ref_sigma): inception-2015-12-05's "
                                         "published weights through their own code")
    return None, "statistics of an unrecorded network (no extractor record in the file)"


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
                meta = _features_meta(z)
                return Source(p, "features", count=int(z["pool"].shape[0]), extractor=meta.get("extractor"),
                              provenance=f"a dit-eval features file ({(meta.get('extractor') or {}).get('extractor')})")
            stats = _statistics(p, z)
            labels = _optional(z, "arr_1") if "arr_0" in names else None
            extractor, provenance = _provenance(p, z, names, stats)
            keys = ("ref_mu", "ref_sigma") if "pool" in stats and "mu" not in names else ("mu", "sigma")
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise UserError(f"{what} {p} is not a readable .npz ({str(e)[:200]})") from None
    if "arr_0" not in names:
        if "pool" not in stats:
            raise UserError(f"{what} {p} has neither images (arr_0) nor statistics (mu, sigma or ref_mu, ref_sigma): "
                            f"found {sorted(names) or 'nothing'}")
        return Source(p, "statistics", stats=stats, stats_keys=keys, extractor=extractor, provenance=provenance)
    src = _open_npz(p, what, stats)
    src.label_sampling, src.class_counts = _label_sampling(p, src.count), _class_counts(labels, src.count)
    if stats:
        src.stats_keys, src.extractor, src.provenance = keys, extractor, provenance
    return src


def _optional(z: Any, name: str) -> np.ndarray | None:
    """A member that only adds information (an unreadable one, e.g. of objects, is left out, not an error)."""
    try:
        return z[name] if name in z.files else None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError):
        return None


def _class_counts(labels: np.ndarray | None, count: int) -> dict[str, int] | None:
    """How balanced the classes in arr_1 (the labels dit-sample and guided-diffusion write) are."""
    if labels is None or labels.shape != (count,) or not np.issubdtype(labels.dtype, np.integer):
        return None
    per_class = np.unique(labels, return_counts=True)[1]
    return {"classes": len(per_class), "min_per_class": int(per_class.min()), "max_per_class": int(per_class.max())}


def _label_sampling(p: Path, count: int) -> str | None:
    """How dit-sample chose the classes, from its record beside the npz (`NAME.npz.json`) when that record is of
    an npz of this many samples; None without one. Records from before --labels are "uniform" or "given"."""
    from dit_pipeline.sample.outputs import RECORD_FORMAT

    try:
        record = json.loads(Path(str(p) + ".json").read_text())
    except (OSError, ValueError):
        return None
    fingerprint = record.get("fingerprint") if isinstance(record, dict) else None
    if not isinstance(fingerprint, dict) or fingerprint.get("format") != RECORD_FORMAT \
            or fingerprint.get("num_samples") != count:
        return None
    given = (record.get("config") or {}).get("class_labels")
    return record.get("label_sampling") or ("given" if given else "uniform")


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


def _sample_out_folder(p: Path) -> bool:
    """Whether `p` is a folder `dit-sample --out` wrote: its record samples.json, or its grid.png beside images/."""
    from dit_pipeline.sample.outputs import RECORD_FORMAT

    try:
        record = json.loads((p / "samples.json").read_text())
    except (OSError, ValueError):
        record = None
    fingerprint = record.get("fingerprint") if isinstance(record, dict) else None
    if isinstance(fingerprint, dict) and fingerprint.get("format") == RECORD_FORMAT:
        return True
    return (p / "grid.png").is_file() and (p / "images").is_dir()


def _open_folder(p: Path, what: str) -> Source:
    root = p
    if _sample_out_folder(p):  # the samples are in images/; grid.png (a picture of a few of them) is no sample
        root = p / "images"
        if not root.is_dir():
            raise UserError(f"{what} {p} is a dit-sample --out folder without its samples (grid.png shows a few "
                            "only): sample again with --save-images, or evaluate the --npz it wrote")
    files = sorted((f for f in root.rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES and f.is_file()
                    and not any(part.startswith(".") for part in f.relative_to(root).parts)),
                   key=lambda f: f.relative_to(root).as_posix())
    if not files:
        raise UserError(f"{what} {root} holds no images ({', '.join(IMAGE_SUFFIXES)})")
    first = _read_image(files[0], None)
    return Source(p, "folder", count=len(files), image_hw=(first.shape[0], first.shape[1]), files=files)


def _features_meta(z: Any) -> dict[str, Any]:
    try:
        meta = json.loads(str(z["meta"]))
    except (KeyError, ValueError, TypeError):
        return {}
    return meta if isinstance(meta, dict) else {}


def read_features_file(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(arrays {"pool", "logits"} and "spatial" where the network gives it, meta) of a features file."""
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: np.asarray(z[k], np.float32) for k in ("pool", "spatial", "logits") if k in z.files}
            if "pool" not in arrays or "logits" not in arrays:
                raise KeyError("pool and logits")
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
    check_resolution(samples.image_hw, ref, f"SAMPLES {samples.path}")


def check_resolution(samples_hw: tuple[int, int] | None, ref: Source, what: str = "SAMPLES") -> None:
    """UserError when the samples (`what`) and REF have different resolutions (dit-eval, and FID during
    training before it starts); nothing to check against a statistics file."""
    if samples_hw and ref.image_hw and tuple(samples_hw) != tuple(ref.image_hw):
        raise UserError(f"{what} are {samples_hw[0]}x{samples_hw[1]} but REF {ref.path} is "
                        f"{ref.image_hw[0]}x{ref.image_hw[1]}: compare against the reference batch of the "
                        "samples' resolution (e.g. VIRTUAL_imagenet256_labeled.npz for 256x256)")
