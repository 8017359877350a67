"""Fixtures for the extract tests: an image tree with every odd file RELIABILITY.md names, and helpers."""
from __future__ import annotations

import hashlib
import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests._util import draw_image

# Declared sizes of the two bomb files: far above PIL's limit (refused by PIL at open) and just above it
# (PIL only warns; we refuse).
HUGE = (100_000, 100_000)
JUST_ABOVE = (10_000, 9_000)


def bomb_png(size: tuple[int, int]) -> bytes:
    """A tiny PNG whose header declares an enormous RGB image (a decompression bomb)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", size[0], size[1], 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))


def _jpeg_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=95)
    return buf.getvalue()


def _png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def odd_files() -> dict[str, bytes]:
    """Relative path -> bytes of every odd image kind (usable ones and unusable ones)."""
    rgb = draw_image(1, 7, (52, 44))
    palette = draw_image(2, 3, (40, 56)).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    palette.info["transparency"] = 0
    sixteen = Image.fromarray((np.arange(48 * 40, dtype=np.uint16).reshape(40, 48) * 34))
    good_jpeg = _jpeg_bytes(draw_image(3, 1, (64, 48)))
    return {
        "b_odd/cmyk.JPEG": _jpeg_bytes(rgb.convert("CMYK")),
        "b_odd/gray.JPEG": _jpeg_bytes(rgb.convert("L")),
        "b_odd/palette.png": _png_bytes(palette),
        "b_odd/rgba.png": _png_bytes(draw_image(2, 5, (44, 40)).convert("RGBA")),
        "b_odd/sixteen.PNG": _png_bytes(sixteen),
        "b_odd/png_named.JPEG": _png_bytes(draw_image(2, 9, (40, 40))),
        "d_bad/truncated.JPEG": good_jpeg[: len(good_jpeg) // 2],
        "d_bad/zero.jpg": b"",
        "d_bad/garbage.jpeg": bytes(np.random.default_rng(0).integers(0, 256, 600, dtype=np.uint8)),
        "d_bad/bomb.png": bomb_png(HUGE),
        "d_bad/bomb_just_above.png": bomb_png(JUST_ABOVE),
        "d_bad/good.JPEG": good_jpeg,
    }


UNUSABLE = {"d_bad/truncated.JPEG": "corrupt or truncated", "d_bad/zero.jpg": "empty file (0 bytes)",
            "d_bad/garbage.jpeg": "not a decodable image", "d_bad/bomb.png": "decompression bomb",
            "d_bad/bomb_just_above.png": "decompression bomb"}


def make_odd_tree(root: Path) -> Path:
    """Classes a_plain (3 JPEGs), b_odd (odd but usable), c_empty (no images), d_bad (unusable + one good),
    plus junk and hidden entries that must be ignored."""
    (root / "a_plain" / "nested").mkdir(parents=True)
    for i in range(2):
        draw_image(0, i, (48, 40)).save(root / "a_plain" / f"img{i}.JPEG", quality=95)
    draw_image(0, 5, (40, 64)).save(root / "a_plain" / "nested" / "deep.jpg", quality=95)
    (root / "c_empty").mkdir()
    (root / "c_empty" / "notes.txt").write_text("not an image")
    for rel, data in odd_files().items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / "a_plain" / "README").write_text("junk without extension")
    (root / "a_plain" / "labels.csv").write_text("junk")
    (root / "a_plain" / ".hidden.JPEG").write_bytes(_jpeg_bytes(draw_image(0, 9)))
    (root / "b_odd" / "._cmyk.JPEG").write_bytes(b"\0\5\x16\7 AppleDouble resource fork")
    (root / ".ipynb_checkpoints").mkdir()
    (root / ".ipynb_checkpoints" / "x.JPEG").write_bytes(_jpeg_bytes(draw_image(0, 1)))
    (root / "stray.txt").write_text("a file next to the class folders")
    return root


def shard_hashes(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("shard-*.tar"))}


@pytest.fixture(scope="session")
def odd_tree(tmp_path_factory) -> Path:
    return make_odd_tree(tmp_path_factory.mktemp("odd") / "images")


# The settings every end-to-end test uses (tiny VAE: 32 px crops -> [4, 4, 4] latents). The odd tree has an
# empty class folder (c_empty), refused by default: its tests keep its label, as ImageFolder(allow_empty=True).
BASE = dict(image_size=32, batch_size=3, samples_per_shard=4, num_workers=0, quiet=True, keep_empty_classes=True)


def cli_args(data: Path, vae: Path, out: Path, **overrides) -> list[str]:
    """The dit-extract argv for BASE (+ overrides; True flags become bare flags)."""
    args = ["--data-path", str(data), "--out", str(out), "--vae", str(vae)]
    for k, v in {**BASE, **overrides}.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            args.append(flag)
        elif v is not False and v is not None:
            args += [flag, str(v)]
    return args


def extract(data: Path, vae: Path, out: Path, **overrides):
    """Run the extraction in this process with BASE settings (+ overrides); returns the summary."""
    from dit_pipeline.extract import ExtractConfig, run_extract

    return run_extract(ExtractConfig(data_path=str(data), out=str(out), vae=str(vae), **{**BASE, **overrides}))


def read_samples(out: Path) -> dict:
    """key -> LatentSample over the whole shard set, read through the shards API (checked on the way)."""
    from dit_pipeline.shards import iter_shard, read_manifest

    manifest = read_manifest(out)
    samples = {}
    for url in manifest.shard_urls(str(out)):
        for s in iter_shard(url, manifest, with_meta=True):
            assert s.key not in samples
            samples[s.key] = s
    return samples


@pytest.fixture(scope="session")
def odd_baseline(odd_tree, tiny_vae_dir, tmp_path_factory):
    """One uninterrupted single-process run over the odd tree: (out folder, summary, shard hashes)."""
    out = tmp_path_factory.mktemp("baseline") / "out"
    summary = extract(odd_tree, tiny_vae_dir, out)
    return out, summary, shard_hashes(out)


@pytest.fixture(scope="session")
def pixels_baseline(odd_tree, tiny_vae_dir, tmp_path_factory):
    """One uninterrupted single-process run with --pixels over the odd tree: (out folder, the encoder's inputs
    as (indices, x) per batch, shard hashes)."""
    from dit_pipeline.extract.encode import LatentEncoder

    out = tmp_path_factory.mktemp("pixels") / "out"
    seen = []
    real = LatentEncoder._outputs

    def spy(self, x, indices, precision):
        seen.append((list(indices), x.detach().clone()))
        return real(self, x, indices, precision)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LatentEncoder, "_outputs", spy)
        extract(odd_tree, tiny_vae_dir, out, pixels=True)
    return out, seen, shard_hashes(out)
