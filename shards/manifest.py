"""`manifest.json`: the description of a shard set (docs/FORMAT.md), written last and atomically.

It records how the latents were made (the full extraction config, with the VAE identity and the VAE's
`scaling_factor`/`shift_factor`), how model latents are made from them (those factors, or a per-channel
`normalization`: common/latent_norm.py, format version 3), what they look like (store, dtype, latent shape,
views), the classes in label order, and per shard its name, sample count, key range, byte size and sha256; a
manifest that `dit-shards stats --write` replaced records its `revision` (shards/revision.py). Reading it
validates every field and reports all problems at once, so a damaged or foreign manifest is refused with a
message that names what is wrong.
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
from dit_pipeline.common.latent_norm import LatentNorm, normalization_problems
from dit_pipeline.shards.format import (FORMAT_VERSION, FORMAT_VERSION_NORMALIZATION, FORMAT_VERSION_PIXELS,
                                        FORMAT_VERSION_TEXT, FORMAT_VERSIONS, MANIFEST_NAME, PIXEL_DTYPE, PIXEL_STORE,
                                        STORAGE_DTYPES, STORES, TEXT_STORE, file_mode, key_index, shard_index)
from dit_pipeline.shards.pixels import pixels_entry_problems
from dit_pipeline.shards.text import captions_record_problems, decode_null, text_record_problems


Z = TypeVar("Z")


def scale_latents(z: Z, scaling_factor: float, shift_factor: float | None) -> Z:
    """The scalar latent formula `(z - shift_factor) * scaling_factor` (diffusers' convention; no shift when the
    VAE has none, as for the SD VAE): `LatentNorm.apply` of a scalar normalization, which also does the
    per-channel one (`Manifest.norm`). A torch tensor is scaled in place, a numpy array gives a new array.
    """
    return LatentNorm(scaling_factor, shift_factor).apply(z)


def format_version_for(*, pixels: bool, normalization: bool, text: bool = False) -> int:
    """The lowest format version that describes a set: 4 with captions or for a text set, 3 with a per-channel
    normalization, 2 with pixels, else 1 (so a set without any is byte for byte what earlier releases wrote)."""
    if text:
        return FORMAT_VERSION_TEXT
    if normalization:
        return FORMAT_VERSION_NORMALIZATION
    return FORMAT_VERSION_PIXELS if pixels else FORMAT_VERSION


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
    # Format version 3 only: the per-channel normalization (common/latent_norm.py), which then decides instead
    # of scaling_factor / shift_factor; None, and absent from the JSON, for a scalar set.
    normalization: dict[str, Any] | None = None
    # A manifest written by `dit-shards stats --write` (shards/revision.py): {"number", "previous", "by"}; None,
    # and absent, in the manifest dit-extract wrote (revision 1).
    revision: dict[str, Any] | None = None
    # Format version 4 only (shards/text.py): the captions record of a set whose samples carry captions; the text
    # record of a text set (store "text": text-encoder features, latent_shape [D]). None, and absent, otherwise.
    captions: dict[str, Any] | None = None
    text: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["shards"] = [s.to_dict() for s in self.shards]
        d["latent_shape"] = list(self.latent_shape)
        for optional in _OPTIONAL:  # absent when unset: a set without them is the version 1 manifest, byte for byte
            if d[optional] is None:
                del d[optional]
        return d

    @property
    def norm(self) -> LatentNorm:
        """How model latents are made from the stored ones (the trainer, stats and the checkpoints use this)."""
        return LatentNorm(self.scaling_factor, self.shift_factor, self.normalization)

    @property
    def revision_number(self) -> int:
        return int(self.revision["number"]) if self.revision else 1

    @property
    def has_pixels(self) -> bool:
        return self.pixels is not None

    @property
    def has_captions(self) -> bool:
        return self.captions is not None

    @property
    def is_text(self) -> bool:
        """A text set (text-encoder features of a captioned set's captions, no latents)."""
        return self.store == TEXT_STORE

    @property
    def text_encoder(self) -> dict[str, Any] | None:
        """A text set's encoder identity (common.text_encoders: `load_text_encoder(identity["name"],
        max_length=identity["max_length"], dtype=identity["dtype"])` rebuilds it); None for a latent set."""
        return dict(self.text["encoder"]) if self.text else None

    def null_text(self):
        """A text set's empty-prompt features, float32 [n, D] (numpy; n = 0 for an encoder that adds no special
        tokens, e.g. Qwen3): the null condition for caption dropout and guidance."""
        if not self.text:
            raise ValueError("not a text set: the manifest has no text record")
        return decode_null(self.text["null"], self.dtype, int(self.text["dim"]))

    @classmethod
    def from_dict(cls, d: Any) -> "Manifest":
        """Validate and build; ValueError listing every problem found."""
        problems = manifest_problems(d)
        if problems:
            raise ValueError("; ".join(problems))
        kw = {f.name: d[f.name] for f in fields(cls) if f.name not in _OPTIONAL}
        kw.update({k: d.get(k) for k in _OPTIONAL})
        kw["shards"] = [ShardRecord.from_dict(s) for s in d["shards"]]
        kw["latent_shape"] = list(d["latent_shape"])
        kw["scaling_factor"] = float(d["scaling_factor"])
        kw["shift_factor"] = None if d["shift_factor"] is None else float(d["shift_factor"])
        return cls(**kw)

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON of everything that defines the data: the config, the normalization and
        the shard records (not tool_version, the skipped list, the revision record or where a normalization's
        numbers came from, which do not change a single latent the trainer computes)."""
        d = self.to_dict()
        d.pop("tool_version")
        d.pop("skipped")
        d.pop("revision", None)
        if "normalization" in d:
            d["normalization"] = {k: v for k, v in d["normalization"].items() if k != "source"}
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
_OPTIONAL = ("pixels", "normalization", "revision", "captions", "text")  # fields some versions have, absent otherwise


def _versions_text() -> str:
    names = [str(v) for v in FORMAT_VERSIONS]
    return ", ".join(names[:-1]) + " and " + names[-1]


def manifest_problems(d: Any) -> list[str]:
    """Every problem with a manifest dict (empty list when it is valid)."""
    if not isinstance(d, dict):
        return ["the top level is not a JSON object"]
    missing = [k for k in _FIELD_TYPES if k not in d]
    version = d.get("format_version")
    if "format_version" in d and (version not in FORMAT_VERSIONS or isinstance(version, bool)):
        return [f"unsupported format_version {version!r} (this tool reads versions "
                f"{_versions_text()}); use the dit-pipeline version that wrote it, or re-extract"]
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
    if (d["dtype"] == PIXEL_DTYPE) != (d["store"] == PIXEL_STORE) or \
            (d["dtype"] not in STORAGE_DTYPES and d["dtype"] != PIXEL_DTYPE):
        out.append(f"dtype must be one of {sorted(STORAGE_DTYPES)} (or {PIXEL_DTYPE!r} exactly when store is "
                   f"{PIXEL_STORE!r}), got {d['dtype']!r} with store {d['store']!r}")
    shape = d["latent_shape"]
    if d["store"] == TEXT_STORE:
        if len(shape) != 1 or not all(_is_int(v) and v > 0 for v in shape):
            out.append(f"latent_shape of a text set must be [D] (the feature width), got {shape!r}")
    elif len(shape) != 3 or not all(_is_int(v) and v > 0 for v in shape):
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
    out.extend(_normalization_problems(d))
    out.extend(_text_problems(d))
    out.extend(_revision_problems(d.get("revision")))
    return out


def _pixels_problems(d: dict[str, Any]) -> list[str]:
    """The pixels field is there exactly in version 2 (FORMAT_VERSION_PIXELS), may be in version 3, and is
    valid."""
    if d["store"] == PIXEL_STORE and "pixels" not in d:
        return [f"store {PIXEL_STORE!r} keeps each sample's latent in its pixels member, but the manifest has no "
                "pixels field"]
    if d["format_version"] == FORMAT_VERSION:
        return ["pixels is a format version 2 field, but format_version is 1"] if "pixels" in d else []
    if "pixels" not in d:
        if d["format_version"] in (FORMAT_VERSION_NORMALIZATION, FORMAT_VERSION_TEXT):
            return []
        return [f"format_version {FORMAT_VERSION_PIXELS} is the version of a set with pixels, but the manifest "
                "has no pixels field"]
    return pixels_entry_problems(d["pixels"], d["image_size"])


def _normalization_problems(d: dict[str, Any]) -> list[str]:
    """The normalization field is there exactly in version 3 (FORMAT_VERSION_NORMALIZATION), and fits the
    latents' channels."""
    has = "normalization" in d
    if d["format_version"] == FORMAT_VERSION_TEXT and not has:
        return []
    if d["format_version"] not in (FORMAT_VERSION_NORMALIZATION, FORMAT_VERSION_TEXT):
        return [f"normalization is a format version {FORMAT_VERSION_NORMALIZATION} field, but format_version is "
                f"{d['format_version']}"] if has else []
    if not has:
        return [f"format_version {FORMAT_VERSION_NORMALIZATION} is the version of a set normalized per channel, "
                "but the manifest has no normalization field"]
    shape = d["latent_shape"]
    valid = len(shape) == 3 and all(_is_int(v) for v in shape)
    return normalization_problems(d["normalization"], list(shape) if valid else None)


def _text_problems(d: dict[str, Any]) -> list[str]:
    """captions and text are version 4 fields; a text set (store "text") has its text record and nothing of a
    latent set (captions, pixels, normalization); a latent set has no text record."""
    version, text_set = d["format_version"], d["store"] == TEXT_STORE
    have = [k for k in ("captions", "text") if k in d]
    if version != FORMAT_VERSION_TEXT:
        wrong = have + (["store 'text'"] if text_set else [])
        return [f"{', '.join(wrong)}: format version {FORMAT_VERSION_TEXT} only, but format_version is {version}"] \
            if wrong else []
    if text_set:
        out = [f"a text set has no {k}" for k in ("captions", "pixels", "normalization") if k in d]
        if "text" not in d:
            return out + ["a text set (store 'text') needs its text record"]
        return out + text_record_problems(d["text"], d["latent_shape"], d["dtype"])
    if "text" in d:
        return ["a text record belongs to a text set (store 'text')"]
    if "captions" not in d:
        return [f"format_version {FORMAT_VERSION_TEXT} is the version of a set with captions or of a text set, but "
                "the manifest has neither"]
    return captions_record_problems(d["captions"])


def _revision_problems(r: Any) -> list[str]:
    if r is None:
        return []
    if not (isinstance(r, dict) and _is_int(r.get("number")) and r["number"] >= 2
            and isinstance(r.get("previous"), str) and isinstance(r.get("by"), str)):
        return [f"revision must be an object with number (an integer >= 2), previous (a file name) and by (text), "
                f"got {r!r}"]
    return []


def write_manifest(folder: str | Path, manifest: Manifest) -> Path:
    """Write FOLDER/manifest.json atomically (temp file, fsync, rename); returns its path."""
    problems = manifest_problems(manifest.to_dict())
    if problems:
        raise ValueError("refusing to write an invalid manifest: " + "; ".join(problems))
    path = Path(folder) / MANIFEST_NAME
    atomic_write_json(path, manifest.to_dict())
    os.chmod(path, file_mode())  # the atomic temp file is 0600; the manifest is shared like the shards
    return path


def require_latents(m: Manifest, where: str | Path, what: str) -> Manifest:
    """`m` unless it is a text set (which holds no latents); UserError naming the folder and what to pass."""
    if m.is_text:
        name = (m.text_encoder or {}).get("name", "?")
        raise UserError(f"{where} is a text set (text-encoder features of {name}, no latents); {what} needs a latent "
                        "shard set (pass the text set beside it, as its sibling)")
    return m


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
