"""The optional `pixels.png` field: the exact 8-bit RGB crop the VAE encoded, stored losslessly (docs/FORMAT.md).

REPA-style training (Yu et al. 2024, arXiv:2410.06940) aligns the model's hidden states with a frozen vision
teacher that sees the training image; the teacher's input must be the very crop the latents were made from.
A shard set extracted with `dit-extract --pixels` stores it once per sample (view 0, the crop as encoded; view
1 of a flipped set is its left-right mirror: `view_pixels`), as PNG (8-bit RGB, no interlace, no ancillary
chunks), the encoding bench/pixels.py picked (BENCHMARKS.md, "Pixels").

Cheap checks belong to the reader's hot path (`png_header_problem`: the IHDR chunk's size, bit depth and
colour type, read from the first 33 bytes); decoding belongs to the consumer that needs the array
(`decode_pixels`, called by loader workers, and by `dit-shards verify` for every member). A declared size other
than the manifest's is refused before any pixel is decoded, so a hostile member cannot make a reader
allocate more than one crop.
"""
from __future__ import annotations

import io
import struct
import zlib
from typing import Any

import numpy as np

from dit_pipeline.shards.format import PIXELS_FIELD
ENCODING = "png"
MODE = "RGB"
# zlib level of the writer: bench/pixels.py measured levels 1-9 side by side (BENCHMARKS.md, "Pixels").
PNG_COMPRESS_LEVEL = 6
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_IHDR = struct.Struct(">I4sIIBBBBB")  # length, type, width, height, bit depth, colour type, compression, filter, interlace
_HEADER_BYTES = len(_PNG_SIGNATURE) + _IHDR.size + 4  # + the IHDR chunk's CRC


def encode_pixels(pixels: np.ndarray) -> bytes:
    """uint8 [H, W, 3] -> PNG bytes. The same array gives the same bytes (fixed zlib level, no metadata,
    one library build: the zlib version is recorded with the extraction)."""
    from PIL import Image

    a = np.asarray(pixels)
    if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] != 3 or 0 in a.shape:
        raise ValueError(f"pixels must be a uint8 array [H, W, 3], got {a.dtype} {list(a.shape)}")
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(a), MODE).save(buf, "PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buf.getvalue()


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; ValueError if the header is not that of an 8-bit RGB,
    non-interlaced PNG (the only kind the format stores)."""
    head = bytes(data[:_HEADER_BYTES])
    if len(head) < _HEADER_BYTES or head[:8] != _PNG_SIGNATURE:
        raise ValueError(f"not a PNG ({len(data)} bytes, starting {bytes(data[:8])!r})")
    length, kind, w, h, depth, colour, compression, filt, interlace = _IHDR.unpack_from(head, 8)
    if kind != b"IHDR" or length != 13:
        raise ValueError("not a PNG (no IHDR chunk first)")
    if struct.unpack(">I", head[-4:])[0] != zlib.crc32(head[12:-4]):
        raise ValueError("PNG header (IHDR) fails its CRC")
    if (depth, colour) != (8, 2):
        raise ValueError(f"PNG is not 8-bit RGB (bit depth {depth}, colour type {colour}; the format stores "
                         "bit depth 8, colour type 2)")
    if (compression, filt, interlace) != (0, 0, 0):
        raise ValueError(f"PNG uses compression {compression}, filter {filt}, interlace {interlace} (the format "
                         "stores 0, 0, 0)")
    return w, h


def png_header_problem(data: bytes, image_size: int | None) -> str | None:
    """What is wrong with a pixels member's PNG header (None when it is 8-bit RGB of image_size x
    image_size); reads the first 33 bytes only."""
    try:
        w, h = png_size(data)
    except ValueError as e:
        return str(e)
    if image_size is not None and (w, h) != (image_size, image_size):
        return f"PNG is {w}x{h}, the manifest says {image_size}x{image_size}"
    return None


def decode_pixels(data: bytes, image_size: int | None) -> np.ndarray:
    """A pixels member -> uint8 [H, W, 3] (writable, C-contiguous), the crop exactly as the VAE encoded it;
    ValueError naming the problem (not a PNG, wrong size or mode, truncated or corrupt data). With
    image_size None any square or non-square size is accepted."""
    from PIL import Image, ImageFile

    problem = png_header_problem(data, image_size)
    if problem:
        raise ValueError(problem)
    try:
        with Image.open(io.BytesIO(bytes(data)), formats=["PNG"]) as im:
            if ImageFile.LOAD_TRUNCATED_IMAGES:  # a process-wide Pillow switch that would hide damage
                raise ValueError("PIL.ImageFile.LOAD_TRUNCATED_IMAGES is set; refusing to decode (damaged "
                                 "pixels would pass as valid)")
            im.load()
            if im.mode != MODE:
                raise ValueError(f"PNG decodes to mode {im.mode}, not {MODE}")
            out = np.array(im, dtype=np.uint8)
    except ValueError:
        raise
    except Exception as e:  # Pillow raises OSError, SyntaxError, zlib.error, ... for damaged data
        raise ValueError(f"PNG data does not decode ({type(e).__name__}: {e})") from None
    if out.shape != (*png_size(data)[::-1], 3):
        raise ValueError(f"PNG decodes to shape {list(out.shape)}")
    return out


def view_pixels(pixels: np.ndarray, view: int) -> np.ndarray:
    """The pixels of latent view `view`: view 0 is the stored crop, view 1 its left-right mirror (what
    dit-extract encodes as the second view of a flipped set). A view of `pixels`, not a copy."""
    if view == 0:
        return pixels
    if view == 1:
        return pixels[:, ::-1]
    raise ValueError(f"view must be 0 or 1, got {view}")


def pixels_entry(image_size: int, total_bytes: int) -> dict[str, Any]:
    """The manifest's `pixels` object of a set whose pixels members add up to `total_bytes` bytes."""
    return {"member": PIXELS_FIELD, "encoding": ENCODING, "mode": MODE, "size": [image_size, image_size],
            "bytes": int(total_bytes), "png_compress_level": PNG_COMPRESS_LEVEL}


def pixels_entry_problems(entry: Any, image_size: Any) -> list[str]:
    """Every problem with a manifest's `pixels` object (empty when valid)."""
    if not isinstance(entry, dict):
        return [f"pixels must be an object, got {type(entry).__name__}"]
    want = ("member", "encoding", "mode", "size", "bytes", "png_compress_level")
    missing = [k for k in want if k not in entry]
    if missing:
        return [f"pixels lacks {', '.join(missing)}"]
    out = []
    for k, v in (("member", PIXELS_FIELD), ("encoding", ENCODING), ("mode", MODE)):
        if entry[k] != v:
            out.append(f"pixels.{k} must be {v!r}, got {entry[k]!r}")
    if entry["size"] != [image_size, image_size]:
        out.append(f"pixels.size must be [image_size, image_size] = {[image_size, image_size]}, got {entry['size']!r}")
    for k in ("bytes", "png_compress_level"):
        v = entry[k]
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            out.append(f"pixels.{k} must be a non-negative integer, got {v!r}")
    return out
