"""Benchmark: the cost REPA adds to a training step (dit/repa.py, common/teacher.py), side by side in one process.

Three steps on the same random latents, labels and uint8 images, interleaved in rounds (best of --repeat):
  plain   the flow objective's step (forward + backward of the velocity loss, AdamW)
  repa    the DINOv2 teacher forward (no grad, bf16 autocast on GPU) + the DiT with its projector
          (dit.repa.REPAModel) + REPA's loss (denoising + 0.5 x projection), AdamW over DiT and projector
  teacher the teacher forward alone (images/s)
The teacher is the real DINOv2 ViT-B/14 architecture with random weights (its cost does not depend on them);
the DiT a preset at --image-size (latents image-size / 8). FLOPs count 2 x the analytic MACs: 3 x forward for
the DiT and the projector (forward + backward), 1 x forward for the teacher.

    python bench/repa.py --model DiT-S/2 --batch 4 --repeat 3 --threads 1  # CPU
    python bench/repa.py --model DiT-XL/2 --batch 256 --compile            # one GPU (bench/gpu.py runs it too)
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_checkout  # noqa: E402

use_checkout()

from dit_pipeline import dit  # noqa: E402
from dit_pipeline.common.teacher import DEFAULT_TEACHER, TeacherArch, build_teacher  # noqa: E402
from dit_pipeline.dit import repa  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_steps(model_name: str, image_size: int, batch: int, device: torch.device, *,
                teacher: TeacherArch | str = DEFAULT_TEACHER, overrides: dict[str, Any] | None = None,
                compile_backend: str | None = None) -> tuple[dict[str, Callable[[], None]], dict[str, float]]:
    """({"plain", "repa", "cached", "teacher"}: zero-argument step functions, the same keys: FLOPs per image).
    "cached" is REPA's step on tokens read from a sibling shard set (`dit-train --repa FOLDER`): the host copy of
    the batch's [B, N, D] float32 tokens to the device instead of the teacher forward."""
    from dit_pipeline.train.speed import regional_compile

    torch.manual_seed(0)
    latent = image_size // 8
    model = dit.create_model(model_name, input_size=latent, num_classes=1000, learn_sigma=False,
                             **(overrides or {})).to(device).train()
    tch = build_teacher(teacher, grid=model.grid_size, device=device)
    tch.check_tokens(model.grid_size ** 2)
    head = repa.REPAModel(model, encoder_depth=min(repa.ENCODER_DEPTH, model.depth), z_dims=(tch.dim,)).to(device)
    if compile_backend:
        regional_compile(model, backend=compile_backend)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-4, weight_decay=0, fused=device.type == "cuda")
    flow = dit.create_flow()
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(batch, 4, latent, latent, generator=g).to(device)
    y = torch.randint(0, 1000, (batch,), generator=g).to(device)
    t = torch.rand(batch, generator=g).to(device)
    pixels = torch.randint(0, 256, (batch, image_size, image_size, 3), dtype=torch.uint8, generator=g).to(device)
    amp = torch.bfloat16 if device.type == "cuda" else None

    def update(loss: torch.Tensor) -> None:
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def plain() -> None:
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            loss = flow.training_losses(model, x, t, {"y": y})["loss"].mean()
        update(loss)

    def with_repa() -> None:
        feats = tch(pixels)
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            loss = repa.training_losses(flow, head, x, t, [feats], {"y": y})["loss"].mean()
        update(loss)

    cached_tokens = tch(pixels).cpu()  # as a loader batch brings them (Batch.teacher)
    if device.type == "cuda":
        cached_tokens = cached_tokens.pin_memory()

    def with_cached() -> None:
        feats = cached_tokens.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            loss = repa.training_losses(flow, head, x, t, [feats], {"y": y})["loss"].mean()
        update(loss)

    def teacher_only() -> None:
        tch(pixels)

    dit_flops = dit.train_flops_per_image(model.config)
    proj_flops = 2 * 3 * repa.projector_macs(head.config, model.hidden_size, model.grid_size ** 2)
    teacher_flops = 2 * tch.forward_macs()
    return ({"plain": plain, "repa": with_repa, "cached": with_cached, "teacher": teacher_only},
            {"plain": dit_flops, "repa": dit_flops + proj_flops + teacher_flops, "cached": dit_flops + proj_flops,
             "teacher": teacher_flops})


def measure(steps: dict[str, Callable[[], None]], device: torch.device, *, warmup: int, iters: int,
            repeat: int) -> dict[str, float]:
    """Seconds per call of each step: the fastest of `iters` timed calls, best over `repeat` interleaved rounds
    (slower calls measure other processes on a shared machine)."""
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
    p.add_argument("--model", default="DiT-S/2")
    p.add_argument("--image-size", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--teacher", default=DEFAULT_TEACHER, help="dinov2_vitb14 or dinov2_vitb14_reg (random weights)")
    p.add_argument("--compile", action="store_true", help="per-block torch.compile of the DiT (as the trainer)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None, help="CPU intra-op threads (default: torch's)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    steps, flops = build_steps(a.model, a.image_size, a.batch, device, teacher=a.teacher,
                               compile_backend="inductor" if a.compile else None)
    load_before = os.getloadavg()
    sec = measure(steps, device, warmup=a.warmup, iters=a.iters, repeat=a.repeat)
    load_after = os.getloadavg()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU, {torch.get_num_threads()} threads"
    print(f"# {a.model} {a.image_size}px batch {a.batch}, teacher {a.teacher} (random weights), {where}, "
          f"torch {torch.__version__}; best of {a.repeat} rounds x {a.iters} calls")
    print("| step | s/step | img/s | vs plain step | GFLOP/image |")
    print("|---|---|---|---|---|")
    for name in ("plain", "repa", "cached", "teacher"):
        print(f"| {name} | {sec[name]:.3f} | {a.batch / sec[name]:.2f} | {sec[name] / sec['plain']:.2f} | "
              f"{flops[name] / 1e9:.1f} |")
    print(f"# online teacher / cached tokens: {sec['repa'] / sec['cached']:.2f}x the step time")
    print(consistency_line(sec, load_before, load_after))
    print(plain_line(sec, flops))


def plain_line(sec: dict[str, float], flops: dict[str, float]) -> str:
    """The second check: the cached step is the plain step plus the projector, so cached / plain is near their FLOP
    ratio (1.28 at DiT-S/2; the projector's small matmuls run a little faster than the DiT's, so a quiet machine
    measures a little under it); far above it, plain ran in a quieter round than the others."""
    ratio, predicted = sec["cached"] / sec["plain"], flops["cached"] / flops["plain"]
    verdict = "consistent" if ratio <= 1.5 * predicted else "INCONSISTENT: plain ran under another load"
    return f"# check: cached / plain {ratio:.2f} (FLOPs predict {predicted:.2f}; {verdict})"


def consistency_line(sec: dict[str, float], load_before: tuple[float, ...], load_after: tuple[float, ...]) -> str:
    """The bench's own check: the online step is the cached step plus the teacher forward (the host copy of the
    tokens is negligible), so online / (cached + teacher) is about 1 on a steady machine; far from 1, the load
    changed between the rounds and the ratios above are not to be trusted. With the load averages (1 min)
    before and after the timed rounds."""
    ratio = sec["repa"] / (sec["cached"] + sec["teacher"])
    verdict = "consistent" if 0.85 <= ratio <= 1.15 else "INCONSISTENT: the load changed between rounds"
    return (f"# check: online {sec['repa']:.3f} s vs cached + teacher {sec['cached'] + sec['teacher']:.3f} s = "
            f"{ratio:.2f} ({verdict}); load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")


if __name__ == "__main__":
    main()


# ---- bench/gpu.py's section ------------------------------------------------------------------------------------

SMOKE_TEACHER = TeacherArch("vit_base_patch14_dinov2", "-", "-", label="tiny DINOv2 (smoke)",
                            overrides={"embed_dim": 32, "depth": 2, "num_heads": 2})


def repa_section(res, s: dict, device: torch.device) -> None:
    """Rows "teacher forward", "plain flow step", "REPA step" at bench/gpu.py's training size (DiT-XL/2, batch
    256, per-block compile; halved until it fits), with images/s, MFU and peak memory; then their ratio."""
    from dit_pipeline.train.metrics import peak_tflops

    smoke = s["vae"] == "tiny"
    teacher = SMOKE_TEACHER if smoke else DEFAULT_TEACHER
    backend = s["compile_backend"] if device.type == "cuda" or smoke else None
    for batch in [s["batch"]] + [b for b in (128, 64) if b < s["batch"] and device.type == "cuda"]:
        try:
            steps, flops = build_steps(s["model"], 8 * s["latent"], batch, device, teacher=teacher,
                                       overrides=s["overrides"], compile_backend=backend)
            steps["repa"]()
            break
        except torch.cuda.OutOfMemoryError:
            steps = None
            torch.cuda.empty_cache()
    else:
        raise RuntimeError("REPA's step does not fit even at batch 64")
    peak, per_step = peak_tflops(device), {}
    names = {"teacher": f"teacher forward ({'tiny' if smoke else 'DINOv2 ViT-B/14'}, no grad)",
             "plain": "plain flow step (no REPA)", "repa": "REPA step (teacher + projector + loss)",
             "cached": "REPA step from cached tokens (projector + loss)"}
    for key in ("teacher", "plain", "repa", "cached"):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        t0 = time.perf_counter()
        steps[key]()
        _sync(device)
        first = time.perf_counter() - t0
        sec = measure({key: steps[key]}, device, warmup=max(0, s["warmup"] - 1), iters=s["steps"], repeat=1)[key]
        per_step[key] = sec
        img_s = batch / sec
        res.add("repa", names[key], model=s["model"], batch=batch, img_s=img_s, step_ms=sec * 1e3,
                tflops=flops[key] * img_s / 1e12, mfu=flops[key] * img_s / (peak * 1e12) if peak else None,
                peak_mem_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
                first_call_s=first)
    res.add("repa", "REPA step / plain step", model=s["model"], batch=batch,
            time_ratio=per_step["repa"] / per_step["plain"], flops_ratio=flops["repa"] / flops["plain"])
    res.add("repa", "REPA step online / cached tokens", model=s["model"], batch=batch,
            time_ratio=per_step["repa"] / per_step["cached"], flops_ratio=flops["repa"] / flops["cached"])
