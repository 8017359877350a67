"""Benchmark: how to store the 256 px training pixels beside the latents (issue #22, REPA's teacher input).

Part 1, encodings, side by side in one run on the same crops: bytes per sample, encode and decode cost per
sample (decode = encoded bytes -> uint8 [H, W, 3] numpy array, what a loader worker hands the teacher), and a
lossless round-trip check of every sample. Costs are CPU time of this one process (every codec here runs on
one thread), the fair measure on a shared machine; rounds are interleaved (every encoding once per round),
the median round is reported.

  npy           raw uint8 [H, W, 3] as NPY 1.0 (the shards' array format): 128-byte header + H*W*3 bytes
  ppm           binary PPM (P6) through Pillow
  png-L         PNG through Pillow at zlib compress_level L (0 = stored, 1 = fastest ... 9 = smallest)
  webp-mM-qQ    lossless WebP through Pillow (libwebp), method M and quality Q (both effort settings in
                lossless mode: 0 fastest ... 6 / 100 smallest; quality 100 with method 6 takes seconds per crop)

Part 2, the shard reader: a shard set written with `ShardWriter(pixels=...)` read back by `shards.iter_shard`
in this one process, samples/s without the pixels, with the encoded bytes, and with `shards.decode_pixels`.

Crops: the ADM center crop (extract.images.adm_center_crop, what dit-extract encodes) of
  synthetic  dead-leaves images (occluding disks of power-law sizes, the classic model of natural-image
             statistics: scale invariance, edges, flat regions) with 1/f texture, shading, sensor noise,
             saved as 500x375 JPEG quality 90 (ImageNet's typical size and compression), reproducible anywhere
  photos     every image file in --photos DIR: its center crop and the crops of its four corner windows of
             80% size when their short side is still >= the crop size (so no crop is upsampled)

    python bench/pixels.py                                      # synthetic crops only
    python bench/pixels.py --photos /tmp/photos --repeat 5 --json pixels.json
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_checkout  # noqa: E402

use_checkout()  # run from a checkout without installing

import numpy as np  # noqa: E402
from PIL import Image, features  # noqa: E402

from dit_pipeline.extract.images import adm_center_crop  # noqa: E402
from dit_pipeline.shards.npy import decode_raw, npy_header  # noqa: E402

IMAGENET_IMAGES = 1_281_167


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=256, help="crop size in pixels")
    p.add_argument("--synthetic", type=int, default=48, help="number of synthetic images")
    p.add_argument("--photos", default=None, help="folder of photographs (any format Pillow reads)")
    p.add_argument("--png-levels", type=int, nargs="+", default=[1, 3, 6, 9])
    p.add_argument("--webp", nargs="+", default=["0:50", "4:50", "6:50"], metavar="METHOD:QUALITY")
    p.add_argument("--repeat", type=int, default=3, help="interleaved rounds; the median is reported")
    p.add_argument("--reader-samples", type=int, default=600, help="samples in the reader part (0: skip it)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------- crops


def _one_over_f(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Gaussian noise with a 1/f amplitude spectrum (natural images' second-order statistics), unit std."""
    fy, fx = np.fft.fftfreq(h)[:, None], np.fft.rfftfreq(w)[None, :]
    f = np.sqrt(fx * fx + fy * fy)
    f[0, 0] = 1.0
    spec = (rng.standard_normal(f.shape) + 1j * rng.standard_normal(f.shape)) / f
    spec[0, 0] = 0
    out = np.fft.irfft2(spec, s=(h, w))
    return (out / out.std()).astype(np.float32)


def dead_leaves(rng: np.random.Generator, w: int = 500, h: int = 375) -> Image.Image:
    """One dead-leaves image (see the module docstring), as it would come out of a camera and a JPEG."""
    img = np.zeros((h, w, 3), np.float32)
    texture = _one_over_f(rng, h, w)
    shade = _one_over_f(rng, h, w)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    rmin, rmax = 3.0, 0.6 * min(w, h)
    # Radii with density ~ r^-3 (scale invariance), painted back to front so later disks occlude.
    u = rng.uniform(size=900)
    radii = 1.0 / np.sqrt(u / rmin ** 2 + (1 - u) / rmax ** 2)
    for r in np.sort(radii)[::-1]:
        cx, cy = rng.uniform(-r, w + r), rng.uniform(-r, h + r)
        x0, x1 = int(max(0, cx - r)), int(min(w, cx + r + 1))
        y0, y1 = int(max(0, cy - r)), int(min(h, cy + r + 1))
        if x0 >= x1 or y0 >= y1:
            continue
        inside = (xx[y0:y1, x0:x1] - cx) ** 2 + (yy[y0:y1, x0:x1] - cy) ** 2 <= r * r
        lum = rng.uniform(20, 235)
        tint = rng.normal(0, 25, 3)  # colour correlated across channels: mostly luminance, some hue
        amp = rng.uniform(2, 25)     # smooth surfaces and textured ones
        patch = lum + tint + amp * texture[y0:y1, x0:x1, None] + 12 * shade[y0:y1, x0:x1, None]
        img[y0:y1, x0:x1][inside] = patch[inside]
    img += rng.normal(0, 2.0, img.shape)  # sensor noise
    pil = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")
    buf = io.BytesIO()
    pil.save(buf, "JPEG", quality=90)
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


def synthetic_crops(n: int, size: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [adm_center_crop(dead_leaves(rng), size) for _ in range(n)]


def photo_crops(folder: Path, size: int) -> list[np.ndarray]:
    crops = []
    for path in sorted(folder.iterdir()):
        try:
            with Image.open(path) as im:
                rgb = im.convert("RGB")
        except OSError:
            continue
        crops.append(adm_center_crop(rgb, size))
        w, h = rgb.size
        cw, ch = int(0.8 * w), int(0.8 * h)
        if min(cw, ch) >= size:
            for left, top in ((0, 0), (w - cw, 0), (0, h - ch), (w - cw, h - ch)):
                crops.append(adm_center_crop(rgb.crop((left, top, left + cw, top + ch)), size))
    return crops


# ------------------------------------------------------------------------------------------- encodings


def _pil_codec(fmt: str, **params):
    def encode(a: np.ndarray) -> bytes:
        buf = io.BytesIO()
        Image.fromarray(a, "RGB").save(buf, fmt, **params)
        return buf.getvalue()

    def decode(data: bytes) -> np.ndarray:
        with Image.open(io.BytesIO(data)) as im:
            return np.asarray(im)
    return encode, decode


def _npy_codec():
    def encode(a: np.ndarray) -> bytes:
        return npy_header("|u1", a.shape) + np.ascontiguousarray(a).tobytes()

    return encode, decode_raw  # a read-only view of the member bytes: nothing to decode


def codecs(args: argparse.Namespace) -> dict:
    out = {"npy": _npy_codec(), "ppm": _pil_codec("PPM")}
    for level in args.png_levels:
        out[f"png-{level}"] = _pil_codec("PNG", compress_level=level)
    for spec in args.webp:
        method, quality = (int(v) for v in spec.split(":"))
        out[f"webp-m{method}-q{quality}"] = _pil_codec("WEBP", lossless=True, quality=quality, method=method)
    return out


def measure_codecs(crops: list[np.ndarray], table: dict, repeat: int) -> dict[str, dict]:
    """Per encoding: mean bytes per sample, median-round encode and decode ms per sample; lossless checked."""
    enc_t: dict[str, list[float]] = {k: [] for k in table}
    dec_t: dict[str, list[float]] = {k: [] for k in table}
    sizes: dict[str, list[int]] = {}
    for encode, decode in table.values():  # warm-up: library initialisation
        decode(encode(crops[0]))
    for _ in range(repeat):
        for name, (encode, decode) in table.items():
            t0 = time.process_time()
            blobs = [encode(a) for a in crops]
            enc_t[name].append((time.process_time() - t0) / len(crops))
            t0 = time.process_time()
            decoded = [decode(b) for b in blobs]
            dec_t[name].append((time.process_time() - t0) / len(crops))
            if not all(np.array_equal(d, a) for d, a in zip(decoded, crops)):
                raise AssertionError(f"{name} is not lossless")
            sizes[name] = [len(b) for b in blobs]
    return {k: {"bytes": float(np.mean(sizes[k])), "bytes_min": int(min(sizes[k])), "bytes_max": int(max(sizes[k])),
                "encode_ms": 1e3 * statistics.median(enc_t[k]), "decode_ms": 1e3 * statistics.median(dec_t[k])}
            for k in table}


def report_codecs(title: str, n: int, res: dict[str, dict], size: int) -> None:
    raw = 3 * size * size
    print(f"\n### {title}: {n} crops of {size}x{size}\n")
    print("| encoding | bytes/sample (mean) | min..max | x raw | encode CPU ms | decode CPU ms | ImageNet-1k pixels |")
    print("|---|---|---|---|---|---|---|")
    for k, r in res.items():
        gib = r["bytes"] * IMAGENET_IMAGES / 2 ** 30
        print(f"| {k} | {r['bytes']:,.0f} | {r['bytes_min']:,}..{r['bytes_max']:,} | {r['bytes'] / raw:.3f} | "
              f"{r['encode_ms']:.2f} | {r['decode_ms']:.3f} | {gib:,.0f} GiB |")


# ----------------------------------------------------------------------------------------- shard reader


def measure_reader(crops: list[np.ndarray], n: int, repeat: int) -> dict[str, float]:
    """samples/s of iter_shard over a 2-view posterior shard set with pixels: without, encoded, decoded."""
    from dit_pipeline.shards import (FORMAT_VERSION_PIXELS, Manifest, ShardWriter, decode_pixels, iter_shard, sample_key,
                                     shard_name, write_manifest)
    from dit_pipeline.shards.pixels import pixels_entry

    size = crops[0].shape[0]
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        records, pixel_bytes, per = [], 0, 200
        for s in range((n + per - 1) // per):
            with ShardWriter(folder / shard_name(s), dtype="float16", pixels=True) as w:
                for g in range(s * per, min(n, (s + 1) * per)):
                    mean = rng.standard_normal((2, 4, size // 8, size // 8), dtype=np.float32)
                    w.write(sample_key(g), label=g % 1000, meta={"path": f"n{g % 1000:08d}/{g}.JPEG"},
                            mean=mean, std=np.abs(mean) * 0.1 + 0.01, pixels=crops[g % len(crops)])
            records.append(w.close())
            pixel_bytes += w.pixel_bytes
        m = Manifest(format_version=FORMAT_VERSION_PIXELS, tool_version="bench", extraction={"vae": {}},
                     scaling_factor=0.18215, shift_factor=None, image_size=size, views=2, store="posterior",
                     dtype="float16", latent_shape=[4, size // 8, size // 8],
                     class_names=[f"n{i:08d}" for i in range(1000)], num_classes=1000, total_samples=n,
                     samples_per_shard=per, shards=records, skipped=[], pixels=pixels_entry(size, pixel_bytes))
        write_manifest(folder, m)
        urls = m.shard_urls(str(folder))

        def run(mode, decode):
            t0 = time.process_time()
            count = 0
            for u in urls:
                for smp in iter_shard(u, m, raw=True, pixels=mode):
                    if decode:  # what a loader worker does with the bytes
                        decode_pixels(smp.pixels, m.image_size)
                    count += 1
            assert count == n
            return n / (time.process_time() - t0)

        modes = {"latents only (pixels=None: pixels skipped)": (None, False),
                 "pixels=\"bytes\" (header checked, not decoded)": ("bytes", False),
                 "pixels=\"bytes\", then shards.decode_pixels": ("bytes", True),
                 "pixels=\"decoded\"": ("decoded", False)}
        rates: dict[str, list[float]] = {k: [] for k in modes}
        for mode, decode in modes.values():  # warm-up: page cache, imports, header caches
            run(mode, decode)
        for _ in range(repeat):
            for k, (mode, decode) in modes.items():
                rates[k].append(run(mode, decode))
        return {k: statistics.median(v) for k, v in rates.items()} | {"shard_bytes": m.total_bytes}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    table = codecs(args)
    env = {"python": platform.python_version(), "pillow": Image.__version__, "zlib": features.version("zlib"),
           "libwebp": features.version("webp"), "numpy": np.__version__, "machine": platform.machine()}
    env["load_average"] = [round(v, 2) for v in os.getloadavg()]
    print(f"bench/pixels.py: {env}")
    results: dict = {"env": env, "args": vars(args)}
    t0 = time.perf_counter()
    sets = {"synthetic (dead leaves, JPEG q90 500x375)": synthetic_crops(args.synthetic, args.size)}
    if args.photos:
        sets[f"photos ({args.photos})"] = photo_crops(Path(args.photos), args.size)
    print(f"crops made in {time.perf_counter() - t0:.1f} s")
    for title, crops in sets.items():
        res = measure_codecs(crops, table, args.repeat)
        report_codecs(title, len(crops), res, args.size)
        results[title] = {"crops": len(crops), "codecs": res}
    if args.reader_samples:
        crops = [c for cs in sets.values() for c in cs]
        rates = measure_reader(crops, args.reader_samples, args.repeat)
        print(f"\n### shards.iter_shard, one process, {args.reader_samples} samples "
              f"({rates['shard_bytes'] / args.reader_samples / 1024:.1f} KiB/sample on disk)\n")
        print("| read | samples per CPU-second |\n|---|---|")
        for k, v in rates.items():
            if k != "shard_bytes":
                print(f"| {k} | {v:,.0f} |")
        results["reader"] = rates
    results["load_average_after"] = [round(v, 2) for v in os.getloadavg()]
    print(f"\nload average after: {results['load_average_after']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
