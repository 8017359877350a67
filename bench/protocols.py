"""Benchmark: the published evaluation protocols (evaluate/protocols.py) on the same samples, side by side.

Two sets of smooth synthetic 256 px images (random 8 x 8 colour fields, bicubic to 256 px, plus a little noise: no
trained model or dataset is needed) are written as ADM .npz files; `dit-eval --protocol all` evaluates the first
against the second under `adm`, `nanogen` and `imf`, and the script prints each protocol's distance and Inception
Score and their relative differences from `adm`'s.

Without `--inception PATH` (the published weights, which cannot be fetched offline) the network has random
weights: the numbers are then not FID (`FD-rand0-N`), and what the table shows is how far the protocols' pipelines
(network code, resize, score rule, formula) move the same samples' numbers, not the size of a real FID gap.

    python bench/protocols.py --samples 200 --threads 2            # CPU, random weights
    python bench/protocols.py --samples 10000 --inception weights-inception-2015-12-05-6726825d.pth --device cuda
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_checkout  # noqa: E402

use_checkout()

from dit_pipeline.evaluate import EvalConfig, run_eval  # noqa: E402


def smooth_images(n: int, seed: int, size: int = 256) -> np.ndarray:
    """uint8 [n, size, size, 3]: random 8 x 8 colour fields, bicubic-upsampled, with noise of 4 levels."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(n, 3, 8, 8, generator=g) * 255
    x = F.interpolate(low, size=(size, size), mode="bicubic", align_corners=False)
    x = x + torch.randn(x.shape, generator=g) * 4
    return x.clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=200, help="images per side")
    ap.add_argument("--inception", default=None, help="the published weights file (default: random weights)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-size", type=int, default=50)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    folder = Path(tempfile.mkdtemp(prefix="bench-protocols-"))
    np.savez(folder / "samples.npz", arr_0=smooth_images(a.samples, 1))
    np.savez(folder / "ref.npz", arr_0=smooth_images(a.samples, 2))
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    result = run_eval(EvalConfig(samples=str(folder / "samples.npz"), ref=str(folder / "ref.npz"), protocol="all",
                                 inception=a.inception, random_inception=None if a.inception else 0,
                                 batch_size=a.batch_size, cache=False, quiet=True, device=a.device))
    seconds = time.perf_counter() - t0
    secs = result["protocols"]
    fd = "fid" if a.inception else "fd_rand"
    score = "inception_score" if a.inception else "is_rand"
    print(f"# {a.samples} smooth synthetic 256 px samples vs {a.samples} others, "
          f"{'the published weights' if a.inception else 'random Inception weights (seed 0): not FID'}, "
          f"{a.device}, {a.threads} thread(s), torch {torch.__version__}; {seconds:.0f} s; load average {load:.1f} "
          f"before, {os.getloadavg()[0]:.1f} after")
    print(f"| protocol | {secs['adm']['fid_name']} | vs adm | Inception Score | vs adm |")
    print("|---|---|---|---|---|")
    base = secs["adm"]["numbers"]
    for name, sec in secs.items():
        n = sec["numbers"]
        print(f"| {name} | {n[fd]:.6g} | {n[fd] / base[fd] - 1:+.2e} | {n[score]:.6g} | "
              f"{n[score] / base[score] - 1:+.2e} |")
    return result


if __name__ == "__main__":
    main()
