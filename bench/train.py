"""Benchmark: `dit-train`'s training step beside a reference-style loop, per preset/precision/batch/compile.

Both train the same DiT from the same random init on the same latents, in one run:

  reference  the structure of the reference DiT training script, written here from its description: fp32,
             no autocast, the batch already in memory (no loader at all), AdamW, EMA updated parameter by
             parameter with mul_/add_, and `loss.item()` every step
  ours       the real trainer (train.run) end to end on a synthetic shard set: the shard loader with 2
             workers, per-step derived randomness, autocast at the chosen precision, optional torch.compile,
             the all-rank loss/NaN checks, foreach EMA, metrics

Reported per configuration: images/s (median over the measured steps, warm-up excluded), the ratio to the
reference loop, achieved model TFLOP/s (2 x 3 x forward MACs per image, dit.train_flops_per_image), MFU
against the GPU's dense bf16 peak (train.metrics.PEAK_TFLOPS, or --peak-tflops) and peak GPU memory.

    python bench/train.py                                             # CPU: DiT-S/2 on 8x8 latents
    python bench/train.py --models DiT-XL/2 --input-size 32 --batch 32 --precision bf16 --compile off on
"""
from __future__ import annotations

import argparse
import copy
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_checkout  # noqa: E402

use_checkout()  # run from a checkout without installing

from dit_pipeline import dit  # noqa: E402
from dit_pipeline.shards import FORMAT_VERSION, Manifest, ShardWriter, sample_key, shard_name, write_manifest  # noqa: E402
from dit_pipeline.train import merge_config, run  # noqa: E402
from dit_pipeline.train.metrics import peak_tflops, read_metrics  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["DiT-S/2"])
    p.add_argument("--input-size", type=int, default=8, help="latent size (32 = 256px images)")
    p.add_argument("--batch", type=int, nargs="+", default=[16], help="batch per step (one process)")
    p.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "fp16"])
    p.add_argument("--compile", nargs="+", default=["off"], choices=["off", "on"])
    p.add_argument("--grad-checkpointing", action="store_true")
    p.add_argument("--steps", type=int, default=12, help="measured steps")
    p.add_argument("--warmup", type=int, default=4, help="steps not measured (compilation, allocator)")
    p.add_argument("--peak-tflops", type=float, default=None)
    return p.parse_args(argv)


def make_shards(folder: Path, n: int, size: int) -> None:
    rng = np.random.default_rng(0)
    per = 64
    records = []
    for i in range(0, n, per):
        with ShardWriter(folder / shard_name(i // per), dtype="float16") as w:
            for k in range(i, min(n, i + per)):
                mean = rng.standard_normal((2, 4, size, size), dtype=np.float32) * 5
                w.write(sample_key(k), label=k % 1000, meta={}, mean=mean, std=np.full_like(mean, 0.1))
            records.append(w.close())
    write_manifest(folder, Manifest(
        format_version=FORMAT_VERSION, tool_version="bench", extraction={"vae": {"source": "bench"}},
        scaling_factor=0.18215, shift_factor=None, image_size=8 * size, views=2, store="posterior",
        dtype="float16", latent_shape=[4, size, size], class_names=[f"c{c}" for c in range(1000)],
        num_classes=1000, total_samples=n, samples_per_shard=per, shards=records, skipped=[]))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reference_loop(model_name: str, size: int, batch: int, steps: int, warmup: int, device: torch.device) -> float:
    """images/s of the reference training structure (median over measured steps)."""
    torch.manual_seed(0)
    model = dit.create_model(model_name, input_size=size, num_classes=1000).to(device)
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0)
    diffusion = dit.create_diffusion("")
    x = torch.randn(batch, 4, size, size, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    times = []
    running = 0.0
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        t = torch.randint(0, diffusion.num_timesteps, (batch,), device=device)
        loss = diffusion.training_losses(model, x, t, model_kwargs={"y": y})["loss"].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters()):
                e.mul_(0.9999).add_(p.data, alpha=1 - 0.9999)
        running += loss.item()
        _sync()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    return batch / statistics.median(times)


def ours(root: Path, model_name: str, size: int, batch: int, precision: str, compile_: bool, ckpt: bool,
         steps: int, warmup: int, peak: float | None) -> dict:
    run_dir = root / f"run-{model_name.replace('/', '-')}-{batch}-{precision}-{compile_}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run(merge_config({}, {"shards": str(root / "shards"), "run_dir": str(run_dir), "model": model_name,
                          "max_steps": warmup + steps, "global_batch_size": batch, "num_workers": 2,
                          "precision": precision, "compile": compile_, "grad_checkpointing": ckpt,
                          "log_every": 1, "ckpt_every": 10**9, "quiet": True, "peak_tflops": peak,
                          "tensorboard": False, "resume": "none", "shuffle_buffer": 64}))
    recs = read_metrics(run_dir)[warmup:]
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"img_s": statistics.median(r["images_per_s"] for r in recs),
            "mem": max((r["peak_mem_gb"] or 0.0) for r in recs) or None}


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    peak = peak_tflops(device, a.peak_tflops)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else f"{platform.machine()} CPU"
    root = Path(tempfile.mkdtemp(prefix="bench-train-"))
    try:
        (root / "shards").mkdir()
        make_shards(root / "shards", max(a.batch) * (a.warmup + a.steps) + 256, a.input_size)
        print(f"# {name}, torch {torch.__version__}, peak {peak or 'unknown'} TFLOP/s, "
              f"latents 4x{a.input_size}x{a.input_size}, {a.warmup} warm-up + {a.steps} measured steps")
        print("| model | batch | precision | compile | img/s | ratio vs reference | TFLOP/s | MFU | peak mem GiB |\n"
              "|---|---|---|---|---|---|---|---|---|")
        for model_name in a.models:
            with torch.device("meta"):
                cfg = dit.create_model(model_name, input_size=a.input_size, num_classes=1000).config
            flops = dit.train_flops_per_image(cfg)
            for batch in a.batch:
                ref = reference_loop(model_name, a.input_size, batch, a.steps, a.warmup, device)
                print(f"| {model_name} | {batch} | fp32 | reference loop | {ref:.2f} | 1.00 | "
                      f"{flops * ref / 1e12:.3g} | {f'{flops * ref / (peak * 1e12):.1%}' if peak else '-'} | - |",
                      flush=True)
                for precision in a.precision:
                    for comp in a.compile:
                        r = ours(root, model_name, a.input_size, batch, precision, comp == "on",
                                 a.grad_checkpointing, a.steps, a.warmup, peak)
                        mfu = f"{flops * r['img_s'] / (peak * 1e12):.1%}" if peak else "-"
                        mem = f"{r['mem']:.1f}" if r["mem"] else "-"
                        print(f"| {model_name} | {batch} | {precision} | {comp} | {r['img_s']:.2f} | "
                              f"{r['img_s'] / ref:.2f} | {flops * r['img_s'] / 1e12:.3g} | {mfu} | {mem} |", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
