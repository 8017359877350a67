"""Array members: NPY format version 1.0 (numpy NEP 1), written with a fixed header and read without pickle.

Writing: the header is built here from the NPY 1.0 specification (magic, version, little-endian header
length, the dict literal `{'descr': ..., 'fortran_order': False, 'shape': (...), }` padded with spaces and a
newline to a multiple of 64 bytes), so the bytes of a shard do not depend on the numpy version that wrote it.

Reading: the header is parsed once by numpy's own header reader (a literal parser, never unpickling) and
cached by its exact bytes; every further array with the same header is a `np.frombuffer` view. Object
dtypes (the only NPY content that needs pickle) are refused.

bfloat16 (absent from numpy) is stored as the upper 16 bits of the float32 bit pattern, rounded to nearest
even, in a `<u2` array; widening back (`bits << 16` viewed as float32) is exact.
"""
from __future__ import annotations

import io
import struct
import tokenize

import numpy as np

from dit_pipeline.shards.format import STORAGE_DTYPES

_MAGIC = b"\x93NUMPY"
_ALIGN = 64
# Largest |bit pattern| & sign-mask that is still finite, per storage dtype; above it: Inf or NaN.
_FINITE_MAX = {"<f2": (np.uint16, 0x7BFF, 0x7FFF), "<u2": (np.uint16, 0x7F7F, 0x7FFF),
               "<f4": (np.uint32, 0x7F7FFFFF, 0x7FFFFFFF)}
_header_cache: dict[bytes, tuple[str, tuple[int, ...], int, int] | str] = {}
_CACHE_LIMIT = 256


def npy_header(storage: str, shape: tuple[int, ...]) -> bytes:
    """The NPY 1.0 header (magic .. newline) for a C-ordered array of `storage` dtype and `shape`."""
    # Python's tuple repr is exactly the NPY spelling: "(2, 4, 32, 32)", "(5,)", "()".
    text = "{'descr': '%s', 'fortran_order': False, 'shape': %r, }" % (storage, tuple(int(d) for d in shape))
    body = text.encode("latin1")
    pad = (-(len(_MAGIC) + 4 + len(body) + 1)) % _ALIGN
    body += b" " * pad + b"\n"
    return _MAGIC + b"\x01\x00" + struct.pack("<H", len(body)) + body


def to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest, ties to even (as torch does)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def encode_array(x: np.ndarray, dtype: str) -> bytes:
    """float array -> NPY bytes in the stored `dtype` ("float16" | "float32" | "bfloat16")."""
    storage = STORAGE_DTYPES[dtype]
    x32 = np.ascontiguousarray(x, dtype=np.float32)
    with np.errstate(over="ignore"):  # an overflow becomes Inf, which the writer then refuses by name
        stored = to_bfloat16_bits(x32) if dtype == "bfloat16" else x32.astype(storage)
    return npy_header(storage, x32.shape) + stored.astype(storage, copy=False).tobytes()


def _parse_header(head: bytes) -> tuple[str, tuple[int, ...], int, int] | str:
    """(storage descr, shape, data offset, data bytes) or a problem string."""
    if head[:6] != _MAGIC or len(head) < 10:
        return "not an NPY array (bad magic)"
    stream = io.BytesIO(head)
    try:
        major, minor = np.lib.format.read_magic(stream)
        if (major, minor) == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        elif (major, minor) in ((2, 0), (3, 0)):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
        else:
            return f"unsupported NPY version {major}.{minor}"
    except (ValueError, SyntaxError, TypeError, struct.error, tokenize.TokenError) as e:
        # numpy's header reader tokenizes the dict literal: a damaged one can end inside a string (TokenError)
        return f"unreadable NPY header ({e})"
    if dtype.hasobject:
        return "pickle payload (NPY array of Python objects; refused, never unpickled)"
    if fortran and len(shape) > 1:
        return "Fortran-ordered NPY array (the format stores C order)"
    descr = dtype.str
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return descr, tuple(int(d) for d in shape), stream.tell(), nbytes


def _header_bytes(data) -> bytes:
    if len(data) >= 10 and bytes(data[6:8]) == b"\x01\x00":
        return bytes(data[:10 + struct.unpack("<H", data[8:10])[0]])
    if len(data) >= 12 and bytes(data[6:8]) in (b"\x02\x00", b"\x03\x00"):
        return bytes(data[:12 + struct.unpack("<I", data[8:12])[0]])
    return bytes(data[:10])


def decode_raw(data) -> np.ndarray:
    """NPY bytes -> the stored array (read-only view, storage dtype); ValueError naming the problem."""
    head = _header_bytes(data)
    info = _header_cache.get(head)
    if info is None:
        info = _parse_header(head)
        if len(_header_cache) >= _CACHE_LIMIT:
            _header_cache.clear()
        _header_cache[head] = info
    if isinstance(info, str):
        raise ValueError(info)
    descr, shape, offset, nbytes = info
    if len(data) != offset + nbytes:
        raise ValueError(f"NPY data is {len(data) - offset} bytes, header {descr}{list(shape)} needs {nbytes}")
    return np.frombuffer(data, dtype=descr, offset=offset).reshape(shape)


def all_finite(raw: np.ndarray) -> bool:
    """True if no element of a stored array (storage dtype <f2, <u2 = bfloat16, <f4) is Inf or NaN.

    Tests the exponent bits (one pass, no float conversion): a value is non-finite exactly when its
    magnitude bits exceed the largest finite pattern."""
    kind, finite_max, mask = _FINITE_MAX[raw.dtype.str]
    if raw.size == 0:
        return True
    return int((raw.view(kind) & kind(mask)).max()) <= finite_max


def widen(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Stored array -> a new, writable float32 array (exact for every stored dtype)."""
    if dtype == "bfloat16":
        return from_bfloat16_bits(raw)
    return raw.astype(np.float32)


def widen_into(out: np.ndarray, raw: np.ndarray, dtype: str) -> None:
    """Write the float32 values of a stored array into `out` (a float32 array of its shape), exactly, with at
    most one temporary (the loader widens text features straight into the batch)."""
    if dtype == "bfloat16":
        np.left_shift(raw.astype(np.uint32), np.uint32(16), out=out.view(np.uint32))
    else:
        out[...] = raw
