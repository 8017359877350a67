"""bench/gpu.py --smoke: the GPU measuring script runs end to end on a CPU, every section writes its rows,
and no section fails (so the script is known to work before it meets a GPU)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _bench_module(name: str):
    """A bench/ script's module, loaded from its file (bench/ is not put on sys.path: its train.py, sample.py...
    would shadow other modules)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


project_fid50k = _bench_module("gpu_fid").project_fid50k


def test_gpu_bench_smoke_writes_every_row(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--smoke", "--out", str(out)],
                       capture_output=True, text=True, timeout=900, cwd=ROOT)  # a hang guard only
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    names = [(row["section"], row["name"]) for row in rows]
    assert ("env", "machine") in names and names[-1] == ("env", "done")
    from dit_pipeline.common.sharding import sharding_problem

    allowed = 0 if sharding_problem() is None else 1  # the floors' torch: the sharded modes' section says why it skips
    assert rows[-1]["errors"] == 0 and rows[-1]["skipped"] == allowed, \
        [r for r in rows if r["name"] in ("error", "skipped")]
    want = {("train", "fast-DiT-style fp16 eager"), ("train", "ours bf16 eager, attention auto"),
            ("train", "ours bf16 per-block compile, attention auto"), ("train", "memory-table row (eager)"),
            ("extract", "baseline fp32 batch 1, one view"), ("extract", "ours fp32 eager 2 view(s)"),
            ("extract", "ours fp32 compiled 2 view(s)"), ("extract", "DINOv2-B reg features fp32 eager 2 view(s)"),
            ("repa", "teacher forward (tiny, no grad)"),
            ("repa", "plain flow step (no REPA)"), ("repa", "REPA step (teacher + projector + loss)"),
            ("repa", "REPA step from cached tokens (projector + loss)"), ("repa", "REPA step online / cached tokens"),
            ("families", "LightningDiT-XL/1 flow step"), ("families", "DiT-DH-XL flow step"),
            ("meanflow", "DiT-S/2 meanflow"), ("meanflow", "DiT-S/2 meanflow guided"),
            ("meanflow", "DiT-S/2 JVP pass (math kernel)"),
            ("text", "tiny Qwen3 encode, 256 tokens (bfloat16)"), ("text", "DiT-S/2 plain flow step"),
            ("text", "share of an online-encoder step removed by caching"),
            ("text", "dit-extract --text-encoder (tiny Qwen3, steady state)"),
            ("context", "t4c8: 8 class tokens flow step"), ("context", "t4 + 256 text tokens flow step"),
            *([("parallel", "ddp on 1 GPU (the code path and its overhead)"),
               ("parallel", "zero2 on 1 GPU (the code path and its overhead)"),
               ("parallel", "fsdp on 1 GPU (the code path and its overhead)")] if not allowed else [])}
    assert want <= set(names), sorted(set(names))
    rates = [row.get("img_s") or row.get("encodes_s") or row.get("latents_s") for row in rows
             if row["section"] in ("train", "extract", "sample", "loader", "repa", "families")
             and "row" not in row["name"]
             and " / " not in row["name"]]  # not the ratio rows ("REPA step / plain step")
    assert len(rates) >= 15 and all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in rates), rates
    sample = next(row for row in rows if row["section"] == "sample")
    assert sample["batch"] == 2 and sample["fid50k_hours"] > 0
    text = {row["name"]: row for row in rows if row["section"] == "text"}
    assert 0 < text["share of an online-encoder step removed by caching"]["share"] < 1
    assert text["dit-extract --text-encoder (tiny Qwen3, steady state)"]["captions_s"] > 0
    ctx = next(row for row in rows if row["name"] == "text step / class step")
    assert ctx["time_ratio"] > 0 and ctx["flops_ratio"] > 1  # 256 text tokens cost more than 8 class tokens
    mf = next(row for row in rows if row["name"] == "meanflow step / flow step")
    assert mf["time_ratio"] > 0 and mf["flops_ratio"] == pytest.approx(5 / 3)
    ratio = next(row for row in rows if row["name"] == "REPA step / plain step")
    assert ratio["time_ratio"] > 0 and ratio["flops_ratio"] > 1
    table = next(row for row in rows if row["name"] == "memory-table row (eager)")
    assert table["key"] == ["DiT-S/2", 8, "bf16", False, False] and set(table["peaks_gib"]) == {"1", "2", "4"}
    # the FID-50K recipe's cost: its three measured parts, then the projection, recomputed here from them
    fid = {row["name"]: row for row in rows if row["section"] == "fid"}
    sampling = fid["dit-sample as the recipe runs it: DDPM cfg 1.5 fp32+TF32 eager (latents)"]
    decode = fid["SD-VAE decode one image at a time (dit-sample)"]
    inception = fid["Inception features, batch 4 (dit-eval)"]
    assert sampling["batch"] == decode["batch"] == 2 and sampling["timed_steps"] == 2
    for gpus in (1, 8):
        got = fid[f"FID-50K recipe projected, {gpus} GPU(s) (no file I/O)"]
        want = project_fid50k(step_s=sampling["step_ms"] / 1e3, decode_s=1 / decode["img_s"],
                              inception_img_s=inception["img_s"], batch=2, inception_batch=4, gpus=gpus)
        assert {k: got[k] for k in want} == pytest.approx(want, rel=1e-9) and got["total_h"] > 0
    ddpm8 = project_fid50k(step_s=sampling["step_ms"] / 1e3, decode_s=1 / decode["img_s"],
                           inception_img_s=inception["img_s"], batch=2, inception_batch=4, gpus=8)
    for steps in (1, 2):  # MeanFlow's 1- and 2-step FID-50K: the same projection at its measured step
        mf = fid[f"MeanFlow {steps}-step sampling (dit-sample --sampler meanflow)"]
        got = fid[f"FID-50K projected at MeanFlow {steps} step(s), 8 GPUs (no file I/O)"]
        want = project_fid50k(step_s=mf["step_ms"] / 1e3, decode_s=1 / decode["img_s"],
                              inception_img_s=inception["img_s"], batch=2, inception_batch=4, gpus=8, steps=steps)
        assert {k: got[k] for k in want} == pytest.approx(want, rel=1e-9)
        assert got["vs_250_ddpm"] == pytest.approx(want["total_h"] / ddpm8["total_h"], rel=1e-9)


def test_fid50k_projection_splits_the_work_as_the_tools_do():
    """Hand-computed: 50,000 samples in batches of 32 are 1563 chunks, 196 on the busiest of 8 ranks, each
    250 steps of 0.1 s plus 32 decodes of 0.01 s; Inception at 1000 images/s in batches of 64: ceil(782 / 8) =
    98 batches of samples and ceil(157 / 8) = 20 of the reference on the busiest rank."""
    got = project_fid50k(step_s=0.1, decode_s=0.01, inception_img_s=1000.0, batch=32, inception_batch=64, gpus=8)
    assert got["dit_sample_h"] == pytest.approx(196 * 25.32 / 3600, rel=1e-12)
    assert got["dit_eval_h"] == pytest.approx(118 * 0.064 / 3600, rel=1e-12)
    assert got["total_h"] == pytest.approx((196 * 25.32 + 118 * 0.064) / 3600, rel=1e-12) and got["gpus"] == 8
    one = project_fid50k(step_s=0.1, decode_s=0.01, inception_img_s=1000.0, batch=32, inception_batch=64, gpus=1)
    assert one["dit_sample_h"] == pytest.approx(1563 * 25.32 / 3600) and one["dit_eval_h"] == pytest.approx(939 * 0.064 / 3600)
