"""bench/gpu.py's training section: our real training step vs a fast-DiT-style step, one process.

"Ours" is the trainer itself: train.preflight.prepare + train.run.build_model (per-block compile, the SDPA
backend, fused AdamW) and Trainer.train_step (per-step derived randomness, bf16 autocast, the loss/grad-norm
all-reduce and non-finite check, foreach-lerp EMA) on batches already on the GPU (the loader is measured on
its own in the loader section). The fast-DiT-style step is written here from its description: fp16 autocast
with a GradScaler, eager, AdamW, the EMA updated parameter by parameter, `loss.item()` every step.
"""
from __future__ import annotations

import copy
import datetime
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dit_pipeline import dit
from dit_pipeline.train import memory
from dit_pipeline.train.checkpoint import CheckpointManager
from dit_pipeline.train.config_file import merge_config
from dit_pipeline.train.data import Batch
from dit_pipeline.train.loop import RunOutput, Trainer
from dit_pipeline.train.metrics import MetricsLog, peak_tflops
from dit_pipeline.train.preflight import prepare
from dit_pipeline.train.net import build_model
from dit_pipeline.train.speed import available_attention, choose_attention, ema_update


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _timed(step, steps: int, warmup: int, device: torch.device) -> tuple[float, float]:
    """(seconds of the first call, seconds per step over `steps` calls after `warmup` calls)."""
    _sync(device)
    t0 = time.perf_counter()
    step()
    _sync(device)
    first = time.perf_counter() - t0
    for _ in range(max(0, warmup - 1)):
        step()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return first, (time.perf_counter() - t0) / steps


def _trainer(s: dict, shards: Path, device: torch.device, work: Path, *, batch: int, micro: int, compile_: bool,
             attention: str, extra: dict | None = None) -> Trainer:
    run_dir = work / f"run-{batch}-{micro}-{compile_}-{attention}"
    cfg = merge_config({}, {"shards": str(shards), "run_dir": str(run_dir), "model": s["model"], **s["overrides"],
                            "max_steps": 10**6, "global_batch_size": batch, "micro_batch_size": micro,
                            "num_workers": 0, "precision": "bf16", "compile": compile_, "attention": attention,
                            "quiet": True, "tensorboard": False, "resume": "none", **(extra or {})})
    prep = prepare(cfg, 1)
    parts = build_model(prep, device, "bf16")
    if compile_ and s["compile_backend"] != "inductor":  # smoke: exercise the path without a C++ compiler
        for block in [*parts.model.blocks, parts.model.final_layer]:
            block.compile(backend=s["compile_backend"])
    return Trainer(prep, parts, RunOutput(run_dir, CheckpointManager(run_dir / "checkpoints"),
                                          MetricsLog(run_dir, 0, main=True, tensorboard=False)))


def _items(s: dict, batch: int, micro: int, device: torch.device) -> list[Batch]:
    g = torch.Generator().manual_seed(0)
    n = s["latent"]
    return [Batch(torch.randn(micro, 4, n, n, generator=g).to(device), torch.randint(0, 1000, (micro,), generator=g)
                  .to(device), torch.arange(micro), []) for _ in range(batch // micro)]


def _fastdit(s: dict, batch: int, device: torch.device):
    """The fast-DiT-style step (see the module docstring); returns a zero-argument step function."""
    torch.manual_seed(0)
    model = dit.create_model(s["model"], input_size=s["latent"], num_classes=1000, **s["overrides"]).to(device)
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0)
    scaler = torch.amp.GradScaler(device.type, enabled=device.type == "cuda")
    diffusion = dit.create_diffusion("")
    x = torch.randn(batch, 4, s["latent"], s["latent"], device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    log: list[float] = []

    def step() -> None:
        t = torch.randint(0, diffusion.num_timesteps, (batch,), device=device)
        with torch.autocast(device.type, dtype=torch.float16, enabled=device.type == "cuda"):
            loss = diffusion.training_losses(model, x, t, model_kwargs={"y": y})["loss"].mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters()):
                e.mul_(0.9999).add_(p.data, alpha=1 - 0.9999)
        log.append(loss.item())

    return step


def _bare_step(tr: Trainer, items: list[Batch]):
    """The compiled model, optimizer and EMA of `tr` without the trainer's bookkeeping: the upper bound
    of what removing the per-step host copy, grad norm and checks could gain."""
    p, diffusion = tr.p, tr.p.diffusion
    x, y = items[0].latents, items[0].labels

    def step() -> None:
        t = torch.randint(0, diffusion.num_timesteps, (x.shape[0],), device=x.device)
        diffusion.training_losses(tr._model_fn, x, t, model_kwargs={"y": y})["loss"].mean().backward()
        p.opt.step()
        ema_update(*p.parallel.ema_pairs(p.ema, p.model), 0.9999)
        p.opt.zero_grad(set_to_none=True)

    return step


def _row(res, name: str, s: dict, batch: int, first: float, per_step: float, steady: float | None,
         flops: float, peak: float | None, device: torch.device, **extra: Any) -> float:
    img_s = batch / per_step
    res.add("train", name, model=s["model"], batch=batch, img_s=img_s, step_ms=per_step * 1e3,
            mfu=(flops * img_s / (peak * 1e12)) if peak else None, tflops=flops * img_s / 1e12,
            peak_mem_gib=_peak_gib(device), first_step_s=first,
            compile_s=(first - steady) if steady is not None else None, **extra)
    return img_s


def _fitting_batch(s: dict, shards: Path, device: torch.device, work: Path) -> int:
    """The largest of 256, 192, 128, 64... (smoke: its batch) that runs one eager step of ours."""
    for batch in [s["batch"]] + [b for b in (192, 128, 64, 32) if b < s["batch"] and device.type == "cuda"]:
        try:
            tr = _trainer(s, shards, device, work, batch=batch, micro=batch, compile_=False, attention="auto")
            tr.train_step(_items(s, batch, batch, device), 0.0)
            return batch
        except torch.cuda.OutOfMemoryError:
            tr = None  # noqa: F841 - frees the model before the next try
            _reset(device)
    raise RuntimeError("not even batch 32 fits")


def train_section(res, s: dict, device: torch.device, shards: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-train-"))
    with torch.device("meta"):
        cfg = dit.create_model(s["model"], input_size=s["latent"], num_classes=1000, **s["overrides"]).config
    flops, peak = float(dit.train_flops_per_image(cfg)), peak_tflops(device)
    batch = _fitting_batch(s, shards, device, work)
    _reset(device)
    try:
        first, per = _timed(_fastdit(s, batch, device), s["steps"], s["warmup"], device)
        ref: float | None = _row(res, "fast-DiT-style fp16 eager", s, batch, first, per, None, flops, peak, device)
    except torch.cuda.OutOfMemoryError:
        ref = None
        res.add("train", "fast-DiT-style fp16 eager", model=s["model"], batch=batch, error="out of memory")
    _reset(device)
    tokens, heads = (cfg["input_size"] // cfg["patch_size"]) ** 2, cfg["num_heads"]
    if device.type == "cuda":
        name, probe = choose_attention("auto", device, batch=batch, heads=heads, tokens=tokens,
                                       head_dim=cfg["hidden_size"] // heads, dtype=torch.bfloat16)
        res.add("train", "attention probe", chosen=name, **{f"{k}_ms": v * 1e3 for k, v in probe.items()})
    backends = [b for b in ("cudnn", "flash", "efficient") if b in available_attention()] \
        if device.type == "cuda" else ["auto"]
    eager: dict[str, float] = {}
    for backend in backends:
        if res.left() < 60:
            break
        _reset(device)
        tr = _trainer(s, shards, device, work, batch=batch, micro=batch, compile_=False, attention=backend)
        items = _items(s, batch, batch, device)
        first, per = _timed(lambda: tr.train_step(items, 0.0), s["steps"], s["warmup"], device)
        eager[backend] = _row(res, f"ours bf16 eager, attention {backend}", s, batch, first, per, None, flops,
                              peak, device, vs_fastdit=batch / per / ref if ref else None)
        del tr, items
    best = max(eager, key=eager.get)
    _reset(device)
    tr = _trainer(s, shards, device, work, batch=batch, micro=batch, compile_=True, attention=best)
    items = _items(s, batch, batch, device)
    first, per = _timed(lambda: tr.train_step(items, 0.0), s["steps"], s["warmup"], device)
    _row(res, f"ours bf16 per-block compile, attention {best}", s, batch, first, per, per, flops, peak, device,
         vs_fastdit=batch / per / ref if ref else None)
    first, per = _timed(_bare_step(tr, items), s["steps"], 1, device)
    _row(res, "same, without per-step bookkeeping (no host copy, no grad norm, no checks)", s, batch, first,
         per, None, flops, peak, device, vs_fastdit=batch / per / ref if ref else None)
    del tr, items
    _memory_table(res, s, shards, device, work, batch, best)


def _memory_table(res, s: dict, shards: Path, device: torch.device, work: Path, batch: int, attention: str) -> None:
    """Peak memory of eager steps at micro-batches batch/4, batch/2, batch -> a train.memory.MEASURED row."""
    peaks: dict[int, float] = {}
    for micro in (batch // 4, batch // 2, batch):
        if res.left() < 30 or micro < 1:
            return
        _reset(device)
        tr = _trainer(s, shards, device, work, batch=batch, micro=micro, compile_=False, attention=attention)
        tr.train_step(_items(s, batch, micro, device), 0.0)
        _sync(device)
        peaks[micro] = _peak_gib(device) or 0.0
        del tr
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    row = memory.table_row(s["model"], s["latent"], "bf16", False, False, peaks, gpu=gpu,
                           date=datetime.date.today().isoformat())
    res.add("train", "memory-table row (eager)", peaks_gib={str(k): v for k, v in peaks.items()}, **row)
