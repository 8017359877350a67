"""`make demo`: the whole pipeline end to end on a small built-in example, offline, on CPU.

Runs the real commands (dit-extract -> dit-shards verify -> dit-train -> dit-sample) exactly as a user would,
on a generated class-folder image set and a small randomly initialised VAE, then prints where everything is.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

BIN = Path(sys.executable).parent
CLASSES = ("disks", "stripes", "checkers", "rings")
DEMO_VAE = dict(  # SD-VAE geometry (8x downsampling, 4 latent channels), far fewer channels
    in_channels=3, out_channels=3, latent_channels=4,
    down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[16, 32, 32, 32], layers_per_block=1, norm_num_groups=8, act_fn="silu",
    sample_size=64, scaling_factor=0.18215,
)


def draw(cls: int, rng: np.random.Generator, size: int):
    """One procedurally drawn picture of class `cls` (shape family and palette set the class)."""
    from PIL import Image, ImageDraw

    hue = [(220, 60, 50), (40, 90, 210), (30, 170, 80), (230, 190, 40)][cls]
    bg = tuple(int(c) for c in rng.integers(0, 60, 3))
    img = Image.new("RGB", (size, size), bg)
    d = ImageDraw.Draw(img)
    jitter = lambda: tuple(int(np.clip(c + rng.integers(-30, 31), 0, 255)) for c in hue)  # noqa: E731
    if cls == 0:
        for _ in range(rng.integers(2, 5)):
            r = int(rng.integers(size // 10, size // 4))
            x, y = (int(v) for v in rng.integers(r, size - r, 2))
            d.ellipse([x - r, y - r, x + r, y + r], fill=jitter())
    elif cls == 1:
        step = int(rng.integers(size // 10, size // 5))
        off = int(rng.integers(0, step))
        for y in range(-step + off, size, 2 * step):
            d.rectangle([0, y, size, y + step - 1], fill=jitter())
    elif cls == 2:
        step = int(rng.integers(size // 8, size // 4))
        for i in range(0, size, step):
            for j in range(0, size, step):
                if (i // step + j // step) % 2 == 0:
                    d.rectangle([i, j, i + step - 1, j + step - 1], fill=jitter())
    else:
        cx, cy = (int(v) for v in rng.integers(size // 3, 2 * size // 3, 2))
        for r in range(size, 0, -int(rng.integers(size // 10, size // 6))):
            d.ellipse([cx - r, cy - r, cx + r, cy + r], outline=jitter(), width=max(2, size // 20))
    return img


def make_images(root: Path, per_class: int, size: int, seed: int = 0) -> int:
    """Class folders of JPEG and PNG files (every third file a PNG), sizes varying around `size`."""
    rng = np.random.default_rng(seed)
    n = 0
    for c, name in enumerate(CLASSES):
        folder = root / f"{c}_{name}"  # the prefix keeps label order = drawing order (labels follow sorted names)
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            img = draw(c, rng, int(size * rng.uniform(1.0, 1.5)))
            if i % 3 == 2:
                img.save(folder / f"{name}_{i:03d}.png")
            else:
                img.save(folder / f"{name}_{i:03d}.JPEG", quality=92)
            n += 1
    return n


def make_vae(folder: Path) -> None:
    import safetensors.torch  # noqa: F401  (diffusers 0.29 uses it without importing it)
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    AutoencoderKL(**DEMO_VAE).save_pretrained(folder)


def run(cmd: list[str], log: Path) -> None:
    """Run one real command, echoing it; its output goes to the console (progress bars intact) and the log."""
    printable = " ".join(str(c) for c in cmd)
    print(f"\n$ {printable}", flush=True)
    with open(log, "ab") as f:
        f.write(f"$ {printable}\n".encode())
        f.flush()
        proc = subprocess.Popen([str(BIN / cmd[0]), *map(str, cmd[1:])], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        while chunk := proc.stdout.read1(1 << 16):
            sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
            f.write(chunk)
        if proc.wait() != 0:
            raise SystemExit(f"demo: `{printable}` failed with exit code {proc.returncode} (log: {log})")


def loss_summary(metrics: Path) -> tuple[float, float, int, float]:
    """First and last logged loss, last step, median training images/s."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    speed = float(np.median([r["images_per_s"] for r in rows if r.get("images_per_s")]))
    return float(rows[0]["loss"]), float(rows[-1]["loss"]), int(rows[-1]["step"]), speed


def check_outputs(first: float, last: float, grid: Path, size: int, n_classes: int) -> None:
    """The demo's own acceptance checks (CI runs `make demo`): loss fell, a 4 x n_classes grid of size px."""
    from PIL import Image

    problems = []
    if not last < 0.5 * first:
        problems.append(f"the training loss did not fall clearly ({first:.4f} -> {last:.4f})")
    with Image.open(grid) as g:
        w, h = g.size
    if not (4 * size <= w < 5 * size and n_classes * size <= h < (n_classes + 1) * size):
        problems.append(f"{grid} is {w}x{h}, expected a 4 x {n_classes} grid of {size}px samples")
    if problems:
        raise SystemExit("demo: " + "; ".join(problems))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="demo-out", help="Folder for everything the demo makes (replaced).")
    p.add_argument("--per-class", type=int, default=24, help="Images per class.")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=300, help="Training steps.")
    p.add_argument("--sample-steps", type=int, default=50, help="DDIM steps for the sample grid.")
    a = p.parse_args(argv)
    t0 = time.time()
    out = Path(a.out).resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    log = out / "demo.log"
    images, vae, shards, run_dir, samples = (out / n for n in ("images", "vae", "shards", "run", "samples"))

    n_images = make_images(images, a.per_class, a.image_size)
    make_vae(vae)
    print(f"demo: drew {n_images} images in {len(CLASSES)} classes under {images}")
    print("demo: NOTE the VAE in this demo has RANDOM weights (a small SD-VAE-shaped AutoencoderKL), so decoded "
          "samples show colour blobs, not pictures. For real work pass --vae stabilityai/sd-vae-ft-ema "
          "(or a local copy of it).")

    run(["dit-extract", "--data-path", images, "--out", shards, "--vae", vae, "--image-size", a.image_size,
         "--samples-per-shard", 24, "--batch-size", 16, "--num-workers", 1], log)
    run(["dit-shards", "verify", shards], log)
    run(["dit-train", "--shards", shards, "--run-dir", run_dir, "--model", "DiT-S/2", "--depth", 4,
         "--hidden-size", 128, "--num-heads", 4, "--global-batch-size", 32, "--max-steps", a.steps,
         "--lr", 1e-3, "--ema-decay", 0.99, "--log-every", 10, "--ckpt-every", a.steps // 2, "--num-workers", 1,
         "--shuffle-buffer", 64], log)
    run(["dit-train", "--plot", run_dir], log)
    run(["dit-report", run_dir], log)
    ckpts = sorted((run_dir / "checkpoints").glob("step-*[0-9].pt"))
    run(["dit-sample", "--ckpt", ckpts[-1], "--vae", vae, "--class-labels",
         ",".join(str(c) for c in range(len(CLASSES)) for _ in range(4)), "--sampler", "ddim",
         "--steps", a.sample_steps, "--cfg-scale", 4.0, "--out", samples, "--grid-cols", 4], log)

    first, last, step, speed = loss_summary(run_dir / "metrics.jsonl")
    wall = time.time() - t0
    manifest = json.loads((shards / "manifest.json").read_text())
    print("\n" + "=" * 78)
    print(f"demo finished in {wall:.0f} s")
    print(f"  images       {images}  ({n_images} images, {len(CLASSES)} classes)")
    print(f"  shards       {shards}  ({manifest['total_samples']} samples in {len(manifest['shards'])} shards, "
          "verified)")
    print(f"  checkpoints  {run_dir / 'checkpoints'}  (newest: {ckpts[-1].name})")
    print(f"  metrics      {run_dir / 'metrics.jsonl'}")
    print(f"  loss curve   {run_dir / 'loss.png'}")
    print(f"  run report   {run_dir / 'report.md'}  (and report.png)")
    print(f"  sample grid  {samples / 'grid.png'}")
    print(f"  loss         {first:.4f} -> {last:.4f} over {step} steps ({speed:.0f} training images/s)")
    print(f"  log          {log}")
    print("=" * 78)
    check_outputs(first, last, samples / "grid.png", a.image_size, len(CLASSES))
    if not (run_dir / "report.md").is_file() or not (run_dir / "report.png").is_file():
        raise SystemExit(f"demo: dit-report wrote no report.md/report.png in {run_dir}")


if __name__ == "__main__":
    main()
