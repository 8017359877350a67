"""bench/gpu.py's text section (issue 37): what caching text features saves on a GPU.

Rows: Qwen3-0.6B's forward on a batch of captions padded to NanoGen's 256 tokens (bf16, its published shape with
random weights: common.text_encoders.TextEncoder.encode, the online mode's call) in captions/s; DiT-XL/2's plain
flow training step at the same batch (bf16 autocast, per-block compile) in images/s; the share of a step with an
online encoder that caching removes (encode / (encode + step)); and `dit-extract --text-encoder`'s steady-state
rate (extract.text.run_text_extract: the extra captions of a 3n-caption set over an n-caption one per extra
second). --smoke runs a tiny Qwen3 and DiT on the CPU.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_s(fn, device: torch.device, *, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _encoder_folder(work: Path, smoke: bool) -> Path:
    from text_storage import _qwen3_folder

    if smoke:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from tests.captions._tiny import make_tiny_qwen3

        return make_tiny_qwen3(work / "qwen3-tiny")
    return _qwen3_folder(work / "qwen3-0.6b", 28)


def _plain_step(s: dict[str, Any], batch: int, device: torch.device):
    """The section's plain flow training step: bench/families.py's, regionally compiled on a GPU."""
    from families import build_step

    return build_step(s["model"], latent=s["latent"], channels=4, batch=batch, device=device, overrides=s["overrides"],
                      compile_backend=s["compile_backend"] if device.type == "cuda" else None)[0]


def text_section(res, s: dict[str, Any], device: torch.device, work: Path) -> None:
    from text_storage import _captioned_set

    from dit_pipeline.common.text_encoders import load_text_encoder
    from dit_pipeline.extract import ExtractConfig
    from dit_pipeline.extract.text import run_text_extract

    smoke = s["vae"] == "tiny"
    work.mkdir(parents=True, exist_ok=True)
    folder = _encoder_folder(work, smoke)
    batch = s["batch"]
    name = "tiny Qwen3" if smoke else "Qwen3-0.6B"
    enc = load_text_encoder(str(folder), max_length=256, device=device)
    caption = " ".join(["a photo of a cat sitting on a red sofa"] * 6)
    captions = [caption] * batch
    t_enc = _best_s(lambda: enc.encode(captions), device, warmup=s["warmup"], iters=s["steps"])
    res.add("text", f"{name} encode, 256 tokens ({enc.identity['dtype']})", batch=batch, captions_s=batch / t_enc,
            step_ms=t_enc * 1e3)
    del enc
    step = _plain_step(s, batch, device)
    t_step = _best_s(step, device, warmup=s["warmup"], iters=s["steps"])
    res.add("text", f"{s['model']} plain flow step", batch=batch, img_s=batch / t_step, step_ms=t_step * 1e3)
    res.add("text", "share of an online-encoder step removed by caching", batch=batch,
            share=t_enc / (t_enc + t_step))
    n = s["batch"] * (2 if smoke else 4)
    small, large = work / "captioned-n", work / "captioned-3n"
    _captioned_set(small, n, max(1, n // 2), 40)
    _captioned_set(large, 3 * n, max(1, n // 2), 40)
    walls = []
    for source in (small, large):
        t0 = time.perf_counter()
        run_text_extract(ExtractConfig(data_path=str(source), out=str(work / f"out-{source.name}"),
                                       text_encoder=str(folder), text_max_length=256, batch_size=batch, quiet=True))
        walls.append(time.perf_counter() - t0)
    res.add("text", f"dit-extract --text-encoder ({name}, steady state)", batch=batch,
            captions_s=2 * n / max(walls[1] - walls[0], 1e-9), wall_s_n=walls[0], wall_s_3n=walls[1])
