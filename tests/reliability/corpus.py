"""The bad-input corpus, generated (nothing is stored): odd image files, hostile shard tars, malformed
manifests and hostile checkpoint files. Each generator returns {case: (maker, expected)} so the tests can
parametrize over it; every hostile payload that would run code when unpickled touches a marker file
instead, so "never unpickled" is checked by the marker's absence, and every path-like member name points
into a folder the test watches.

Shard sets come from tests/shards/_helpers.make_set (8 samples, keys 0..7, 4 per shard, 3 classes, float16,
[2, 4, 4, 4] arrays); the hostile content goes into shard-000001.tar and its manifest record is refreshed
(size, sha256), so only the planted problem is left for the checks to find.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import struct
import tarfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image, PngImagePlugin

from tests._util import draw_image
from tests.shards._helpers import arrays_for, npy, read_members, refresh_record, write_tar

S1 = "shard-000001.tar"


class Payload:
    """Unpickling this runs `touch <marker>` (os.system): the proof that something was unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ----------------------------------------------------------------------------------------------------------
# Images: beyond tests/extract/conftest.odd_files (CMYK, gray, palette, RGBA, 16-bit, PNG named .JPEG,
# truncated, zero bytes, garbage, two bombs), which the tests use too.

def _png(img: Image.Image, **kw) -> bytes:
    b = io.BytesIO()
    img.save(b, "PNG", **kw)
    return b.getvalue()


def _encoded(img: Image.Image, fmt: str, **kw) -> bytes:
    b = io.BytesIO()
    img.save(b, fmt, **kw)
    return b.getvalue()


def _gif_bomb() -> bytes:
    """A 60000 x 60000 GIF in a few bytes."""
    size = struct.pack("<HH", 60000, 60000)
    return b"GIF89a" + size + b"\x00\x00\x00" + b",\x00\x00\x00\x00" + size + b"\x00\x02\x02\x44\x01\x00;"


def more_odd_images(root: Path) -> dict[str, str | None]:
    """Write more odd files into root/e_more/; returns relative path -> None (usable, becomes RGB) or the
    fragment of its skip reason."""
    d = root / "e_more"
    d.mkdir(parents=True, exist_ok=True)
    rgb = draw_image(4, 2, (50, 40))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation "rotate 90": like ImageFolder, not applied
    big_text = PngImagePlugin.PngInfo()
    big_text.add_text("comment", "x" * (2 << 20), zip=True)  # over PIL's MAX_TEXT_CHUNK
    png = bytearray(_png(rgb))
    png[png.find(b"IDAT") + 10] ^= 0xFF
    frames = [draw_image(i, 0, (30, 30)).convert("P") for i in range(3)]
    anim = io.BytesIO()
    frames[0].save(anim, "GIF", save_all=True, append_images=frames[1:])
    files: dict[str, tuple[bytes, str | None]] = {
        "exif_rotated.jpg": (_encoded(rgb, "JPEG", exif=exif.tobytes()), None),
        "one_pixel.png": (_png(rgb.resize((1, 1))), None),
        "panorama.png": (_png(rgb.resize((1000, 3))), None),
        "progressive.jpg": (_encoded(rgb, "JPEG", progressive=True), None),
        "gray_alpha.png": (_png(rgb.convert("LA")), None),
        "bilevel.png": (_png(rgb.convert("1")), None),
        "cmyk.tiff": (_encoded(rgb.convert("CMYK"), "TIFF"), None),
        "int32.tiff": (_encoded(Image.fromarray((np.arange(600).reshape(20, 30) * 99).astype(np.int32), "I"),
                                "TIFF"), None),
        "animated_gif.png": (anim.getvalue(), None),     # GIF data: .gif is no ImageFolder extension
        "image.webp": (_encoded(rgb, "WEBP"), None),
        "image.bmp": (_encoded(rgb, "BMP"), None),
        "image.ppm": (_encoded(rgb, "PPM"), None),
        "trailing_junk.jpg": (_encoded(rgb, "JPEG") + bytes(range(256)) * 20, None),
        "text_bomb.png": (_png(rgb, pnginfo=big_text), "malformed image header"),
        "bad_crc.png": (bytes(png), "corrupt or truncated PNG data"),
        "gif_bomb.webp": (_gif_bomb(), "decompression bomb"),
        "error_page.jpg": (b"<html><body>404 Not Found</body></html>", "not a decodable image"),
    }
    out: dict[str, str | None] = {}
    for name, (data, reason) in files.items():
        (d / name).write_bytes(data)
        out[f"e_more/{name}"] = reason
    os.mkfifo(d / "fifo.png")                          # reading it would block forever
    os.symlink("/dev/zero", d / "endless.png")         # reading it would never end
    os.symlink(d / "no-such-file.png", d / "dangling.png")
    os.symlink(d / "image.bmp", d / "link_to_image.jpeg")
    out.update({"e_more/fifo.png": "not a regular file (a FIFO)",
                "e_more/endless.png": "not a regular file (a character device)",
                "e_more/dangling.png": "cannot read the file: No such file or directory",
                "e_more/link_to_image.jpeg": None})
    return out


# ----------------------------------------------------------------------------------------------------------
# Hostile shards: each maker edits FOLDER/shard-000001.tar (keys 4..7) and refreshes its record.

def _info(name: str, kind: bytes, **kw: Any) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    for k, v in kw.items():
        setattr(info, k, v)
    return info


def _raw_header(name: str, size_field: bytes) -> bytes:
    """A ustar header for `name` whose 12-byte size field is `size_field` (checksum fixed up)."""
    h = bytearray(tarfile.TarInfo(name).tobuf(tarfile.USTAR_FORMAT))
    h[124:136] = size_field
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def _append(members: list) -> Callable[[Path, Path], None]:
    def make(folder: Path, marker: Path) -> None:
        write_tar(folder / S1, read_members(folder / S1) + [m(marker) if callable(m) else m for m in members])
        refresh_record(folder, S1)
    return make


def _rewrite(edit: Callable[[bytes, Path], bytes]) -> Callable[[Path, Path], None]:
    def make(folder: Path, marker: Path) -> None:
        (folder / S1).write_bytes(edit((folder / S1).read_bytes(), marker))
        refresh_record(folder, S1)
    return make


def _replace_member(member: str, data: Callable[[Path], bytes]) -> Callable[[Path, Path], None]:
    def make(folder: Path, marker: Path) -> None:
        write_tar(folder / S1, [(n, data(marker) if n == member else d) for n, d in read_members(folder / S1)])
        refresh_record(folder, S1)
    return make


def _members_only(data: bytes) -> bytes:
    """A shard's bytes without its end-of-archive blocks and record padding (all zeros after the last member;
    the last member's own zero padding is restored)."""
    body = data.rstrip(b"\0")
    return body + bytes(-len(body) % 512)


def _extra_member(name: str, size_field: bytes) -> Callable[[bytes, Path], bytes]:
    def edit(data: bytes, marker: Path) -> bytes:
        return _members_only(data) + _raw_header(name, size_field) + b"0" * 512 + bytes(1024)
    return edit


def _sample(key: int, **changes: Any) -> list[tuple[str, bytes]]:
    arrays = arrays_for(key)
    fields = {"cls": str(changes.pop("label", key % 3)).encode(), "json": b"{}",
              "mean.npy": npy(changes.pop("mean", arrays["mean"].astype(np.float16))),
              "std.npy": npy(arrays["std"].astype(np.float16))}
    return [(f"{key:09d}.{f}", fields[f]) for f in sorted(fields)]


def _with_sample(sample: list) -> Callable[[Path, Path], None]:
    """Shard 1 with its last sample (key 7) replaced by `sample`."""
    def make(folder: Path, marker: Path) -> None:
        members = [(n, d) for n, d in read_members(folder / S1) if not n.startswith("000000007.")]
        write_tar(folder / S1, members + sample)
        refresh_record(folder, S1)
    return make


def _copy_of_shard_0(folder: Path, marker: Path) -> None:
    """shard-000000.tar copied over shard-000001.tar (both 4 samples: the same size), record untouched."""
    (folder / S1).write_bytes((folder / "shard-000000.tar").read_bytes())


def hostile_shards() -> dict[str, tuple[Callable[[Path, Path], None], str]]:
    """case -> (maker(folder, marker), fragment of the problem reported for shard-000001.tar)."""
    pickled = lambda marker: pickle.dumps(Payload(marker))  # noqa: E731
    nan = arrays_for(7)["mean"].astype(np.float16)
    nan[0, 0, 0, 0] = np.nan
    return {
        "path_traversal": (_append([("../../escaped.cls", b"0")]), "unsafe member name '../../escaped.cls'"),
        "absolute_path": (_append([("/tmp/escaped.cls", b"0")]), "unsafe member name '/tmp/escaped.cls'"),
        "control_chars": (_append([("000000008\n.cls", b"0")]), "control or non-ASCII characters"),
        "symlink": (_append([(_info("000000008.cls", tarfile.SYMTYPE, linkname="/etc/passwd"), None)]),
                    "symbolic link member"),
        "hardlink": (_append([(_info("000000008.cls", tarfile.LNKTYPE, linkname="000000004.cls"), None)]),
                     "hard link member"),
        "char_device": (_append([(_info("000000008.cls", tarfile.CHRTYPE, devmajor=1, devminor=3), None)]),
                        "character device member"),
        "fifo": (_append([(_info("000000008.cls", tarfile.FIFOTYPE), None)]), "FIFO member"),
        "directory": (_append([(_info("000000008", tarfile.DIRTYPE), None)]), "directory member"),
        "pickle_pyd": (_append([lambda m: ("000000008.pyd", pickled(m))]), "pickle payload member"),
        "pickle_pth": (_append([lambda m: ("000000008.pth", pickled(m))]), "pickle payload member"),
        "pickle_in_npy": (_replace_member("000000005.mean.npy", lambda m: npy(np.array([Payload(m)], object))),
                          "pickle payload (NPY array of Python objects"),
        "giant_member": (_rewrite(_extra_member("000000008.cls", b"77777777777\0")), "huge member"),   # 8 GiB
        "giant_base256": (_rewrite(_extra_member("000000008.cls", b"\x80" + (1 << 40).to_bytes(11, "big"))),
                          "base-256"),
        "gzip_shard": (_rewrite(lambda data, m: gzip.compress(data, mtime=0)), "gzip-compressed"),
        "trailing_data": (_rewrite(lambda data, m: data + b"junk"), "non-zero data after the end-of-archive"),
        "no_end_marker": (_rewrite(lambda data, m: _members_only(data)), "truncated"),
        "nan_latent": (_with_sample(_sample(7, mean=nan)), "mean.npy holds NaN or Inf"),
        "label_out_of_range": (_with_sample(_sample(7, label=7)), "label 7 out of range [0, 3)"),
        "wrong_shape": (_with_sample(_sample(7, mean=arrays_for(7)["mean"][:, :2].astype(np.float16))),
                        "has shape [2, 2, 4, 4], the manifest says [2, 4, 4, 4]"),
        "wrong_dtype": (_with_sample(_sample(7, mean=arrays_for(7)["mean"])), "has dtype <f4"),
        "duplicate_sample": (_append(_sample(7)), "duplicate member '000000007.cls'"),
        "keys_out_of_order": (_with_sample(_sample(5)), "keys repeat or are out of order"),
        "copy_of_another_shard": (_copy_of_shard_0, "outside"),   # same size: only its keys tell
    }


# ----------------------------------------------------------------------------------------------------------
# Manifests: each maker turns the valid manifest text into a damaged one.

def _json_edit(edit: Callable[[dict], None]) -> Callable[[str], str]:
    def make(text: str) -> str:
        d = json.loads(text)
        edit(d)
        return json.dumps(d, indent=2)
    return make


def _set(path: str, value: Any) -> Callable[[str], str]:
    def edit(d: dict) -> None:
        *parents, last = path.split(".")
        for p in parents:
            d = d[int(p)] if isinstance(d, list) else d[p]
        if value is _DELETE:
            del d[last]
        elif isinstance(d, list):
            d[int(last)] = value
        else:
            d[last] = value
    return _json_edit(edit)


_DELETE = object()


def malformed_manifests() -> dict[str, tuple[Callable[[str], str | bytes], str]]:
    """case -> (maker(valid text) -> damaged text or bytes, fragment of the error)."""
    return {
        "empty": (lambda t: "", "invalid JSON"),
        "truncated": (lambda t: t[: len(t) // 2], "invalid JSON"),
        "not_utf8": (lambda t: b"\xff\xfe" + t.encode("utf-16-le"), "cannot read the manifest"),
        "utf8_bom": (lambda t: "\ufeff" + t, "invalid JSON"),
        "deep_nesting": (lambda t: "[" * 100_000 + "]" * 100_000, "JSON nested too deeply"),
        "top_level_array": (lambda t: "[]", "not a JSON object"),
        "version_unknown": (_set("format_version", 99), "unsupported format_version 99"),
        "version_string": (_set("format_version", "1"), "unsupported format_version '1'"),
        "missing_shards": (_set("shards", _DELETE), "missing field(s): shards"),
        "missing_scaling": (_set("scaling_factor", _DELETE), "missing field(s): scaling_factor"),
        "wrong_type": (_set("total_samples", "8"), "total_samples must be int"),
        "nan_scaling": (lambda t: t.replace('"scaling_factor": 0.5', '"scaling_factor": NaN'),
                        "scaling_factor must be finite"),
        "unknown_store": (_set("store", "pickle"), "store must be one of"),
        "unknown_dtype": (_set("dtype", "float64"), "dtype must be one of"),
        "latent_shape": (_set("latent_shape", [4, 4]), "latent_shape must be 3 positive integers"),
        "class_count": (_set("num_classes", 5), "class_names must be 5 strings"),
        "total_mismatch": (_set("total_samples", 9), "total_samples is 9 but the shard records add up to 8"),
        "negative_count": (_set("shards.0.samples", -1), "samples must be a non-negative integer"),
        "name_traversal": (_set("shards.0.name", "../shard-000000.tar"), "is not of the form shard-000000.tar"),
        "duplicate_name": (_set("shards.1.name", "shard-000000.tar"), "a shard name is listed twice"),
        "bad_sha256": (_set("shards.0.sha256", "0" * 63 + "g"), "sha256 must be 64 lowercase hex digits"),
        "record_not_object": (_set("shards.0", "shard-000000.tar"), "shard record is not an object"),
    }


# ----------------------------------------------------------------------------------------------------------
# Checkpoints: each maker writes a hostile or damaged weight file given a valid checkpoint's path.

def _truncate(frac: float) -> Callable[[Path, Path, Path], None]:
    def make(good: Path, out: Path, marker: Path) -> None:
        data = good.read_bytes()
        out.write_bytes(data[: int(len(data) * frac)])
    return make


def _flip(at: float) -> Callable[[Path, Path, Path], None]:
    def make(good: Path, out: Path, marker: Path) -> None:
        data = bytearray(good.read_bytes())
        data[int(len(data) * at)] ^= 0x04
        out.write_bytes(bytes(data))
    return make


def _edited(edit: Callable[[dict, Path], Any], legacy: bool = False) -> Callable[[Path, Path, Path], None]:
    def make(good: Path, out: Path, marker: Path) -> None:
        ckpt = torch.load(good, map_location="cpu", weights_only=True)
        torch.save(edit(ckpt, marker), out, _use_new_zipfile_serialization=not legacy)
    return make


def _other_model(ckpt: dict, marker: Path) -> dict:
    """The same checkpoint for a model of depth 3 (an extra block: shapes fit, the architecture does not)."""
    for part in ("model", "ema"):
        extra = {k.replace("blocks.1.", "blocks.2."): v.clone() for k, v in ckpt[part].items() if "blocks.1." in k}
        ckpt[part] = {**ckpt[part], **extra}
    ckpt["model_config"] = {**ckpt["model_config"], "depth": 3}
    return ckpt


def hostile_checkpoints() -> dict[str, tuple[Callable[[Path, Path, Path], None], str]]:
    """case -> (maker(good, out, marker), fragment of the error (both dit-train --resume and dit-sample))."""
    def zip_of_text(good: Path, out: Path, marker: Path) -> None:
        import zipfile
        with zipfile.ZipFile(out, "w") as z:
            z.writestr("archive/data.pkl", "not a pickle")

    return {
        "empty_file": (lambda g, o, m: o.write_bytes(b""), "corrupt"),
        "random_bytes": (lambda g, o, m: o.write_bytes(bytes(range(256)) * 64), "corrupt"),
        "truncated_1pct": (_truncate(0.01), "corrupt"),
        "truncated_half": (_truncate(0.5), "corrupt"),
        "truncated_last_byte": (_truncate(1 - 1e-9), "corrupt"),
        "bit_flip_tensor": (_flip(0.6), "CRC-32"),
        "bit_flip_late": (_flip(0.9), "CRC-32"),
        "zip_not_torch": (zip_of_text, "corrupt"),
        "pickled_code": (_edited(lambda c, m: {**c, "hook": Payload(m)}), "corrupt"),
        "pickled_code_legacy": (_edited(lambda c, m: {**c, "hook": Payload(m)}, legacy=True), "corrupt"),
        "raw_pickle": (lambda g, o, m: o.write_bytes(pickle.dumps({"ema": Payload(m)})), "corrupt"),
        "other_model": (_edited(_other_model), "depth"),
        "version_2": (_edited(lambda c, m: {**c, "version": 2}), "version 2"),
    }
