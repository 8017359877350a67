"""Benchmark: the training step of the model families side by side, in one process (dit/family.py).

Each variant runs the flow objective's training step (forward + backward of the velocity loss, AdamW) on the same
random latents, labels and times; the variants are interleaved in rounds and each keeps its fastest call (slower
calls measure other processes on a shared machine). CPU mode (default) compares B-size blocks (width 768, 12 heads;
--depth 4 by default, so four models and their AdamW states fit a shared machine: a step is depth x one block's
cost plus the embeddings, so the ratios are the blocks'; --depth 12 is the full B):
  DiT-B/2                 DiT's block (LayerNorm, GELU MLP, no RoPE)
  LightningDiT-B/2        its release's block: RMSNorm with scales, SwiGLU (unrounded width), EVA RoPE
  LightningDiT-B/2 -rope  the same without RoPE             (RoPE's cost = the difference)
  LightningDiT-B/2 -swiglu  the same with DiT's GELU MLP    (SwiGLU's cost = the difference)
and prints seconds per step, each variant's ratio to DiT-B/2 and its analytic GFLOP per image.

    python bench/families.py --threads 1 --repeat 3               # CPU, latents 4x16x16 (64 tokens), batch 2
    python bench/gpu.py --only families                           # GPU rows: LightningDiT-XL/1 and DiT-DH-XL
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_checkout  # noqa: E402

use_checkout()

from dit_pipeline import dit  # noqa: E402

CPU_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "DiT-B/2": ("DiT-B/2", {}),
    "LightningDiT-B/2": ("LightningDiT-B/2", {}),
    "LightningDiT-B/2 -rope": ("LightningDiT-B/2", {"rope": False}),
    "LightningDiT-B/2 -swiglu": ("LightningDiT-B/2", {"swiglu": False}),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_step(name: str, *, latent: int, channels: int, batch: int, device: torch.device,
               overrides: dict[str, Any] | None = None, compile_backend: str | None = None
               ) -> tuple[Callable[[], None], float, torch.nn.Module]:
    """(a zero-argument flow training step of preset `name`, its training FLOPs per image, the model)."""
    from dit_pipeline.train.speed import regional_compile

    torch.manual_seed(0)
    model = dit.create_model(name, input_size=latent, in_channels=channels, num_classes=1000, learn_sigma=False,
                             **(overrides or {})).to(device).train()
    if compile_backend:
        regional_compile(model, backend=compile_backend)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0,
                            fused=device.type == "cuda")
    flow = dit.create_flow()
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(batch, channels, latent, latent, generator=g).to(device)
    y = torch.randint(0, 1000, (batch,), generator=g).to(device)
    t = torch.rand(batch, generator=g).to(device)
    amp = torch.bfloat16 if device.type == "cuda" else None

    def step() -> None:
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            loss = flow.training_losses(model, x, t, {"y": y})["loss"].mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, float(dit.train_flops_per_image(model.config)), model


def measure(steps: dict[str, Callable[[], None]], device: torch.device, *, warmup: int, iters: int,
            repeat: int) -> dict[str, float]:
    """Seconds per call of each step: the fastest of `iters` timed calls over `repeat` interleaved rounds."""
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    best = {k: float("inf") for k in steps}
    for _ in range(repeat):
        for name, fn in steps.items():
            for _ in range(iters):
                _sync(device)
                t0 = time.perf_counter()
                fn()
                _sync(device)
                best[name] = min(best[name], time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--latent", type=int, default=16, help="latent side (tokens = (latent / 2)^2)")
    p.add_argument("--channels", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--depth", type=int, default=4, help="blocks of every variant (B has 12)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="CPU intra-op threads (default: torch's)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device("cpu")
    steps, flops = {}, {}
    for label, (name, over) in CPU_VARIANTS.items():
        steps[label], flops[label], _ = build_step(name, latent=a.latent, channels=a.channels, batch=a.batch,
                                                   device=device, overrides={"depth": a.depth, **over})
    sec = measure(steps, device, warmup=a.warmup, iters=a.iters, repeat=a.repeat)
    print(f"# flow training step, B blocks x {a.depth}, latents {a.channels}x{a.latent}x{a.latent} "
          f"({(a.latent // 2) ** 2} tokens), batch "
          f"{a.batch}, CPU {torch.get_num_threads()} thread(s), torch {torch.__version__}; best of {a.repeat} "
          f"interleaved rounds x {a.iters} calls")
    print("| variant | s/step | vs DiT-B/2 | GFLOP/image (train) |")
    print("|---|---|---|---|")
    for label in CPU_VARIANTS:
        print(f"| {label} | {sec[label]:.3f} | {sec[label] / sec['DiT-B/2']:.3f} | {flops[label] / 1e9:.1f} |")
    full = sec["LightningDiT-B/2"]
    print(f"# RoPE: {full / sec['LightningDiT-B/2 -rope']:.3f} x the step without it; SwiGLU: "
          f"{full / sec['LightningDiT-B/2 -swiglu']:.3f} x the step with GELU")


# ---- bench/gpu.py's section ------------------------------------------------------------------------------------

GPU_MODELS = {  # name -> (preset, latent side, channels): the papers' settings
    "LightningDiT-XL/1": ("LightningDiT-XL/1", 16, 32),   # VA-VAE f16d32 latents of 256 px images
    "DiT-DH-XL": ("DiT-DH-XL", 16, 768),                 # RAE's DINOv2-B features of 256 px images
}
SMOKE_OVERRIDES = {"LightningDiT-XL/1": {"depth": 2, "hidden_size": 64, "num_heads": 2},
                   "DiT-DH-XL": {"depth": 2, "hidden_size": 64, "num_heads": 2, "head_depth": 1,
                                 "head_hidden_size": 64, "head_num_heads": 2}}


def families_section(res: Any, s: dict, device: torch.device) -> None:
    """Rows "<model> flow step": images/s, MFU and peak memory of LightningDiT-XL/1 and DiT-DH-XL training steps at
    bench/gpu.py's batch (halved until it fits), bf16 autocast, per-block compile, fused AdamW."""
    from dit_pipeline.train.metrics import peak_tflops

    smoke = s["vae"] == "tiny"
    peak = peak_tflops(device)
    for label, (name, latent, channels) in GPU_MODELS.items():
        if smoke:
            latent, channels = 4, 8
        step = None
        for batch in [s["batch"]] + [b for b in (128, 64, 32) if b < s["batch"] and device.type == "cuda"]:
            try:
                step, flops, _ = build_step(name, latent=latent, channels=channels, batch=batch, device=device,
                                            overrides=SMOKE_OVERRIDES[label] if smoke else None,
                                            compile_backend=s["compile_backend"])
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                t0 = time.perf_counter()
                step()
                _sync(device)
                first = time.perf_counter() - t0
                break
            except torch.cuda.OutOfMemoryError:
                step = None
                torch.cuda.empty_cache()
        if step is None:
            raise RuntimeError(f"{label}'s step does not fit even at batch 32")
        sec = measure({label: step}, device, warmup=max(0, s["warmup"] - 1), iters=s["steps"], repeat=1)[label]
        img_s = batch / sec
        res.add("families", f"{label} flow step", model=label, latent=f"{channels}x{latent}x{latent}", batch=batch,
                img_s=img_s, step_ms=sec * 1e3, tflops=flops * img_s / 1e12,
                mfu=flops * img_s / (peak * 1e12) if peak else None,
                peak_mem_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
                first_call_s=first)
        del step
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
