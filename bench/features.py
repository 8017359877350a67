"""Benchmark: what a feature space costs (issue #32), side by side in one process on the same uint8 crops.

  encode   images/s of the SD-VAE encoder (posterior, 256 px -> 4x32x32) and of DINOv2-B with registers by
           RAE's formula (224 px -> 768x16x16), interleaved in rounds (best of --repeat), each through
           extract.encode.LatentEncoder exactly as dit-extract runs it (both views when --views 2)
  bytes    bytes per sample of each space as dit-extract stores it (tar members: .npy headers, label, meta)
           from one real shard each, and ImageNet-1k train totals (1,281,167 images) per space and per view
  storage  the error of bf16 and fp16 storage of the features relative to their float32 values

Random weights of the real architectures (the cost does not depend on them; the storage error does, a little:
real DINOv2 features were not available offline, see BENCHMARKS.md).

    python bench/features.py --batch 2 --repeat 2 --threads 2       # CPU
    python bench/features.py --batch 64 --repeat 3 --device cuda     # one GPU (bench/gpu.py runs it too)
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_checkout  # noqa: E402

use_checkout()

from dit_pipeline.common.features import load_feature_encoder  # noqa: E402
from dit_pipeline.common.vae import build_sd_vae  # noqa: E402
from dit_pipeline.extract.encode import LatentEncoder  # noqa: E402
from dit_pipeline.shards import ShardWriter, sample_key  # noqa: E402

IMAGENET_TRAIN = 1_281_167


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def encoders(device: torch.device, precision: str, views: int) -> dict[str, tuple[LatentEncoder, str]]:
    torch.manual_seed(0)
    vae = LatentEncoder(build_sd_vae(), device=device, precision=precision, views=views, store="posterior")
    dino, _ = load_feature_encoder("dinov2-b-reg", pretrained=False, device=device, image_size=256)
    feat = LatentEncoder(dino, device=device, precision=precision, views=views, store="sample", unit_range=True)
    return {"SD-VAE (posterior 4x32x32)": (vae, "posterior"), "DINOv2-B reg (768x16x16)": (feat, "sample")}


def time_encodes(encs: dict[str, tuple[LatentEncoder, str]], pixels: torch.Tensor, repeat: int,
                 device: torch.device) -> tuple[dict[str, float], list[dict[str, float]]]:
    """(images/s of each encoder: its fastest round; every round's images/s, for the consistency check)."""
    rounds: list[dict[str, float]] = []
    for name, (enc, _) in encs.items():  # warm-up
        enc.submit(pixels, list(range(len(pixels)))).arrays()
    for _ in range(repeat):
        rounds.append({})
        for name, (enc, _) in encs.items():
            _sync(device)
            t0 = time.perf_counter()
            enc.submit(pixels, list(range(len(pixels)))).arrays()
            _sync(device)
            rounds[-1][name] = len(pixels) / (time.perf_counter() - t0)
    return {name: max(r[name] for r in rounds) for name in encs}, rounds


def _sdpa_flops(q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of a fused attention call from its shapes: Q K^T and the weighted sum of V, 2 per multiply-add."""
    b, h, length, e = q
    return 2 * b * h * length * k[-2] * e + 2 * b * h * length * k[-2] * v[-1]


def gflop_per_image(enc: LatentEncoder, pixels: torch.Tensor) -> float:
    """GFLOP of one image through the encoder as dit-extract runs it (every view), counted by
    torch.utils.flop_counter (2 per multiply-accumulate: convolutions, matmuls), with the fused attention of the
    CPU (which the counter leaves at 0) counted from its shapes: DINOv2-B's 12 blocks of 261 tokens (256 patches,
    the class token, 4 registers) add 2.5 GFLOP per view to the 44.6 of its matmuls."""
    from torch.utils.flop_counter import FlopCounterMode

    ops = torch.ops.aten
    mapping = {op: _sdpa_flops for op in (getattr(ops, "_scaled_dot_product_flash_attention_for_cpu", None),)
               if op is not None}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        enc.submit(pixels[:1], [0]).arrays()
    return counter.get_total_flops() / 1e9


def consistency_line(rounds: list[dict[str, float]], names: list[str], load: tuple[float, float]) -> str:
    """The bench's own check: the ratio of the two encoders in each round (both ran back to back in it). On a
    steady machine the rounds agree; a spread over 15% means the load changed within a round."""
    ratios = [r[names[1]] / r[names[0]] for r in rounds]
    spread = max(ratios) / min(ratios)
    verdict = "consistent" if spread <= 1.15 else "INCONSISTENT: the load changed within a round"
    return (f"# check: ratio per round {', '.join(f'{x:.2f}x' for x in ratios)} (spread {spread:.2f}, {verdict}); "
            f"load average {load[0]:.1f} before, {load[1]:.1f} after")


def sample_bytes(arrays: dict[str, np.ndarray], dtype: str, folder: Path, name: str) -> int:
    """Bytes one sample takes in a shard (its members and tar headers): a shard of 8 such samples, / 8."""
    path = folder / f"{name}.tar"
    with ShardWriter(path, dtype=dtype) as w:
        for i in range(8):
            w.write(sample_key(i), label=i, meta={"path": f"n01440764/n01440764_{i:05d}.JPEG"}, **arrays)
        rec = w.close()
    return rec.bytes // 8


def storage_error(z: np.ndarray) -> dict[str, float]:
    from dit_pipeline.shards.npy import widen

    out = {}
    for dtype in ("float16", "bfloat16"):
        if dtype == "float16":
            stored = z.astype(np.float16).astype(np.float32)
        else:
            bits = z.astype(np.float32).view(np.uint32)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
            stored = widen(rounded, "bfloat16")
        rel = np.abs(stored - z) / np.maximum(np.abs(z), 1e-12)
        out[dtype] = float(np.abs(stored - z).max() / np.abs(z).max())
        out[dtype + "_median_rel"] = float(np.median(rel))
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--views", type=int, default=2, choices=(1, 2))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default=None, help="fp32 on CPU, fp16 on GPU by default")
    ap.add_argument("--out", default=None, help="folder for the two probe shards [a temp folder]")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    precision = a.precision or ("fp16" if device.type == "cuda" else "fp32")
    g = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (a.batch, 256, 256, 3), dtype=torch.uint8, generator=g)
    encs = encoders(device, precision, a.views)
    load_before = os.getloadavg()[0]
    rates, rounds = time_encodes(encs, pixels, a.repeat, device)
    load_after = os.getloadavg()[0]
    names = list(rates)
    gflops = {name: gflop_per_image(enc, pixels) for name, (enc, _) in encs.items()}
    print(f"# encodes on {device} ({precision}), batch {a.batch} x {a.views} view(s), best of {a.repeat}, "
          f"{a.threads} thread(s)")
    for name in names:
        print(f"{name:30s} {rates[name]:8.2f} images/s  {gflops[name]:8.1f} GFLOP/image ({a.views} view(s))")
    print(f"{'DINOv2-B / SD-VAE':30s} {rates[names[1]] / rates[names[0]]:8.2f} x the images/s "
          f"(by FLOPs {gflops[names[0]] / gflops[names[1]]:.2f} x)")
    print(consistency_line(rounds, names, (load_before, load_after)))

    import tempfile

    folder = Path(a.out or tempfile.mkdtemp(prefix="bench-features-"))
    folder.mkdir(parents=True, exist_ok=True)
    (vae_enc, _), (feat_enc, _) = encs[names[0]], encs[names[1]]
    mean, std = vae_enc.submit(pixels[:1], [0]).arrays()
    feats, _ = feat_enc.submit(pixels[:1], [0]).arrays()
    rows = [("SD-VAE posterior (mean+std)", {"mean": mean[0], "std": std[0]}, "float16"),
            ("SD-VAE sample", {"latent": mean[0]}, "float16"),
            ("DINOv2-B features", {"latent": feats[0]}, "bfloat16"),
            ("DINOv2-B features", {"latent": feats[0]}, "float16"),
            ("DINOv3-L features (1024x16x16)", {"latent": np.zeros((a.views, 1024, 16, 16), np.float32)}, "bfloat16")]
    print(f"# bytes per sample ({a.views} view(s)) and ImageNet-1k train totals ({IMAGENET_TRAIN:,} images)")
    out: dict[str, Any] = {"rates": rates, "rounds": rounds, "gflop_per_image": gflops, "bytes": {}}
    for i, (label, arrays, dtype) in enumerate(rows):
        b = sample_bytes(arrays, dtype, folder, f"probe{i}")
        out["bytes"][f"{label} {dtype}"] = b
        print(f"{label + ' ' + dtype:42s} {b:9,d} B/sample  {b * IMAGENET_TRAIN / 2 ** 30:8.1f} GiB total  "
              f"{b * IMAGENET_TRAIN / 2 ** 30 / a.views:8.1f} GiB per view")
    err = storage_error(feats[0].astype(np.float32))
    out["storage"] = err
    print(f"# storage error of the features (max |stored - z| / max |z|; median relative): fp16 "
          f"{err['float16']:.2e} ({err['float16_median_rel']:.2e}), bf16 {err['bfloat16']:.2e} "
          f"({err['bfloat16_median_rel']:.2e})")
    return out


if __name__ == "__main__":
    main()
