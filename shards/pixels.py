"""The optional `pixels.webp` field: the exact 8-bit RGB crop the VAE encoded, stored losslessly (docs/FORMAT.md).

REPA-style training (Yu et al. 2024, arXiv:2410.06940) aligns the model's hidden states with a frozen vision
teacher that sees the training image; the teacher's input must be the very crop the latents were made from.
A shard set extracted with `dit-extract --pixels` stores it once per sample (view 0, the crop as encoded; view
1 of a flipped set is its left-right mirror: `view_pixels`) as lossless WebP (the simple `VP8L` file: RIFF
header, one lossless bitstream, no alpha, no metadata), the encoding bench/pixels.py picked over PNG, raw
NPY and PPM (BENCHMARKS.md, "Pixels": smaller than PNG, and faster to encode and to decode).

Cheap checks belong to the reader's hot path (`header_problem`: the RIFF size against the member's size,
which catches a truncated member, and the lossless header's width, height and alpha flag, from the first 25
bytes); decoding belongs to the consumer that needs the array (`decode_pixels`, called by loader workers,
and by `dit-shards verify` for every member). A declared size other than the manifest's is refused before
any pixel is decoded, so a hostile member cannot make a reader allocate more than one crop.
"""
from __future__ import annotations

import io
import struct
from typing import Any, Callable

import numpy as np

from dit_pipeline.shards.format import PIXELS_FIELD, PIXELS_RAW_FIELD, ShardError

ENCODING = "webp-lossless"
# The uncompressed alternative (pixel-space sets: `dit-extract --encoder pixels --pixel-encoding npy-uint8`): the
# crop as an NPY uint8 [H, W, 3] array, decoded for free (bench/pixel_rate.py: 5x WebP's crops per core, 1.7x the
# bytes). The encoding names its member.
RAW_ENCODING = "npy-uint8"
ENCODINGS = {ENCODING: PIXELS_FIELD, RAW_ENCODING: PIXELS_RAW_FIELD}
_RAW_DESCR = "|u1"
MODE = "RGB"
# libwebp's lossless effort settings (0 = fastest): bench/pixels.py measured methods 0-6 and qualities 0-100
# side by side (BENCHMARKS.md, "Pixels"); more effort bought a few percent of size for many times the time.
WEBP_METHOD = 0
WEBP_QUALITY = 50
MAX_SIDE = 16383  # the largest width or height a WebP file can declare
_HEADER = struct.Struct("<4sI4s4sIB")  # "RIFF", size, "WEBP", "VP8L", chunk size, signature 0x2f
_HEADER_BYTES = _HEADER.size + 4       # + 32 bits: width - 1 (14), height - 1 (14), alpha used (1), version (3)


def codec_problem() -> str | None:
    """Why this Pillow cannot write or read the pixels (built without WebP), or None."""
    from PIL import features

    if not features.check("webp"):
        return ("this Pillow was built without WebP support, which the pixels field needs (lossless WebP); "
                "install a Pillow wheel from PyPI (they include libwebp)")
    return None


def codec_version() -> str | None:
    """The libwebp version that decides the pixels' bytes (recorded with the extraction)."""
    from PIL import features

    return features.version("webp")


def member_of(encoding: str) -> str:
    """The member name of a pixels encoding; ValueError for an unknown one."""
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown pixels encoding {encoding!r}; choose one of: {', '.join(ENCODINGS)}")
    return ENCODINGS[encoding]


def encode_pixels(pixels: np.ndarray, encoding: str = ENCODING) -> bytes:
    """uint8 [H, W, 3] -> lossless WebP bytes (or, `encoding` "npy-uint8", the NPY array). The same array gives
    the same bytes (fixed settings, no metadata, one library build: the libwebp version is recorded with the
    extraction)."""
    from PIL import Image

    a = np.asarray(pixels)
    if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] != 3 or 0 in a.shape or max(a.shape[:2]) > MAX_SIDE:
        raise ValueError(f"pixels must be a uint8 array [H, W, 3] with sides up to {MAX_SIDE}, got {a.dtype} "
                         f"{list(a.shape)}")
    if member_of(encoding) == PIXELS_RAW_FIELD:
        from dit_pipeline.shards.npy import npy_header

        return npy_header(_RAW_DESCR, a.shape) + np.ascontiguousarray(a).tobytes()
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(a), MODE).save(buf, "WEBP", lossless=True, exact=True,
                                                        method=WEBP_METHOD, quality=WEBP_QUALITY)
    return buf.getvalue()


def pixels_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a lossless WebP header; ValueError if the member is not a complete simple
    lossless WebP file without alpha (the only kind the format stores)."""
    head = bytes(data[:_HEADER_BYTES])
    if len(head) < _HEADER_BYTES:
        raise ValueError(f"not a lossless WebP file ({len(data)} bytes)")
    riff, size, webp, chunk, chunk_size, signature = _HEADER.unpack_from(head)
    if riff != b"RIFF" or webp != b"WEBP":
        raise ValueError(f"not a WebP file (starts {head[:4]!r}...{head[8:12]!r})")
    if chunk != b"VP8L" or signature != 0x2F:
        raise ValueError(f"not a simple lossless WebP file (first chunk {chunk!r}; the format stores VP8L)")
    if size + 8 != len(data) or chunk_size + (chunk_size & 1) + 20 != len(data):
        raise ValueError(f"WebP file is {len(data)} bytes, its header declares {size + 8} (truncated or spliced)")
    bits = int.from_bytes(head[21:25], "little")
    w, h, alpha, version = (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1, (bits >> 28) & 1, bits >> 29
    if alpha or version:
        raise ValueError(f"WebP declares alpha {alpha}, version {version} (the format stores RGB: alpha 0, version 0)")
    return w, h


def raw_size(data: bytes) -> tuple[int, int]:
    """(width, height) of an "npy-uint8" member; ValueError unless a complete NPY uint8 [H, W, 3] array."""
    from dit_pipeline.shards.npy import decode_raw

    a = decode_raw(data)
    if a.dtype.str != _RAW_DESCR or a.ndim != 3 or a.shape[2] != 3:
        raise ValueError(f"not an NPY uint8 [H, W, 3] array (dtype {a.dtype.str}, shape {list(a.shape)})")
    return int(a.shape[1]), int(a.shape[0])


def header_problem(data: bytes, image_size: int | None, encoding: str = ENCODING) -> str | None:
    """What is wrong with a pixels member's header (None when it is a complete RGB lossless WebP, or NPY uint8
    array, of image_size x image_size); reads the header and the member's length only."""
    try:
        w, h = raw_size(data) if member_of(encoding) == PIXELS_RAW_FIELD else pixels_size(data)
    except ValueError as e:
        return str(e)
    if image_size is not None and (w, h) != (image_size, image_size):
        return f"{'crop' if encoding != ENCODING else 'WebP'} is {w}x{h}, the manifest says {image_size}x{image_size}"
    return None


def decode_pixels(data: bytes, image_size: int | None, encoding: str = ENCODING) -> np.ndarray:
    """A pixels member -> uint8 [H, W, 3] (C-contiguous; writable for WebP, a read-only view of the bytes for
    "npy-uint8"), the crop exactly as the VAE encoded it; ValueError naming the problem (not lossless WebP, wrong
    size or mode, corrupt data). With image_size None any size is accepted."""
    from PIL import Image, ImageFile

    if member_of(encoding) == PIXELS_RAW_FIELD:
        problem = header_problem(data, image_size, encoding)
        if problem:
            raise ValueError(problem)
        from dit_pipeline.shards.npy import decode_raw

        return decode_raw(data)
    problem = header_problem(data, image_size) or codec_problem()
    if problem:
        raise ValueError(problem)
    try:
        with Image.open(io.BytesIO(bytes(data)), formats=["WEBP"]) as im:
            if ImageFile.LOAD_TRUNCATED_IMAGES:  # a process-wide Pillow switch that would hide damage
                raise ValueError("PIL.ImageFile.LOAD_TRUNCATED_IMAGES is set; refusing to decode (damaged "
                                 "pixels would pass as valid)")
            im.load()
            if im.mode != MODE:
                raise ValueError(f"WebP decodes to mode {im.mode}, not {MODE}")
            out = np.array(im, dtype=np.uint8)
    except ValueError:
        raise
    except Exception as e:  # Pillow raises OSError, SyntaxError, ... for damaged data
        raise ValueError(f"WebP data does not decode ({type(e).__name__}: {e})") from None
    if out.shape != (*pixels_size(data)[::-1], 3):
        raise ValueError(f"WebP decodes to shape {list(out.shape)}")
    return out


def view_pixels(pixels: np.ndarray, view: int) -> np.ndarray:
    """The pixels of latent view `view`: view 0 is the stored crop, view 1 its left-right mirror (what
    dit-extract encodes as the second view of a flipped set). A view of `pixels`, not a copy."""
    if view == 0:
        return pixels
    if view == 1:
        return pixels[:, ::-1]
    raise ValueError(f"view must be 0 or 1, got {view}")


def pixels_entry(image_size: int, total_bytes: int, encoding: str = ENCODING) -> dict[str, Any]:
    """The manifest's `pixels` object of a set whose pixels members add up to `total_bytes` bytes."""
    return {"member": member_of(encoding), "encoding": encoding, "mode": MODE, "size": [image_size, image_size],
            "bytes": int(total_bytes)}


def pixels_entry_problems(entry: Any, image_size: Any) -> list[str]:
    """Every problem with a manifest's `pixels` object (empty when valid)."""
    if not isinstance(entry, dict):
        return [f"pixels must be an object, got {type(entry).__name__}"]
    want = ("member", "encoding", "mode", "size", "bytes")
    missing = [k for k in want if k not in entry]
    if missing:
        return [f"pixels lacks {', '.join(missing)}"]
    out = []
    if entry["encoding"] not in ENCODINGS:
        out.append(f"pixels.encoding must be one of {', '.join(map(repr, ENCODINGS))}, got {entry['encoding']!r}")
    wanted = (("member", ENCODINGS[entry["encoding"]]),) if entry["encoding"] in ENCODINGS else ()
    for k, v in (*wanted, ("mode", MODE)):
        if entry[k] != v:
            out.append(f"pixels.{k} must be {v!r}, got {entry[k]!r}")
    if entry["size"] != [image_size, image_size]:
        out.append(f"pixels.size must be [image_size, image_size] = {[image_size, image_size]}, got {entry['size']!r}")
    v = entry["bytes"]
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        out.append(f"pixels.bytes must be a non-negative integer, got {v!r}")
    return out


# ----------------------------------------------------------------------------------------------------------
# What a reader takes of the pixels (shards.iter_shard's `pixels` mode)

PIXELS_MODES = ("bytes", "decoded")
_PIXELS_SUFFIXES = ("." + PIXELS_FIELD, "." + PIXELS_RAW_FIELD)


def _not_pixels(name: str) -> bool:
    """TarReader's `want` of a reader that does not need the pixels: their bytes are skipped, not copied."""
    return not name.endswith(_PIXELS_SUFFIXES)


def pixels_filter(url: str, has_pixels: bool | None, mode: str | None) -> Callable[[str], bool] | None:
    """The member filter of iter_shard for pixels `mode` (`has_pixels`: what the manifest records, None without
    a manifest); ShardError when pixels are asked of a set without."""
    if mode is not None and mode not in PIXELS_MODES:
        raise ValueError(f"pixels must be one of {PIXELS_MODES} or None, got {mode!r}")
    if mode is not None and has_pixels is False:
        raise ShardError(url, None, "pixels were asked for, but the manifest records none (the set was extracted "
                         "without --pixels)")
    return _not_pixels if mode is None and has_pixels else None


def pixels_value(fields: dict[str, Any], image_size: int | None, mode: str | None,
                 encoding: str = ENCODING) -> bytes | np.ndarray | None:
    """A sample's pixels as `iter_shard(pixels=mode)` yields them: None, the member's bytes (header checked
    against the manifest: size, 8-bit RGB) or the decoded crop; ValueError naming the problem."""
    if mode is None:
        return None
    member = member_of(encoding)
    data = fields.get(member)
    if data is None:
        raise ValueError(f"no {member} member")
    try:
        if mode == "decoded":
            return decode_pixels(data, image_size, encoding)
        problem = header_problem(data, image_size, encoding)
        if problem:
            raise ValueError(problem)
    except ValueError as e:
        raise ValueError(f"{member}: {e}") from None
    return bytes(data)
