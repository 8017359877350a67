"""ShardWriter: one WebDataset tar shard, written crash-safely and byte-for-byte deterministically.

The shard is written to a hidden temp name next to its final path (`.tmp-shard-000003.tar.XXXX`, which
`verify` and `common.io.remove_stale_temps` recognise), fsynced and renamed on close, so a reader sees
either no shard or a complete one (RELIABILITY.md). Its byte size and sha256 are computed from the bytes
as they are written, never by re-reading. Every header field that could vary (mtime, uid/gid, user and
group names, mode, member order) is fixed, so the same calls produce the same bytes on any machine, which
is what lets a resumed or multi-rank extraction reproduce an uninterrupted one exactly.
Fault points for the kill tests (common.faults): `shards.mid_sample` halfway through a sample's bytes,
`shards.before_rename` after the fsync of the complete temp file, before its rename.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Any

import numpy as np

from dit_pipeline.common.faults import fault_point
from dit_pipeline.common.io import TMP_PREFIX, HashingWriter, fsync_dir
from dit_pipeline.shards.format import PIXEL_DTYPE, PIXEL_STORE, STORAGE_DTYPES, ShardError, file_mode, key_index
from dit_pipeline.shards.manifest import ShardRecord
from dit_pipeline.shards.npy import all_finite, encode_array, decode_raw
from dit_pipeline.shards.pixels import (ENCODING, PIXELS_RAW_FIELD, encode_pixels, member_of, pixels_size,
                                        raw_size)
from dit_pipeline.shards.tario import end_of_archive, member_bytes
from dit_pipeline.shards.text import CAPTIONS_FIELD, TEXT_FIELD, encode_captions, encode_text_members


def _as_float_array(x: Any, what: str) -> np.ndarray:
    a = np.asarray(x)
    if not np.issubdtype(a.dtype, np.floating):
        raise ValueError(f"{what} must be a floating-point array, got dtype {a.dtype}")
    if a.ndim != 4 or 0 in a.shape:
        raise ValueError(f"{what} must have shape [V, C, h, w] with V, C, h, w > 0, got {list(a.shape)}")
    return a


class ShardWriter:
    """Write one shard; use as a context manager (an exception inside the block aborts the shard).

    dtype: how arrays are stored: "float16" (default), "float32" or "bfloat16" (raw 16 bits as uint16).
    pixels: every sample carries its pixels (`write(..., pixels=...)`, format version 2); `pixel_bytes` adds
    up the bytes of those members, for the manifest's pixels entry.
    captions: every sample carries its captions (`write(..., captions=[...])`, format version 4).
    A text set's shard is written with `write_text` instead (shards/text.py), one sample per key.
    """

    def __init__(self, path: str | os.PathLike, *, dtype: str = "float16", pixels: bool = False,
                 store: str | None = None, pixels_encoding: str = ENCODING, captions: bool = False):
        if store == PIXEL_STORE:  # a pixel-space set: no arrays, every sample's latent is its crop
            dtype, pixels = PIXEL_DTYPE, True
        elif dtype not in STORAGE_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(STORAGE_DTYPES)}, got {dtype!r}")
        self.path = Path(path)
        self.dtype = dtype
        self.pixels = bool(pixels)
        self.pixels_member = member_of(pixels_encoding)  # ValueError for an unknown encoding
        self.pixels_encoding = pixels_encoding
        self.captions = bool(captions)
        self.pixel_bytes = 0
        self._pixel_size: tuple[int, int] | None = None
        self.record: ShardRecord | None = None
        self._samples = 0
        self._first: str | None = None
        self._last: str | None = None
        self._store: str | None = PIXEL_STORE if store == PIXEL_STORE else None
        self._shape: tuple[int, ...] | None = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{self.path.name}.", dir=self.path.parent)
        self._tmp = Path(tmp)
        self._file: IO[bytes] | None = os.fdopen(fd, "wb")
        self._out = HashingWriter(self._file)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self.record is None and self._file is not None:
            self.close()

    def write(self, key: str, *, label: int, meta: dict, mean: np.ndarray | None = None,
              std: np.ndarray | None = None, latent: np.ndarray | None = None,
              pixels: np.ndarray | bytes | None = None, captions: list[str] | None = None) -> None:
        """Append one sample: either `mean` and `std` (the posterior) or `latent`, float [V, C, h, w]; and,
        for a writer made with `pixels=True`, the crop: uint8 [H, W, 3] or its WebP bytes (`encode_pixels`).

        Keys must increase within a shard. Values that are not finite in the stored dtype (NaN, Inf, or a
        float16 overflow) are refused with a ShardError rather than written."""
        self._check_key(key)
        if not isinstance(label, (int, np.integer)) or isinstance(label, bool) or label < 0:
            raise ValueError(f"label must be a non-negative integer, got {label!r}")
        if not isinstance(meta, dict):
            raise ValueError(f"meta must be a dict, got {type(meta).__name__}")
        arrays = self._arrays(mean, std, latent)
        members = {"cls": str(int(label)).encode("ascii"),
                   "json": json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                                      allow_nan=False).encode("utf-8")}
        for field, value in arrays.items():
            data = encode_array(value, self.dtype)
            if not all_finite(decode_raw(data)):
                raise ShardError(str(self.path), key, f"{field} holds NaN or Inf (or overflows {self.dtype}); "
                                 "refusing to store it")
            members[field] = data
        if self.pixels or pixels is not None:
            members[self.pixels_member] = self._pixels_member(key, pixels)
        if self.captions != (captions is not None):
            raise ValueError(f"{self.path.name}: key {key} {'has no' if self.captions else 'has'} captions, but the "
                             f"writer was made with captions={self.captions}")
        if captions is not None:
            members[CAPTIONS_FIELD] = encode_captions(captions)
        self._append(key, members)
        self.pixel_bytes += len(members.get(self.pixels_member, b""))

    def write_text(self, key: str, features: list[np.ndarray]) -> None:
        """Append one sample of a text set: the features [length_i, D] of each of its captions, in order
        (stored at their true lengths, shards/text.py). Non-finite values are refused with a ShardError."""
        self._check_key(key)
        members = encode_text_members(features, self.dtype)
        if not all_finite(decode_raw(members[TEXT_FIELD])):
            raise ShardError(str(self.path), key, f"{TEXT_FIELD} holds NaN or Inf (or overflows {self.dtype}); "
                             "refusing to store it")
        self._append(key, members)

    def _check_key(self, key: str) -> None:
        if self._file is None:
            raise RuntimeError(f"{self.path}: write() after close() or abort()")
        idx = key_index(key)
        if self._last is not None and idx <= key_index(self._last):
            raise ValueError(f"{self.path.name}: key {key} after {self._last}: keys must increase within a shard")

    def _append(self, key: str, members: dict[str, bytes]) -> None:
        # Fields in sorted order (cls, json, latent.npy | mean.npy, std.npy): fixed bytes, and the key's
        # members stay contiguous, which is what WebDataset's grouping needs.
        blob = memoryview(b"".join(member_bytes(f"{key}.{f}", members[f]) for f in sorted(members)))
        # Written in two halves around a fault point, so the kill tests can leave a temp tar that ends
        # inside a member (a process killed while its write is in flight).
        half = len(blob) // 2
        self._out.write(blob[:half])
        fault_point("shards.mid_sample")
        self._out.write(blob[half:])
        self._samples += 1
        self._first = self._first or key
        self._last = key

    def _pixels_member(self, key: str, pixels: np.ndarray | bytes | None) -> bytes:
        """The WebP bytes of a sample's pixels, checked: given exactly when the writer stores pixels, 8-bit RGB,
        one size for the whole shard."""
        if not self.pixels:
            raise ValueError(f"{self.path.name}: pixels given for key {key}, but the writer was made without "
                             "pixels=True")
        if pixels is None:
            raise ValueError(f"{self.path.name}: key {key} has no pixels; a writer made with pixels=True stores "
                             "them for every sample")
        raw = isinstance(pixels, (bytes, bytearray, memoryview))
        data = bytes(pixels) if raw else encode_pixels(pixels, self.pixels_encoding)  # type: ignore[arg-type]
        size = (raw_size(data) if self.pixels_member == PIXELS_RAW_FIELD  # ValueError unless complete RGB
                else pixels_size(data))
        if self._pixel_size not in (None, size):
            raise ValueError(f"{self.path.name}: pixels of key {key} are {size[0]}x{size[1]}, earlier samples "
                             f"{self._pixel_size[0]}x{self._pixel_size[1]}")
        self._pixel_size = size
        return data

    def _arrays(self, mean, std, latent) -> dict[str, np.ndarray]:
        if self._store == PIXEL_STORE:
            if mean is not None or std is not None or latent is not None:
                raise ValueError(f"{self.path.name}: a pixel-space shard stores no arrays, only each sample's crop")
            return {}
        if latent is not None and (mean is not None or std is not None):
            raise ValueError("pass either mean and std (posterior) or latent (a sample), not both")
        if latent is None and (mean is None or std is None):
            raise ValueError("pass both mean and std (posterior), or latent")
        store = "sample" if latent is not None else "posterior"
        arrays = ({"latent.npy": _as_float_array(latent, "latent")} if store == "sample" else
                  {"mean.npy": _as_float_array(mean, "mean"), "std.npy": _as_float_array(std, "std")})
        shapes = {a.shape for a in arrays.values()}
        if len(shapes) != 1:
            raise ValueError(f"mean and std shapes differ: {[list(s) for s in shapes]}")
        shape = shapes.pop()
        if self._store not in (None, store) or self._shape not in (None, shape):
            raise ValueError(f"{self.path.name}: every sample of a shard has the same store and shape; got "
                             f"{store} {list(shape)} after {self._store} {list(self._shape or ())}")
        self._store, self._shape = store, shape
        return arrays

    def close(self) -> ShardRecord:
        """Finish the archive, fsync, rename onto the final path; returns the shard's record."""
        if self.record is not None:
            return self.record
        if self._file is None:
            raise RuntimeError(f"{self.path}: close() after abort()")
        try:
            self._out.write(end_of_archive(self._out.bytes))
            self._file.flush()
            os.fchmod(self._file.fileno(), file_mode())  # mkstemp makes 0600; shards are shared data
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
            fault_point("shards.before_rename")  # complete temp file, final name not yet there
            os.replace(self._tmp, self.path)
            fsync_dir(self.path.parent)
        except BaseException:
            self.abort()
            raise
        self.record = ShardRecord(name=self.path.name, samples=self._samples, first_key=self._first,
                                  last_key=self._last, bytes=self._out.bytes, sha256=self._out.hexdigest())
        return self.record

    def abort(self) -> None:
        """Drop the temp file; whatever is at `path` stays as it was."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        with contextlib.suppress(FileNotFoundError):
            self._tmp.unlink()
