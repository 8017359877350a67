"""bench/gpu.py's parallel section: the trainer's step under --parallel ddp, zero2 and fsdp on ONE GPU.

One GPU cannot show sharding's saving, only its cost: on a world of one, FSDP2's all-gathers and reduce-scatters
are copies, and every rank still holds the whole state, so the rows measure the FSDP code path with its overhead
(images/s against DDP's, peak memory). The per-GPU memory at N GPUs is then PROJECTED, not measured: the measured
peak minus the (N - 1) / N of the model state sharding removes (fp32 weights, gradients, AdamW's moments, the EMA:
20 bytes per parameter), labelled as a projection in its row. The model state's 1/N law itself is measured on
several CPU ranks by bench/fsdp_memory.py.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from dit_pipeline import dit
from dit_pipeline.common import distributed as dist
from dit_pipeline.common import sharding
from gpu_train import _items, _peak_gib, _reset, _timed, _trainer  # noqa: E402 (bench/ on sys.path)


def parallel_section(res: Any, s: dict, device: torch.device, shards: Path) -> None:
    problem = sharding.sharding_problem()
    if problem:
        res.add("parallel", "skipped", reason=problem)
        return
    work = Path(tempfile.mkdtemp(prefix="bench-parallel-"))
    batch = s["parallel_batch"]
    with torch.device("meta"):
        model = dit.create_model(s["model"], input_size=s["latent"], num_classes=1000, **s["overrides"])
    params = sum(p.numel() for p in model.parameters())
    state_gib = 20 * params / 2**30  # fp32 weights, gradients, AdamW moments, EMA
    dist.init(single=True)  # a DeviceMesh needs a process group, here of one rank
    try:
        ddp_rate = None
        for mode in ("ddp", "zero2", "fsdp"):
            if res.left() < 40:
                break
            _reset(device)
            tr = _trainer(s, shards, device, work, batch=batch, micro=batch, compile_=s["compile_backend"] == "inductor",
                          attention="auto", extra={"parallel": mode, "run_dir": str(work / f"run-{mode}")})
            items = _items(s, batch, batch, device)
            first, per = _timed(lambda: tr.train_step(items, 0.0), s["steps"], s["warmup"], device)
            rate = batch / per
            ddp_rate = rate if mode == "ddp" else ddp_rate
            peak = _peak_gib(device)
            res.add("parallel", f"{mode} on 1 GPU (the code path and its overhead)", model=s["model"], batch=batch,
                    img_s=rate, step_ms=per * 1e3, first_step_s=first, peak_mem_gib=peak,
                    vs_ddp=rate / ddp_rate if ddp_rate else None)
            if peak is not None and mode != "ddp":
                res.add("parallel", f"{mode} at 8 and 64 GPUs (PROJECTED from the 1-GPU peak, not measured)",
                        model=s["model"], batch=batch, state_gib=state_gib,
                        projected_8_gib=peak - state_gib * 7 / 8, projected_64_gib=peak - state_gib * 63 / 64)
            del tr, items
    finally:
        dist.destroy()
