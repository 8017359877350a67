"""Captions and text-encoder features in shard sets (format version 4, docs/FORMAT.md "Captions and text").

Two kinds of members, in two kinds of sets:

- a latent set extracted with `--captions` carries each sample's captions as `<key>.captions.json`: a compact
  UTF-8 JSON array of one or more non-empty strings, stripped of leading and trailing whitespace; the manifest's
  `captions` record counts them and what was dropped (`captions_record_problems` validates it);
- a text set (store "text", `dit-extract --text-encoder`) is a sibling of such a latent set (shards/siblings.py:
  the same keys, shard by shard) holding, per sample, the features of every caption at its true token length:
  `<key>.text.npy` [T, D] (the captions' token features one after the other, T = the sum of their lengths, in
  the manifest's dtype) and `<key>.lengths.npy` [K] int32 (the token count of each of the K captions). The
  manifest's `text` record holds the encoder's identity, the empty prompt's features (stored once, base64),
  token-length histogram, truncation count and the storage error measured while writing.

Nothing here unpickles or trusts a size it has not checked.
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from dit_pipeline.shards.format import CAPTIONS_FIELD, MAX_JSON_BYTES, STORAGE_DTYPES
from dit_pipeline.shards.npy import all_finite, decode_raw, encode_array, npy_header, widen

TEXT_FIELD, LENGTHS_FIELD = "text.npy", "lengths.npy"
TEXT_FIELDS = (LENGTHS_FIELD, TEXT_FIELD)
LENGTHS_STORAGE = "<i4"
MAX_CAPTIONS = 4096          # per sample; far above any real data (long + short + a few rewrites)


# ----------------------------------------------------------------------------------------------------------
# The captions member of a latent set

def encode_captions(captions: Sequence[str]) -> bytes:
    """The `captions.json` member: compact UTF-8 JSON array (ValueError for an empty list or a bad caption)."""
    problem = captions_problem(list(captions))
    if problem:
        raise ValueError(problem)
    return json.dumps(list(captions), ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def captions_problem(value: Any) -> str | None:
    if not isinstance(value, list) or not value:
        return f"{CAPTIONS_FIELD} is not a non-empty JSON array of captions"
    if len(value) > MAX_CAPTIONS:
        return f"{CAPTIONS_FIELD} holds {len(value)} captions, more than {MAX_CAPTIONS}"
    for i, c in enumerate(value):
        if not isinstance(c, str):
            return f"{CAPTIONS_FIELD}: caption {i} is not a string"
        if not c.strip() or c != c.strip():
            return f"{CAPTIONS_FIELD}: caption {i} is empty or not stripped of surrounding whitespace"
    return None


def decode_captions(data: bytes) -> list[str]:
    """The captions of a `captions.json` member; ValueError naming the problem."""
    if len(data) > MAX_JSON_BYTES:
        raise ValueError(f"{CAPTIONS_FIELD} larger than {MAX_JSON_BYTES} bytes")
    try:
        value = json.loads(bytes(data).decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{CAPTIONS_FIELD} is not UTF-8 JSON ({e})") from None
    problem = captions_problem(value)
    if problem:
        raise ValueError(problem)
    return value


# ----------------------------------------------------------------------------------------------------------
# The members of a text set

@dataclass(frozen=True)
class TextSample:
    """One sample of a text set: per-caption token counts and the features of all its captions."""

    key: str
    lengths: np.ndarray        # [K] int32
    text: np.ndarray           # [T, D] stored (storage dtype; shards.npy.widen gives float32), T = lengths.sum()

    def caption(self, i: int) -> np.ndarray:
        """[lengths[i], D] stored features of caption i."""
        start = int(self.lengths[:i].sum())
        return self.text[start:start + int(self.lengths[i])]


def encode_text_members(features: Sequence[np.ndarray], dtype: str) -> dict[str, bytes]:
    """{lengths.npy, text.npy} bytes of one sample from its captions' [length_i, D] float arrays."""
    if not features:
        raise ValueError("a text sample holds the features of at least one caption")
    dims = {int(f.shape[1]) for f in features if f.ndim == 2}
    if len(dims) != 1 or any(f.ndim != 2 for f in features):
        raise ValueError(f"caption features must be [length, D] arrays of one D, got {[list(f.shape) for f in features]}")
    lengths = np.asarray([f.shape[0] for f in features], dtype=LENGTHS_STORAGE)
    text = np.concatenate([np.asarray(f, dtype=np.float32) for f in features]) if len(features) > 1 \
        else np.asarray(features[0], dtype=np.float32)
    return {LENGTHS_FIELD: npy_header(LENGTHS_STORAGE, lengths.shape) + lengths.tobytes(),
            TEXT_FIELD: encode_array(text, dtype)}


def check_text_sample(key: str, fields: dict[str, Any], *, dtype: str, dim: int, max_length: int) -> TextSample:
    """A text sample's members checked (the fields, dtypes, shapes, lengths in [0, max_length], T = the sum of
    the lengths; finiteness is the caller's, on the stored bits); ValueError naming the problem."""
    if set(fields) != set(TEXT_FIELDS):
        missing = [f for f in TEXT_FIELDS if f not in fields]
        extra = sorted(set(fields) - set(TEXT_FIELDS))
        raise ValueError(f"a text sample holds {' and '.join(TEXT_FIELDS)}"
                         + (f"; missing {', '.join(missing)}" if missing else "")
                         + (f"; unexpected {', '.join(extra)}" if extra else ""))
    try:
        lengths = decode_raw(fields[LENGTHS_FIELD])
        text = decode_raw(fields[TEXT_FIELD])
    except ValueError as e:
        raise ValueError(f"text member: {e}") from None
    if lengths.dtype.str != LENGTHS_STORAGE or lengths.ndim != 1 or not 1 <= lengths.size <= MAX_CAPTIONS:
        raise ValueError(f"{LENGTHS_FIELD} must be 1 to {MAX_CAPTIONS} {LENGTHS_STORAGE} values, got dtype "
                         f"{lengths.dtype.str} shape {list(lengths.shape)}")
    if int(lengths.min()) < 0 or int(lengths.max()) > max_length:
        raise ValueError(f"{LENGTHS_FIELD} {lengths.tolist()} outside [0, {max_length}] (the encoder's max length)")
    if text.dtype.str != STORAGE_DTYPES[dtype]:
        raise ValueError(f"{TEXT_FIELD} has dtype {text.dtype.str}, the manifest says {dtype} ({STORAGE_DTYPES[dtype]})")
    total = int(lengths.astype(np.int64).sum())
    if text.ndim != 2 or text.shape != (total, dim):
        raise ValueError(f"{TEXT_FIELD} has shape {list(text.shape)}, the lengths and the manifest say [{total}, {dim}]")
    return TextSample(key, lengths, text)


def text_sample_finite(sample: TextSample) -> bool:
    return all_finite(sample.text)


# ----------------------------------------------------------------------------------------------------------
# Manifest records

def length_edges(max_length: int) -> list[int]:
    """Histogram bin edges of token counts: [0, 1, 2, 4, 8, ..., max_length, max_length + 1); the last bin holds
    the captions at the limit exactly (full or truncated)."""
    edges, e = [0, 1], 2
    while e < max_length:
        edges.append(e)
        e *= 2
    return edges + [max_length, max_length + 1]


def length_histogram(lengths: Sequence[int], max_length: int) -> list[int]:
    """Counts per `length_edges(max_length)` bin."""
    edges = length_edges(max_length)
    counts, _ = np.histogram(np.asarray(lengths, np.int64), bins=np.asarray(edges))
    return [int(c) for c in counts]


def encode_null(features: np.ndarray, dtype: str) -> dict[str, Any]:
    """The manifest entry of the empty prompt's features [n, D] (stored once, in the set's dtype)."""
    if features.ndim != 2:
        raise ValueError(f"the empty prompt's features must be [n, D], got {list(features.shape)}")
    data = encode_array(np.asarray(features, np.float32), dtype)
    raw = decode_raw(data)
    return {"tokens": int(features.shape[0]), "encoding": f"{STORAGE_DTYPES[dtype]}-base64",
            "data": base64.b64encode(raw.tobytes()).decode("ascii")}


def decode_null(entry: dict[str, Any], dtype: str, dim: int) -> np.ndarray:
    """float32 [n, D] features of the empty prompt from its manifest entry (exact)."""
    storage = STORAGE_DTYPES[dtype]
    raw = np.frombuffer(base64.b64decode(entry["data"], validate=True), dtype=storage)
    return widen(raw.reshape(int(entry["tokens"]), dim), dtype)


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def captions_record_problems(r: Any) -> list[str]:
    if not isinstance(r, dict):
        return [f"captions must be an object, got {type(r).__name__}"]
    out = []
    if r.get("member") != CAPTIONS_FIELD:
        out.append(f"captions.member must be {CAPTIONS_FIELD!r}")
    for k in ("captions", "dropped_empty", "dropped_undecodable", "uncaptioned"):
        if not _is_count(r.get(k)):
            out.append(f"captions.{k} must be a non-negative integer")
    if not isinstance(r.get("unmatched"), dict) or not _is_count(r["unmatched"].get("count")):
        out.append("captions.unmatched must be {count, examples}")
    sha = r.get("sha256")
    if not (isinstance(sha, str) and len(sha) == 64):
        out.append("captions.sha256 must be 64 hex digits")
    return out


def text_record_problems(r: Any, latent_shape: Any, dtype: str) -> list[str]:
    if not isinstance(r, dict):
        return [f"text must be an object, got {type(r).__name__}"]
    out = []
    enc = r.get("encoder")
    if not isinstance(enc, dict) or enc.get("kind") != "text":
        out.append("text.encoder must be a text encoder's identity (kind 'text')")
    dim: Any = r.get("dim")
    max_length: Any = r.get("max_length")
    if not (_is_count(dim) and dim > 0) or latent_shape != [dim]:
        out.append(f"text.dim must be a positive integer equal to latent_shape [D], got {dim!r} and {latent_shape!r}")
    if not (_is_count(max_length) and max_length > 0):
        out.append(f"text.max_length must be a positive integer, got {max_length!r}")
    for k in ("captions", "tokens", "truncated"):
        if not _is_count(r.get(k)):
            out.append(f"text.{k} must be a non-negative integer")
    hist = r.get("length_histogram")
    if not out and not (isinstance(hist, dict) and hist.get("edges") == length_edges(max_length)
                        and isinstance(hist.get("counts"), list) and len(hist["counts"]) == len(hist["edges"]) - 1):
        out.append("text.length_histogram must be {edges: length_edges(max_length), counts}")
    null: Any = r.get("null")
    if not out:
        try:
            decode_null(null, dtype, dim)
        except (TypeError, KeyError, ValueError) as e:
            out.append(f"text.null (the empty prompt's features) is unreadable ({e})")
    return out


__all__ = ["CAPTIONS_FIELD", "LENGTHS_FIELD", "TEXT_FIELD", "TEXT_FIELDS", "TextSample", "captions_problem",
           "captions_record_problems", "check_text_sample", "decode_captions", "decode_null", "encode_captions",
           "encode_null", "encode_text_members", "length_edges", "length_histogram", "text_record_problems",
           "text_sample_finite"]


# ----------------------------------------------------------------------------------------------------------
# Captions of a class-labelled set: a template filled with its class names (T2I-ImageNet's "a photo of a {name}")

def read_class_names(path: str | None, manifest: Any, where: str) -> list[str]:
    """The class names a template fills: the manifest's, or a file (one name per line in label order; JSON: a
    list, or an object keyed by the manifest's class names, e.g. ImageNet's synsets)."""
    if path is None:
        return list(manifest.class_names)
    from pathlib import Path

    from dit_pipeline.common.errors import UserError

    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{where}: cannot read class_names {path} ({e})") from None
    names: Any
    if p.suffix.lower() == ".json":
        try:
            names = json.loads(text)
        except ValueError as e:
            raise UserError(f"{where}: class_names {path} is not JSON ({e})") from None
        if isinstance(names, dict):
            missing = [c for c in manifest.class_names if c not in names]
            if missing:
                raise UserError(f"{where}: class_names {path} has no name for {', '.join(missing[:5])}")
            names = [names[c] for c in manifest.class_names]
    else:
        names = [line.strip() for line in text.splitlines() if line.strip()]
    if not isinstance(names, list) or not all(isinstance(n, str) and n.strip() for n in names):
        raise UserError(f"{where}: class_names {path} must give one non-empty name per class")
    if len(names) != manifest.num_classes:
        raise UserError(f"{where}: class_names {path} gives {len(names)} names for the {manifest.num_classes} classes "
                        "of the shard set")
    return [n.strip() for n in names]


def template_captions(template: str, names: Sequence[str]) -> tuple[str, ...]:
    """The caption of each class: the template with {name} filled (T2I-ImageNet's "a photo of a {name}")."""
    return tuple(template.replace("{name}", n).strip() for n in names)
