"""Benchmark: Inception feature extraction of dit-eval (images/s) and the projected time of a 50K evaluation.

The TF-FID InceptionV3 (evaluate/inception.py) with random weights of the real architecture (the cost does
not depend on the weights) at its real input size (299x299 after the TF1 bilinear resize), on uint8 NHWC
images of `--image-size`, batch `--batch`, all three outputs (pool, spatial, logits) per forward. The
projection for the paper's protocol counts 50,000 samples plus the 10,000 images of the ADM reference batch
(whose features are then cached), plus the measured metric time (statistics, FID and sFID eigendecompositions,
Inception Score, precision/recall distances) on random features of the real sizes.

    python bench/eval.py                               # CPU: batch 8, 256px
    python bench/eval.py --device cuda --batch 200     # GPU
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_checkout  # noqa: E402

use_checkout()  # run from a checkout without installing

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dit_pipeline.evaluate import metrics  # noqa: E402
from dit_pipeline.evaluate.inception import load_inception  # noqa: E402


def extraction_rate(device: torch.device, batch: int, size: int, repeats: int) -> float:
    model, _ = load_inception(random_seed=0, device=device)
    x = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (batch, size, size, 3), dtype=np.uint8))
    with torch.no_grad():
        model(x.to(device))  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            model(x.to(device))
        if device.type == "cuda":
            torch.cuda.synchronize()
    return batch * repeats / (time.perf_counter() - start)


def metric_seconds(n_samples: int, n_ref: int, device: torch.device) -> float:
    """Seconds for the metrics of n_samples against n_ref images (random features of the real dimensions)."""
    rng = np.random.default_rng(0)
    s = {"pool": rng.random((n_samples, 2048), np.float32), "spatial": rng.random((n_samples, 2023), np.float32),
         "logits": rng.normal(size=(n_samples, 1008)).astype(np.float32)}
    r = {"pool": rng.random((n_ref, 2048), np.float32), "spatial": rng.random((n_ref, 2023), np.float32)}
    start = time.perf_counter()
    metrics.inception_score(s["logits"])
    for key in ("pool", "spatial"):
        metrics.frechet_distance(metrics.statistics(s[key]), metrics.statistics(r[key]))
    metrics.precision_recall(r["pool"], s["pool"], device=device)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--image-size", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--metric-samples", type=int, default=5000,
                    help="samples (and reference images) for the timed metric step; scaled to 50K/10K")
    args = ap.parse_args()
    device = torch.device(args.device)
    rate = extraction_rate(device, args.batch, args.image_size, args.repeats)
    n = args.metric_samples
    metric_s = metric_seconds(n, n, device)
    # statistics and P/R distances grow linearly with N, the D x D eigendecompositions not at all: the
    # linear scaling of the whole metric step from N to 50K is an upper bound
    projected_metric_s = metric_s * 50_000 / n
    out = {"device": str(device), "cpu": platform.processor() or platform.machine(),
           "threads": torch.get_num_threads(), "batch": args.batch, "image_size": args.image_size,
           "images_per_s": round(rate, 3), "metric_seconds_at": {"n": n, "s": round(metric_s, 2)},
           "projected_50k_minutes": round((60_000 / rate + projected_metric_s) / 60, 1)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
