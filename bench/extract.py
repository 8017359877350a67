"""Benchmark: `dit-extract` beside a one-image-at-a-time fp32 baseline, on the same images, in one run.

Both use the real SD-VAE architecture (common.vae.build_sd_vae: KL-f8, ~84M parameters, random weights,
which cost exactly what the released weights cost) on the same ImageNet-like JPEGs (500x375, quality 90):

  baseline   the fast-DiT approach, written here from its description: for each image decode, ADM crop,
             ToTensor/Normalize, encode ONE view (a random flip) with batch size 1 in fp32, take a posterior
             sample times scaling_factor, .cpu(), np.save one .npy for the latent and one for the label
  pipeline   run_extract: DataLoader decode workers, batched channels_last encode of BOTH views under the
             chosen precision, pinned non-blocking copies, posterior mean + std into tar shards, manifest,
             quick verify (timed end to end, including loading the VAE from disk)
  decode     decode + ADM crop alone in one process: the throughput of ONE DataLoader worker

It reports images/s of each and the ratio (the pipeline does twice the encoder work per image: 2 views).
With --precision-compare it also measures, on the same crops, the error of fp32/bf16/fp16 autocast against
a float64 encode, and their encode throughput (the basis of the GPU default precision).

    python bench/extract.py                                   # CPU: 6 images at 256 px, small and slow
    python bench/extract.py --precision-compare --compare-size 64
    python bench/extract.py --images 2048 --num-workers 16 --precision-compare    # on a GPU machine

The device is this process's GPU when there is one (as for dit-extract), else the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_checkout  # noqa: E402

use_checkout()  # run from a checkout without installing

from dit_pipeline.common.vae import build_sd_vae  # noqa: E402
from dit_pipeline.extract.images import adm_center_crop, load_and_crop  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=None, help="images in the test tree [6 on CPU, 2048 on GPU]")
    p.add_argument("--image-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=None, help="pipeline batch [4 on CPU, 64 on GPU]")
    p.add_argument("--num-workers", type=int, default=None, help="pipeline decode workers [auto]")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--baseline-images", type=int, default=None,
                   help="images for the slow baseline (rate measured on the first N) [all on CPU, 256 on GPU]")
    p.add_argument("--decode-images", type=int, default=64, help="images for the per-worker decode rate")
    p.add_argument("--precision-compare", action="store_true", help="also compare fp32 / bf16 / fp16")
    p.add_argument("--compare-size", type=int, default=None, help="crop size for --precision-compare [image-size]")
    p.add_argument("--compare-batch", type=int, default=None, help="batch for --precision-compare [4 CPU, 64 GPU]")
    p.add_argument("--repeat", type=int, default=1,
                   help="run baseline and pipeline this many times, interleaved; report medians")
    p.add_argument("--workdir", default=None, help="keep the images, VAE and outputs here (default: temp)")
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args(argv)


def natural_image(rng: np.random.Generator, w: int = 500, h: int = 375) -> Image.Image:
    """A JPEG-compressible image with ImageNet-like statistics (smooth shapes + texture + noise)."""
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.zeros((h, w, 3), np.float32)
    for _ in range(6):
        cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(30, 200)
        img += rng.uniform(-90, 90, 3) * np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * r * r))[..., None]
    img += 128 + 20 * np.sin(xx / rng.uniform(3, 12))[..., None] + rng.normal(0, 6, (h, w, 3))
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")


def make_tree(root: Path, n: int, classes: int = 4) -> list[tuple[Path, int]]:
    rng = np.random.default_rng(0)
    items = []
    for i in range(n):
        d = root / f"n{i % classes:08d}"
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"img_{i:06d}.JPEG"
        if not path.exists():
            natural_image(rng).save(path, "JPEG", quality=90)
        items.append((path, i % classes))
    return sorted(items)


def bench_decode(items: list[tuple[Path, int]], size: int) -> float:
    """Decode + ADM crop images/s in this one process (= one DataLoader worker)."""
    load_and_crop(items[0][0], size)  # warm the decoder
    t = time.perf_counter()
    for path, _ in items:
        load_and_crop(path, size)
    return len(items) / (time.perf_counter() - t)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_baseline(items, vae, device: torch.device, size: int, out: Path) -> float:
    """One image at a time, fp32, one .npy per image (latent) + one per label: images/s."""
    out.mkdir(parents=True, exist_ok=True)
    scale = float(vae.config.scaling_factor)
    rng = np.random.default_rng(0)
    vae = vae.to(device).eval()

    def one(i: int, path: Path, label: int) -> None:
        crop = adm_center_crop(Image.open(path).convert("RGB"), size)
        if rng.random() < 0.5:
            crop = np.ascontiguousarray(crop[:, ::-1])
        x = torch.from_numpy(crop).permute(2, 0, 1).float().div(255).sub(0.5).div(0.5)[None].to(device)
        with torch.no_grad():
            z = vae.encode(x).latent_dist.sample().mul_(scale)
        np.save(out / f"{i}.npy", z.cpu().numpy())
        np.save(out / f"{i}.label.npy", np.array([label]))

    one(0, *items[0])  # warm-up, untimed
    _sync(device)
    t = time.perf_counter()
    for i, (path, label) in enumerate(items):
        one(i, path, label)
    _sync(device)
    return len(items) / (time.perf_counter() - t)


def bench_pipeline(data: Path, vae_dir: Path, out: Path, args, n: int) -> dict:
    from dit_pipeline.extract import ExtractConfig, run_extract

    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    s = run_extract(ExtractConfig(data_path=str(data), out=str(out), vae=str(vae_dir), image_size=args.image_size,
                                  batch_size=args.batch_size, num_workers=args.num_workers,
                                  precision=args.precision, quiet=True))
    wall = time.perf_counter() - t
    assert s.images == n, f"pipeline encoded {s.images} of {n} images"
    return {"images_per_s": n / wall, "wall_s": wall, "bytes": s.total_bytes, "shards": s.shards_written}


def compare_precisions(vae, device: torch.device, size: int, batch: int, iters: int) -> list[dict]:
    """Error of each autocast precision against a float64 encode of the same crops, and its encode rate."""
    import copy

    from dit_pipeline.extract.encode import LatentEncoder, to_model_input

    rng = np.random.default_rng(1)
    crops = torch.from_numpy(np.stack([adm_center_crop(natural_image(rng), size) for _ in range(batch)]))
    ref_vae = copy.deepcopy(vae).double().to(device).eval()
    with torch.no_grad():
        ref = ref_vae.encode(to_model_input(crops.to(device), 1).double()).latent_dist
        ref_mean, ref_std = ref.mean.cpu().numpy(), ref.std.cpu().numpy()
    del ref_vae
    rows = []
    for precision in ("fp32", "bf16", "fp16"):
        enc = LatentEncoder(copy.deepcopy(vae), device=device, precision=precision, views=1)
        pixels = crops.pin_memory() if device.type == "cuda" else crops
        mean, std = enc.submit(pixels, list(range(batch))).arrays()
        _sync(device)
        t = time.perf_counter()
        for _ in range(iters):
            enc.submit(pixels, list(range(batch))).arrays()
        _sync(device)
        rate = iters * batch / (time.perf_counter() - t)
        mean, std = mean[:, 0], std[:, 0]       # the one view
        rows.append({"precision": precision, "encodes_per_s": rate,
                     "mean_rel_err": float(np.linalg.norm(mean - ref_mean) / np.linalg.norm(ref_mean)),
                     "mean_max_abs_err": float(np.abs(mean - ref_mean).max()),
                     "std_rel_err": float(np.linalg.norm(std - ref_std) / np.linalg.norm(ref_std)),
                     "finite": bool(np.isfinite(mean).all()), "fp32_retries": enc.fp32_retries})
    return rows


def encoder_gflop(vae, size: int) -> float:
    """FLOPs (2 x multiply-accumulates) of one encode at size x size, counted by torch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        vae.encode(torch.zeros(1, 3, size, size))
    return counter.get_total_flops() / 1e9


def report(r: dict) -> None:
    print(f"\n## dit-extract benchmark ({r['device']}, {r['images']} images {r['source_size']} JPEG -> "
          f"{r['image_size']} px)")
    base, pipe = r["baseline_images_per_s"], r["pipeline"]["images_per_s"]
    print("| contender | images/s | encodes/s | images/s vs baseline | encoder TFLOP/s |\n|---|---|---|---|---|")
    print(f"| baseline: 1 image at a time, fp32, 1 view, .npy per image ({r['baseline_images']} images) "
          f"| {base:.3f} | {base:.3f} | 1.00x | {base * r['encoder_gflop'] / 1e3:.3f} |")
    print(f"| dit-extract: batch {r['batch_size']}, {r['num_workers']} workers, {r['precision']}, 2 views, shards "
          f"| {pipe:.3f} | {2 * pipe:.3f} | {r['speedup']:.2f}x | {2 * pipe * r['encoder_gflop'] / 1e3:.3f} |")
    print(f"| decode + ADM crop, one worker process | {r['decode_per_worker_images_per_s']:.1f} | - | - | - |")
    print(f"\nencoder cost: {r['encoder_gflop']:.1f} GFLOP per {r['image_size']} px view")
    print(f"\nImageNet train (1,281,167 images) at the pipeline rate: {r['imagenet_minutes']:.1f} min; "
          f"16 decode workers supply {16 * r['decode_per_worker_images_per_s']:.0f} images/s")
    for row in r.get("precisions", []):
        print(f"precision {row['precision']}: {row['encodes_per_s']:.2f} encodes/s, mean rel err "
              f"{row['mean_rel_err']:.2e} (max abs {row['mean_max_abs_err']:.2e}), std rel err "
              f"{row['std_rel_err']:.2e}, finite {row['finite']}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    gpu = device.type == "cuda"
    n = args.images or (2048 if gpu else 6)
    args.batch_size = args.batch_size or (64 if gpu else 4)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-extract-"))
    items = make_tree(work / "images", n)
    torch.manual_seed(0)
    vae = build_sd_vae().eval()
    vae_dir = work / "sd-vae"
    if not (vae_dir / "config.json").exists():
        vae.save_pretrained(vae_dir)
    from dit_pipeline.extract.config import resolve_num_workers, resolve_precision

    r = {"device": torch.cuda.get_device_name(device) if gpu else f"{os.cpu_count()}-core {platform.machine()} CPU",
         "torch": torch.__version__, "images": n, "image_size": args.image_size, "source_size": "500x375",
         "batch_size": args.batch_size, "num_workers": resolve_num_workers(args.num_workers),
         "precision": resolve_precision(args.precision, device)}
    r["encoder_gflop"] = encoder_gflop(vae, args.image_size)
    r["decode_per_worker_images_per_s"] = bench_decode(items[: args.decode_images], args.image_size)
    r["baseline_images"] = min(n, args.baseline_images or (256 if gpu else n))
    base_runs, pipe_runs = [], []
    for _ in range(args.repeat):  # interleaved, so load from other processes hits both alike
        base_runs.append(bench_baseline(items[: r["baseline_images"]], vae, device, args.image_size,
                                        work / "baseline-npy"))
        pipe_runs.append(bench_pipeline(work / "images", vae_dir, work / "shards", args, n))
    r["baseline_runs"] = base_runs
    r["pipeline_runs"] = pipe_runs
    r["baseline_images_per_s"] = statistics.median(base_runs)
    r["pipeline"] = {"images_per_s": statistics.median(p["images_per_s"] for p in pipe_runs),
                     "bytes": pipe_runs[0]["bytes"], "shards": pipe_runs[0]["shards"]}
    r["speedup"] = r["pipeline"]["images_per_s"] / r["baseline_images_per_s"]
    r["imagenet_minutes"] = 1_281_167 / r["pipeline"]["images_per_s"] / 60
    if args.precision_compare:
        r["precisions"] = compare_precisions(vae, device, args.compare_size or args.image_size,
                                             args.compare_batch or (64 if gpu else 4), iters=10 if gpu else 1)
    report(r)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2) + "\n")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return r


if __name__ == "__main__":
    main()
