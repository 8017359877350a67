"""Decoding one image file to RGB and cropping it exactly like the reference (docs/REFERENCE.md).

ADM center crop (the preprocessing the published DiT latents were made with): while the short side is at
least twice the target size, halve both sides (floor) with a BOX filter; then resize with BICUBIC so the
short side equals the target (each side `round()`ed); then crop the centre with floor offsets. Pixels go
to [-1, 1] later, on the accelerator, as ToTensor then Normalize(0.5, 0.5) (see `encode.py`).

Odd files follow RELIABILITY.md: anything PIL decodes is converted to RGB (CMYK, grayscale, palette, alpha,
a PNG named .JPEG all as `Image.convert("RGB")`, like ImageFolder's loader; 16-bit grayscale is scaled to
8 bits instead of being clipped to white); anything it cannot decode (zero bytes, truncated, garbage, a
malformed header) raises `SkippedImage` with the reason, and so does a FIFO or device with an image name,
which is never opened (reading it would block or never end). Decompression bombs are refused from the
header, before any pixel is decoded.
"""
from __future__ import annotations

import io
import os
import stat
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

# PIL's own default limit (~89.5 megapixels, a 9459 x 9459 image); ImageNet's largest images are far below.
MAX_PIXELS = 89_478_485

_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


class SkippedImage(Exception):
    """An image file that cannot be used; `reason` says why (it goes into the manifest)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class ImageInfo:
    """What the sample's JSON metadata records about its source file."""

    width: int
    height: int
    mode: str
    format: str | None


def _special_file(path: str | os.PathLike) -> str | None:
    """What `path` is when it is not a regular file (a FIFO would block the reader forever, a device never
    ends); None for a regular file, or for one that cannot be stat'ed (opening it then says why)."""
    try:
        mode = os.stat(path).st_mode  # follows symlinks, like the open that would come next
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _open(path: str | os.PathLike | bytes) -> Image.Image:
    """`path` is a file, or the bytes of one (a member of a WebDataset tar, extract/webdataset.py)."""
    special = None if isinstance(path, bytes) else _special_file(path)
    if special is not None:
        raise SkippedImage(f"not a regular file ({special}), not read")
    try:
        with warnings.catch_warnings():
            # PIL only warns between 1x and 2x its pixel limit; a warning is a refusal here.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(path) if isinstance(path, bytes) else path)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise SkippedImage(f"decompression bomb, not decoded: {e}") from None
    except UnidentifiedImageError:
        size = _file_size(path)
        if size == 0:
            raise SkippedImage("empty file (0 bytes)") from None
        raise SkippedImage(f"not a decodable image ({size} bytes in no format PIL recognises)") from None
    except OSError as e:
        raise SkippedImage(f"cannot read the file: {e.strerror or e}") from None
    except Exception as e:  # a malformed header: PIL raises ValueError, SyntaxError, struct.error, ...
        raise SkippedImage(f"malformed image header: {type(e).__name__}: {e}") from None


def _file_size(path: str | os.PathLike | bytes) -> int:
    if isinstance(path, bytes):
        return len(path)
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def _to_rgb(im: Image.Image) -> Image.Image:
    if im.mode == "RGB":
        return im
    if im.mode in _SIXTEEN_BIT_MODES:
        # PIL's convert("RGB") clips 16-bit values at 255 (a white image); scale 0..65535 to 0..255 instead.
        wide = np.asarray(im).astype(np.int64)
        narrow = ((np.clip(wide, 0, 65535) + 128) // 257).astype(np.uint8)
        return Image.fromarray(narrow, "L").convert("RGB")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "palette images with transparency ..." is expected here
        return im.convert("RGB")


def load_rgb(path: str | os.PathLike | bytes, max_pixels: int = MAX_PIXELS) -> tuple[Image.Image, ImageInfo]:
    """Decode an image file to an RGB PIL image; SkippedImage if it is unusable."""
    im = _open(path)
    try:
        w, h = im.size
        info = ImageInfo(width=int(w), height=int(h), mode=str(im.mode), format=im.format)
        if w * h > max_pixels:
            raise SkippedImage(f"decompression bomb, not decoded: declares {w}x{h} = {w * h} pixels, more than "
                               f"the limit of {max_pixels}")
        if w < 1 or h < 1:
            raise SkippedImage(f"declares an empty size {w}x{h}")
        try:
            im.load()
            rgb = _to_rgb(im)
            rgb.load()
        except SkippedImage:
            raise
        except Exception as e:  # PIL raises many types for corrupt data (OSError, SyntaxError, ValueError...)
            raise SkippedImage(f"corrupt or truncated {im.format or 'image'} data: {type(e).__name__}: {e}") from None
    except BaseException:
        im.close()
        raise
    if rgb is not im:
        im.close()
    elif getattr(im, "fp", None) is not None:
        # Multi-frame formats keep the file open after load(); close() would also free the pixels.
        rgb = im.copy()
        im.close()
    return rgb, info


def adm_center_crop(image: Image.Image, size: int) -> np.ndarray:
    """The reference ADM center crop of an RGB image: uint8 array [size, size, 3]."""
    while min(image.size) >= 2 * size:
        image = image.resize((image.width // 2, image.height // 2), resample=Image.BOX)
    scale = size / min(image.size)
    image = image.resize((round(image.width * scale), round(image.height * scale)), resample=Image.BICUBIC)
    arr = np.asarray(image)
    top = (arr.shape[0] - size) // 2
    left = (arr.shape[1] - size) // 2
    return np.ascontiguousarray(arr[top:top + size, left:left + size])


def load_and_crop(path: str | os.PathLike | bytes, size: int, max_pixels: int = MAX_PIXELS) -> tuple[np.ndarray, ImageInfo]:
    """Decode + ADM crop one file: (uint8 [size, size, 3], info); SkippedImage if unusable."""
    rgb, info = load_rgb(path, max_pixels)
    return adm_center_crop(rgb, size), info
