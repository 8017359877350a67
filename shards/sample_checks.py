"""What a shard's samples must look like, and the checks of one sample's members against it.

`Expect` is derived once per shard set from its manifest (store, storage dtype, shape, classes, pixels and
captions members, a text set's max length); `check_sample` validates one sample's members (the closed set of
fields of its store, the label, each array's NPY header, dtype and shape) and `field_problem` names what is
wrong with a sample's set of fields. Without a manifest the store and layout are inferred from the members
themselves. Arrays are read without pickle (`shards.npy.decode_raw`); finiteness is left to the caller
(`shards.npy.all_finite` on the stored bits). Used by the reader (shards/reader.py), `dit-shards verify`
(shards/verify.py) and `dit-shards stats` (shards/stats.py); the format itself is docs/FORMAT.md.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from dit_pipeline.shards.format import (ARRAY_FIELDS, CAPTIONS_FIELD, MAX_JSON_BYTES, PIXELS_FIELD, PIXELS_FIELDS,
                                        REQUIRED_COMMON, STORAGE_DTYPES, STORES, TEXT_STORE)
from dit_pipeline.shards.manifest import Manifest
from dit_pipeline.shards.npy import decode_raw
from dit_pipeline.shards.pixels import ENCODING, ENCODINGS
from dit_pipeline.shards.text import TEXT_FIELDS, decode_captions

DTYPE_OF_STORAGE = {v: k for k, v in STORAGE_DTYPES.items()}  # numpy storage dtype -> the manifest's dtype name
_LATENT_STORES = {k: v for k, v in STORES.items() if k != TEXT_STORE}
_FIELD_SETS = {(store, px, cap): frozenset((*REQUIRED_COMMON, *arrays, *((px,) if px else ()),
                                            *((CAPTIONS_FIELD,) if cap else ())))
               for store, arrays in _LATENT_STORES.items() for px in (None, *PIXELS_FIELDS) for cap in (False, True)}


@dataclass(frozen=True)
class Expect:
    """What every sample of a shard set must look like, derived once from its manifest."""

    store: str
    dtype: str
    storage: str
    shape: tuple[int, ...]
    num_classes: int
    pixels: bool = False                # every sample has a pixels member
    image_size: int | None = None
    pixels_encoding: str = ENCODING     # which member: pixels.webp, or pixels.npy ("npy-uint8")
    captions: bool = False              # every sample has a captions member (format version 4)
    max_length: int | None = None       # a text set: the encoder's max tokens per caption (shape = (D,))

    @classmethod
    def from_manifest(cls, m: Manifest) -> "Expect":
        if m.is_text:
            assert m.text is not None
            return cls(store=m.store, dtype=m.dtype, storage=STORAGE_DTYPES[m.dtype], shape=tuple(m.latent_shape),
                       num_classes=m.num_classes, max_length=int(m.text["max_length"]))
        return cls(store=m.store, dtype=m.dtype, storage=STORAGE_DTYPES.get(m.dtype, "|u1"),
                   shape=(m.views, *m.latent_shape), num_classes=m.num_classes, pixels=m.has_pixels,
                   image_size=m.image_size, pixels_encoding=str((m.pixels or {}).get("encoding", ENCODING)),
                   captions=m.has_captions)

    @property
    def pixels_member(self) -> str | None:
        return ENCODINGS.get(self.pixels_encoding, PIXELS_FIELD) if self.pixels else None


def parse_label(data: bytes) -> int:
    """The integer of a `cls` member: ASCII decimal digits only (no sign, spaces or newline)."""
    if not (0 < len(data) <= 10 and data.isdigit()):
        raise ValueError(f"cls is not a non-negative ASCII integer: {bytes(data[:20])!r}")
    return int(data)


def _array(field: str, data: bytes, expect: Expect | None) -> np.ndarray:
    """The stored array of an NPY member, checked against the manifest (dtype, shape; not finiteness)."""
    try:
        raw = decode_raw(data)
    except ValueError as e:
        raise ValueError(f"{field}: {e}") from None
    if expect is None:
        if raw.dtype.str not in DTYPE_OF_STORAGE or raw.ndim != 4:
            raise ValueError(f"{field} has dtype {raw.dtype.str} and shape {list(raw.shape)}; the format "
                             "stores <f2, <f4 or <u2 (bfloat16) arrays of shape [V, C, h, w]")
    elif raw.dtype.str != expect.storage:
        raise ValueError(f"{field} has dtype {raw.dtype.str}, the manifest says {expect.dtype} "
                         f"({expect.storage})")
    elif raw.shape != expect.shape:
        raise ValueError(f"{field} has shape {list(raw.shape)}, the manifest says {list(expect.shape)}")
    return raw


def field_problem(fields: dict[str, Any], store: str, pixels: bool | str | None = False,
                  captions: bool = False) -> str | None:
    """What is wrong with the set of fields of a sample (missing or foreign ones), or None. `pixels`: the
    manifest records pixels (True: pixels.webp; or the member's name), so every sample has that pixels member
    (and no sample has one otherwise); likewise `captions`. A text set's samples hold exactly the text fields."""
    member = (PIXELS_FIELD if pixels is True else pixels) or None
    if store == TEXT_STORE:
        if set(fields) == set(TEXT_FIELDS):
            return None
        return (f"a text sample holds exactly {' and '.join(TEXT_FIELDS)}, got {', '.join(sorted(fields))}")
    wanted = STORES[store]
    missing = [f for f in (*REQUIRED_COMMON, *wanted) if f not in fields]
    if missing:
        return f"missing field(s) {', '.join(missing)} (store {store!r})"
    extra = [f for f in ARRAY_FIELDS if f in fields and f not in wanted]
    if extra:
        return f"unexpected field(s) {', '.join(extra)} for store {store!r}"
    if member and member not in fields:
        return f"missing field {member} (the manifest records pixels)"
    foreign = [f for f in PIXELS_FIELDS if f in fields and f != member]
    if foreign:
        return (f"unexpected field {foreign[0]} (the manifest records no pixels)" if not member else
                f"unexpected field {foreign[0]} (the manifest records pixels as {member})")
    if captions and CAPTIONS_FIELD not in fields:
        return f"missing field {CAPTIONS_FIELD} (the manifest records captions)"
    if not captions and CAPTIONS_FIELD in fields:
        return f"unexpected field {CAPTIONS_FIELD} (the manifest records no captions)"
    extra = sorted(set(fields) - _FIELD_SETS[store, member, captions])
    if extra:
        return f"unexpected field(s) {', '.join(extra)} for store {store!r}"
    return None


def _meta(data: bytes) -> dict:
    if len(data) > MAX_JSON_BYTES:
        raise ValueError(f"json member larger than {MAX_JSON_BYTES} bytes")
    try:
        meta = json.loads(bytes(data))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"json is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError("json is not a JSON object")
    return meta


def _store_of(fields: dict[str, Any]) -> str:
    """The store a sample's fields show (reading without a manifest)."""
    if "latent.npy" in fields:
        return "sample"
    return "posterior" if "mean.npy" in fields or not any(f in fields for f in PIXELS_FIELDS) else "pixels"


def check_sample(key: str, fields: dict[str, Any], expect: Expect | None, *, parse_meta: bool
                 ) -> tuple[int, dict[str, np.ndarray], dict | None]:
    """Validate one sample's members: (label, stored arrays by field, meta or None); ValueError naming
    the problem. Finiteness is left to the caller (`shards.npy.all_finite` on the stored bits)."""
    store = expect.store if expect is not None else _store_of(fields)
    pixels = expect.pixels_member if expect is not None else next((f for f in PIXELS_FIELDS if f in fields), None)
    captions = expect.captions if expect is not None else CAPTIONS_FIELD in fields
    wanted = STORES[store]
    if store == TEXT_STORE or fields.keys() != _FIELD_SETS[store, pixels, captions]:
        raise ValueError(field_problem(fields, store, pixels, captions) or
                         f"a text sample where a latent sample was expected ({', '.join(sorted(fields))})")
    label = parse_label(fields["cls"])
    if expect is not None and label >= expect.num_classes:
        raise ValueError(f"label {label} out of range [0, {expect.num_classes})")
    arrays = {f: _array(f, fields[f], expect) for f in wanted}
    if expect is None and len({a.shape for a in arrays.values()}) != 1:
        raise ValueError(f"array shapes differ: {[list(a.shape) for a in arrays.values()]}")
    if parse_meta and captions:
        decode_captions(fields[CAPTIONS_FIELD])
    return label, arrays, _meta(fields["json"]) if parse_meta else None
