"""Benchmark: what the divergence guard (train/guard.py) and FD_DINOv2's two resizes (evaluate/dinov2.py) cost, and
how far the two resizes are apart, side by side in one process.

  guard    the guard's bookkeeping per optimizer step (`Guard.judge` + `Guard.applied`, spike window full,
           --spike-window 100) against the same loop without it, interleaved in rounds; microseconds per step
  resize   EDM2's two 224 px preprocessings of FD_DINOv2 on the same uint8 images (256 px, the test suite's
           deterministic class-pattern images): `pil` (PIL bicubic, rounded to uint8: dgm-eval's reference)
           and `torch` (F.interpolate bicubic, antialiased, float); seconds per image each, interleaved, and the
           difference of their outputs in 0-255 units (the network's input before / 255)

    python bench/guard.py --images 64 --repeat 2 --threads 1
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_checkout  # noqa: E402

use_checkout()

from dit_pipeline.evaluate.dinov2 import DINOv2Features  # noqa: E402
from dit_pipeline.train.guard import Guard, GuardSettings  # noqa: E402


def guard_cost(steps: int, rounds: int) -> tuple[float, float]:
    """(us per step with the guard, us per step of the bare loop): best of `rounds`, interleaved."""
    rng = np.random.default_rng(0)
    norms = (0.5 + 0.1 * rng.standard_normal(steps)).tolist()
    losses = (1.0 + 0.01 * rng.standard_normal(steps)).tolist()
    best = [math.inf, math.inf]
    for _ in range(rounds):
        g = Guard(GuardSettings(on_divergence="rollback", spike_window=100))
        for n in norms[:100]:
            g.applied(n)
        t0 = time.perf_counter()
        for k, (loss, n) in enumerate(zip(losses, norms)):
            if g.judge(k + 1, loss, n, []).kind == "apply":
                g.applied(n)
        best[0] = min(best[0], (time.perf_counter() - t0) / steps * 1e6)
        t0 = time.perf_counter()
        for loss, n in zip(losses, norms):  # what the loop did before: the finiteness test alone
            if math.isfinite(loss) and math.isfinite(n):
                pass
        best[1] = min(best[1], (time.perf_counter() - t0) / steps * 1e6)
    return best[0], best[1]


def images(n: int, size: int = 256) -> np.ndarray:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests._util import draw_image

    return np.stack([np.asarray(draw_image(i % 10, i, (size, size))) for i in range(n)])


def resize_cost(x: np.ndarray, rounds: int) -> dict[str, float]:
    nets = {mode: DINOv2Features(torch.nn.Identity(), resize=mode) for mode in ("pil", "torch")}
    batch = torch.from_numpy(x)
    best = {m: math.inf for m in nets}
    out = {}
    for _ in range(rounds):
        for mode, net in nets.items():
            t0 = time.perf_counter()
            out[mode] = net.preprocess(batch) * net.std + net.mean  # back to [0, 1] before / 255's inverse
            best[mode] = min(best[mode], (time.perf_counter() - t0) / len(x))
    diff = (out["pil"] - out["torch"]).abs() * 255
    return {"pil_s": best["pil"], "torch_s": best["torch"], "mean_abs": float(diff.mean()),
            "p99_abs": float(diff.flatten().quantile(0.99)), "max_abs": float(diff.max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    with_guard, bare = guard_cost(a.steps, a.repeat)
    print(f"guard: {with_guard:.2f} us per step (bare finiteness test {bare:.2f} us), spike window 100")
    r = resize_cost(images(a.images), a.repeat)
    print(f"resize to 224 px ({a.images} images of 256 px): pil {r['pil_s'] * 1e3:.2f} ms/image, torch "
          f"{r['torch_s'] * 1e3:.2f} ms/image ({r['pil_s'] / r['torch_s']:.2f}x); |pil - torch| in 0-255 units: "
          f"mean {r['mean_abs']:.3f}, 99th percentile {r['p99_abs']:.3f}, max {r['max_abs']:.3f}")


if __name__ == "__main__":
    main()
