"""Names, limits and the error type of the latent shard format (docs/FORMAT.md, format versions 1, 2 and 3).

A shard set is a folder of WebDataset tar shards `shard-000000.tar, ...` plus `manifest.json`. Inside a
shard every sample is a run of members `<key>.<field>`, where the key is the zero-padded global image index
(`sample_key`) and the fields come from a fixed, closed list. Everything that decides whether a member name
is acceptable lives here, so the writer, the reader and `verify` cannot disagree.
"""
from __future__ import annotations

import functools
import os
import re

from dit_pipeline.common.errors import UserError

FORMAT_VERSION = 1
# A set with the optional pixels field (`<key>.pixels.webp`, shards/pixels.py) is version 2: a reader that
# predates the field refuses the set by its version instead of calling every pixels member damaged. Sets
# without pixels stay version 1, byte for byte what they were.
FORMAT_VERSION_PIXELS = 2
# A set whose latents are normalized per channel (the manifest's normalization field, common/latent_norm.py) is
# version 3, pixels or not: a reader that predates the field would train on the scalar factors alone, the
# silent failure per-channel statistics exist to prevent, so it must refuse the set by its version.
FORMAT_VERSION_NORMALIZATION = 3
# A set whose samples carry captions (`<key>.captions.json`), or a text set (store "text": per-caption text-encoder
# features, `<key>.text.npy` + `<key>.lengths.npy`, shards/text.py) is version 4, with or without pixels and a
# per-channel normalization: an older reader would call every caption member damaged, or read a text set as
# latents.
FORMAT_VERSION_TEXT = 4
FORMAT_VERSIONS = (FORMAT_VERSION, FORMAT_VERSION_PIXELS, FORMAT_VERSION_NORMALIZATION, FORMAT_VERSION_TEXT)
MANIFEST_NAME = "manifest.json"
# `dit-shards stats --write` keeps the manifest it replaces as manifest.json.rev<N> (shards/revision.py).
_REVISION_RE = re.compile(r"manifest\.json\.rev([1-9][0-9]*)")
KEY_DIGITS = 9
SHARD_DIGITS = 6

# Stored dtype name (manifest "dtype") -> numpy storage dtype of the .npy members. numpy has no bfloat16,
# so bfloat16 is stored as its raw 16 bits (the upper half of the float32 bit pattern) in little-endian uint16.
STORAGE_DTYPES = {"float16": "<f2", "float32": "<f4", "bfloat16": "<u2"}
# "pixels": a pixel-space set (common/pixels.py): no arrays, the latent is the sample's stored crop (PIXELS_FIELD)
# "text": a text set: no latents, each sample's captions' features (shards/text.py)
STORES = {"posterior": ("mean.npy", "std.npy"), "sample": ("latent.npy",), "pixels": (),
          "text": ("lengths.npy", "text.npy")}
PIXEL_STORE = "pixels"
PIXEL_DTYPE = "uint8"  # the manifest dtype of a pixel-space set: its latents are the 8-bit crops
TEXT_STORE = "text"
ARRAY_FIELDS = ("mean.npy", "std.npy", "latent.npy")
# The optional field; a sample has it exactly when the manifest records pixels (format version 2).
PIXELS_FIELD = "pixels.webp"
# The same crop uncompressed (the manifest's pixels encoding "npy-uint8": an NPY uint8 [H, W, 3] array)
PIXELS_RAW_FIELD = "pixels.npy"
PIXELS_FIELDS = (PIXELS_FIELD, PIXELS_RAW_FIELD)
# The captions of a sample (format version 4): a UTF-8 JSON array of one or more non-empty strings.
CAPTIONS_FIELD = "captions.json"
# Every member of a sample, in the order the writer emits them (sorted by field name).
FIELD_ORDER = (CAPTIONS_FIELD, "cls", "json", "latent.npy", "lengths.npy", "mean.npy", PIXELS_RAW_FIELD, PIXELS_FIELD,
               "std.npy", "text.npy")
REQUIRED_COMMON = ("cls", "json")
# Suffixes whose usual decoders unpickle: such a member is reported, never decoded.
PICKLE_SUFFIXES = ("pyd", "pickle", "pkl", "pth", "pt", "ckpt", "joblib")
# No member of a valid shard comes close (a [2, 16, 128, 128] float32 array is 2 MiB); anything bigger is
# refused before a byte of it is read, so a hostile size field cannot make a reader allocate gigabytes.
MAX_MEMBER_BYTES = 64 << 20
MAX_JSON_BYTES = 1 << 20

_SHARD_RE = re.compile(r"shard-([0-9]{%d,})\.tar" % SHARD_DIGITS)
_MEMBER_RE = re.compile(r"([0-9]{%d,18})\.([a-z0-9.]+)" % KEY_DIGITS)
# The names a valid shard consists of (digits, one dot-separated known field): matched first, in one step.
_VALID_RE = re.compile(r"([0-9]{%d})\.(cls|json|mean\.npy|std\.npy|latent\.npy|pixels\.webp|pixels\.npy|captions\.json|"
                       r"lengths\.npy|text\.npy)" % KEY_DIGITS)


class ShardError(UserError):
    """A problem with one shard: names the shard url, the sample key when known, and the problem."""

    def __init__(self, url: str, key: str | None, problem: str):
        self.url = str(url)
        self.key = key
        self.problem = problem
        where = f"shard {self.url}" + (f", sample {key}" if key is not None else "")
        super().__init__(f"{where}: {problem}. Run `dit-shards verify` on the shard folder for a full report; "
                         "re-extract or re-copy the shard to fix it.")

    def __reduce__(self):  # keep url/key/problem when sent between worker processes
        return (type(self), (self.url, self.key, self.problem))


@functools.lru_cache(maxsize=None)
def file_mode() -> int:
    """0666 minus the process umask: the mode `open()` would have given a new file."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def shard_name(index: int) -> str:
    """File name of shard `index`: "shard-000123.tar"."""
    if int(index) < 0:
        raise ValueError(f"shard index must be >= 0, got {index}")
    return f"shard-{int(index):0{SHARD_DIGITS}d}.tar"


def shard_index(name: str) -> int | None:
    """Index of a canonical shard file name, or None if `name` is not one."""
    m = _SHARD_RE.fullmatch(name)
    if m is None or shard_name(int(m.group(1))) != name:
        return None
    return int(m.group(1))


def revision_name(number: int) -> str:
    """The file name under which revision `number` of a manifest is kept once replaced: manifest.json.rev1."""
    return f"{MANIFEST_NAME}.rev{int(number)}"


def revision_index(name: str) -> int | None:
    """N for `manifest.json.revN`, else None."""
    m = _REVISION_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def sample_key(global_index: int) -> str:
    """Sample key of a global image index: 9 digits, zero-padded ("000001234")."""
    if int(global_index) < 0:
        raise ValueError(f"global index must be >= 0, got {global_index}")
    return f"{int(global_index):0{KEY_DIGITS}d}"


def key_index(key: str) -> int:
    """Global image index of a canonical sample key; ValueError for anything else."""
    if not isinstance(key, str) or not key.isascii() or not key.isdigit() or sample_key(int(key)) != key:
        raise ValueError(f"not a sample key: {key!r} (expected the zero-padded global index, e.g. '000001234')")
    return int(key)


def split_member(name: str) -> tuple[str, str]:
    """(key, field) of an acceptable member name; ValueError naming why a name is refused.

    Names are never used as paths, but a name that could be one (`/`, `..`, absolute, control characters)
    or that would be unpickled by a generic decoder is refused outright rather than skipped.
    """
    m = _VALID_RE.fullmatch(name)
    if m is not None:
        return m.group(1), m.group(2)
    if not name:
        raise ValueError("unsafe member name '' (empty)")
    if name.startswith("/") or "\\" in name or "/" in name:
        raise ValueError(f"unsafe member name {name!r} (a path, not a plain file name)")
    if ".." in name:
        raise ValueError(f"unsafe member name {name!r} (contains '..')")
    if not name.isprintable() or not name.isascii():
        raise ValueError(f"unsafe member name {name!r} (control or non-ASCII characters)")
    suffix = name.rsplit(".", 1)[-1].lower()
    if suffix in PICKLE_SUFFIXES:
        raise ValueError(f"pickle payload member {name!r} (refused, never unpickled)")
    m = _MEMBER_RE.fullmatch(name)
    if m is None or m.group(2) not in FIELD_ORDER:
        raise ValueError(f"unexpected member {name!r} (members are <9-digit key>.{{{','.join(FIELD_ORDER)}}})")
    key = m.group(1)
    if sample_key(int(key)) != key:
        raise ValueError(f"unexpected member {name!r} (key is not a canonical zero-padded index)")
    return key, m.group(2)
