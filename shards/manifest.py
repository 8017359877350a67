"""`manifest.json`: the description of a shard set (docs/FORMAT.md), written last and atomically.

It records how the latents were made (the full extraction config, with the VAE identity and the VAE's
`scaling_factor`/`shift_factor`), what they look like (store, dtype, latent shape, views), the classes in
label order, and per shard its name, sample count, key range, byte size and sha256. Reading it validates
every field and reports all problems at once, so a damaged or foreign manifest is refused with a message
that names what is wrong.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import atomic_write_json
from dit_pipeline.shards.format import (FORMAT_VERSION, FORMAT_VERSION_PIXELS, FORMAT_VERSIONS, MANIFEST_NAME,
                                        STORAGE_DTYPES, STORES, file_mode, key_index, shard_index)
from dit_pipeline.shards.pixels import pixels_entry_problems


Z = TypeVar("Z")


def scale_latents(z: Z, scaling_factor: float, shift_factor: float | None) -> Z:
    """The latent formula, written once: `(z - shift_factor) * scaling_factor` (diffusers' convention, as its
    pipelines encode with the VAE config's factors; no shift when the VAE has none, as for the SD VAE).

    A torch tensor is scaled in place (float32 arithmetic, one exactly rounded op at a time) and returned;
    a numpy array gives a new array (float32 factors).
    """
    if hasattr(z, "mul_"):  # torch.Tensor (shards/ itself does not import torch)
        t: Any = z
        if shift_factor:
            t.sub_(shift_factor)
        return t.mul_(scaling_factor)
    import numpy as np

    if shift_factor:
        z = z - np.float32(shift_factor)
    return z * np.float32(scaling_factor)


@dataclass(frozen=True)
class ShardRecord:
    """One shard as written: file name, number of samples, first/last key (None when empty), size, sha256."""

    name: str
    samples: int
    first_key: str | None
    last_key: str | None
    bytes: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ShardRecord":
        problems = _record_problems(d)
        if problems:
            raise ValueError("; ".join(problems))
        return cls(**{f.name: d[f.name] for f in fields(cls)})


def _record_problems(d: Any) -> list[str]:
    if not isinstance(d, dict):
        return [f"shard record is not an object: {d!r}"]
    missing = [f.name for f in fields(ShardRecord) if f.name not in d]
    if missing:
        return [f"shard record {d.get('name', '?')!r} lacks {', '.join(missing)}"]
    name, out = d["name"], []
    if not isinstance(name, str) or shard_index(name) is None:
        out.append(f"shard name {name!r} is not of the form shard-000000.tar")
    for k in ("samples", "bytes"):
        if not _is_int(d[k]) or d[k] < 0:
            out.append(f"shard {name!r}: {k} must be a non-negative integer, got {d[k]!r}")
    sha = d["sha256"]
    if not (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
        out.append(f"shard {name!r}: sha256 must be 64 lowercase hex digits")
    for k in ("first_key", "last_key"):
        v = d[k]
        if v is None and d["samples"] == 0:
            continue
        try:
            key_index(v)
        except ValueError:
            out.append(f"shard {name!r}: {k} {v!r} is not a sample key")
    return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class Manifest:
    format_version: int
    tool_version: str
    extraction: dict[str, Any]
    scaling_factor: float
    shift_factor: float | None
    image_size: int
    views: int
    store: str
    dtype: str
    latent_shape: list[int]
    class_names: list[str]
    num_classes: int
    total_samples: int
    samples_per_shard: int
    shards: list[ShardRecord] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    # Format version 2 only (shards/pixels.py: pixels_entry); None, and absent from the JSON, in version 1.
    pixels: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["shards"] = [s.to_dict() for s in self.shards]
        d["latent_shape"] = list(self.latent_shape)
        if self.pixels is None:  # a set without pixels: the version 1 manifest, byte for byte
            del d["pixels"]
        return d

    @property
    def has_pixels(self) -> bool:
        return self.pixels is not None

    @classmethod
    def from_dict(cls, d: Any) -> "Manifest":
        """Validate and build; ValueError listing every problem found."""
        problems = manifest_problems(d)
        if problems:
            raise ValueError("; ".join(problems))
        kw = {f.name: d[f.name] for f in fields(cls) if f.name != "pixels"}
        kw["pixels"] = d.get("pixels")
        kw["shards"] = [ShardRecord.from_dict(s) for s in d["shards"]]
        kw["latent_shape"] = list(d["latent_shape"])
        kw["scaling_factor"] = float(d["scaling_factor"])
        kw["shift_factor"] = None if d["shift_factor"] is None else float(d["shift_factor"])
        return cls(**kw)

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON of everything that defines the data: the config and the shard
        records (not tool_version or the skipped list, which do not change a single latent)."""
        d = self.to_dict()
        d.pop("tool_version")
        d.pop("skipped")
        text = json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
        return hashlib.sha256(text.encode("ascii")).hexdigest()

    def shard_urls(self, base: str) -> list[str]:
        """The shard locations under `base`: a folder path, or a URL prefix (file:, s3://, https://, ...)."""
        base = str(base)
        if "://" in base or base.startswith(("file:", "pipe:")):
            return [base.rstrip("/") + "/" + s.name for s in self.shards]
        return [str(Path(base) / s.name) for s in self.shards]

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "format_version": (int,), "tool_version": (str,), "extraction": (dict,), "scaling_factor": (int, float),
    "shift_factor": (int, float, type(None)), "image_size": (int,), "views": (int,), "store": (str,),
    "dtype": (str,), "latent_shape": (list,), "class_names": (list,), "num_classes": (int,),
    "total_samples": (int,), "samples_per_shard": (int,), "shards": (list,), "skipped": (list,),
}


def manifest_problems(d: Any) -> list[str]:
    """Every problem with a manifest dict (empty list when it is valid)."""
    if not isinstance(d, dict):
        return ["the top level is not a JSON object"]
    missing = [k for k in _FIELD_TYPES if k not in d]
    version = d.get("format_version")
    if "format_version" in d and (version not in FORMAT_VERSIONS or isinstance(version, bool)):
        return [f"unsupported format_version {version!r} (this tool reads versions "
                f"{' and '.join(map(str, FORMAT_VERSIONS))}); use the dit-pipeline version that wrote it, or re-extract"]
    if missing:
        return [f"missing field(s): {', '.join(missing)}"]
    out = [f"{k} must be {' or '.join(t.__name__ for t in ts)}, got {type(d[k]).__name__}"
           for k, ts in _FIELD_TYPES.items()
           if not isinstance(d[k], ts) or (isinstance(d[k], bool) and bool not in ts)]
    if out:
        return out
    for k in ("scaling_factor", "shift_factor"):
        if d[k] is not None and not math.isfinite(d[k]):
            out.append(f"{k} must be finite")
    if not d["scaling_factor"] > 0:
        out.append(f"scaling_factor must be > 0, got {d['scaling_factor']}")
    if d["store"] not in STORES:
        out.append(f"store must be one of {sorted(STORES)}, got {d['store']!r}")
    if d["dtype"] not in STORAGE_DTYPES:
        out.append(f"dtype must be one of {sorted(STORAGE_DTYPES)}, got {d['dtype']!r}")
    shape = d["latent_shape"]
    if len(shape) != 3 or not all(_is_int(v) and v > 0 for v in shape):
        out.append(f"latent_shape must be 3 positive integers [C, h, w], got {shape!r}")
    for k in ("image_size", "views", "samples_per_shard"):
        if d[k] <= 0:
            out.append(f"{k} must be > 0, got {d[k]}")
    if not all(isinstance(c, str) for c in d["class_names"]) or len(d["class_names"]) != d["num_classes"]:
        out.append(f"class_names must be {d['num_classes']} strings (num_classes), got {len(d['class_names'])}")
    for s in d["shards"]:
        out.extend(_record_problems(s))
    if not out and sum(s["samples"] for s in d["shards"]) != d["total_samples"]:
        out.append(f"total_samples is {d['total_samples']} but the shard records add up to "
                   f"{sum(s['samples'] for s in d['shards'])}")
    names = [s["name"] for s in d["shards"] if isinstance(s, dict) and "name" in s]
    if len(set(names)) != len(names):
        out.append("a shard name is listed twice")
    for s in d["skipped"]:
        if not isinstance(s, dict) or not {"key", "path", "reason"} <= set(s):
            out.append(f"skipped entry {s!r} lacks key/path/reason")
    out.extend(_pixels_problems(d))
    return out


def _pixels_problems(d: dict[str, Any]) -> list[str]:
    """The pixels field is there exactly in version 2 (FORMAT_VERSION_PIXELS), and valid."""
    if d["format_version"] == FORMAT_VERSION:
        return ["pixels is a format version 2 field, but format_version is 1"] if "pixels" in d else []
    if "pixels" not in d:
        return [f"format_version {FORMAT_VERSION_PIXELS} is the version of a set with pixels, but the manifest "
                "has no pixels field"]
    return pixels_entry_problems(d["pixels"], d["image_size"])


def write_manifest(folder: str | Path, manifest: Manifest) -> Path:
    """Write FOLDER/manifest.json atomically (temp file, fsync, rename); returns its path."""
    problems = manifest_problems(manifest.to_dict())
    if problems:
        raise ValueError("refusing to write an invalid manifest: " + "; ".join(problems))
    path = Path(folder) / MANIFEST_NAME
    atomic_write_json(path, manifest.to_dict())
    os.chmod(path, file_mode())  # the atomic temp file is 0600; the manifest is shared like the shards
    return path


def read_manifest(path: str | Path) -> Manifest:
    """Read and validate a manifest (a shard folder or its manifest.json); UserError naming the problem."""
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: no manifest (is {path.parent} a shard folder written by dit-extract? "
                        "An extraction that did not finish has no manifest yet: rerun it)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read the manifest ({e})") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: invalid JSON at line {e.lineno} column {e.colno} ({e.msg}); "
                        "the manifest is damaged: re-copy it or rerun the extraction") from None
    except RecursionError:  # a hostile file of deeply nested brackets: json gives up by recursion
        raise UserError(f"{path}: invalid manifest: JSON nested too deeply; the manifest is damaged: re-copy "
                        "it or rerun the extraction") from None
    try:
        return Manifest.from_dict(d)
    except ValueError as e:
        raise UserError(f"{path}: invalid manifest: {e}") from None
