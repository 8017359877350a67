"""Every GPU number BENCHMARKS.md asks for, in ONE process sized to a 15-minute GPU window (bench/gpu.sh).

Sections, most important first; each result row is appended to OUT/results.jsonl (and printed as a markdown
row) the moment it is measured, so a run killed at its time limit keeps everything it measured:

  train     our training step (train.run.build_model + the Trainer's own train_step: bf16 autocast, fused
            AdamW, foreach-lerp EMA, loss/grad-norm bookkeeping) vs a fast-DiT-style step written here from
            its description (fp16 AMP + GradScaler, eager, EMA parameter by parameter, loss.item() every
            step) at DiT-XL/2 batch 256 or the largest that fits; ours eager with each SDPA backend and ours
            with per-block compile; images/s, MFU, peak memory, compile time; then the memory-table row
            (train.memory.MEASURED) from peaks at three micro-batch sizes
  extract   SD-VAE encodes/s through extract.encode.LatentEncoder (steady state, start-up excluded) vs the
            one-image fp32 baseline; eager vs compiled, fp16 vs bf16, one view vs both flips, and the cost of
            cuDNN determinism; DINOv2-B's feature encodes/s (RAE's formula, common/features.py) beside them
  sample    DDPM-250 with CFG 4 at batch 256 in bf16 with per-block compile: images/s (projected from timed
            denoising steps) and hours for FID-50K
  fid       docs/evaluation.md's FID-50K recipe as it runs (bench/gpu_fid.py): dit-sample's defaults (fp32 + TF32,
            eager, batch 32, cfg 1.5, one-image VAE decodes) and dit-eval's Inception pass (batch 64) over
            50,000 samples and the 10,000-image reference batch; projected hours on 1 and 8 GPUs
  loader    the training loader's latents/s with 16 workers on a synthetic shard set
  repa      REPA's cost (bench/repa.py): the DINOv2 ViT-B/14 teacher forward, the plain flow step and the step
            with teacher + projector + loss at the training size, and the step on cached tokens (dit-train --repa
            FOLDER); images/s, MFU, peak memory, their ratios
  families  the flow training step of LightningDiT-XL/1 (VA-VAE 32x16x16 latents) and RAE's DiT-DH-XL (768x16x16
            DINOv2 features), bf16, per-block compile (bench/families.py); images/s, MFU, peak memory
  text      caching text features (bench/gpu_text.py): Qwen3-0.6B's encode of a batch at 256 tokens, DiT-XL/2's
            plain step at that batch, the share of an online-encoder step that caching removes, and the steady-state
            captions/s of dit-extract --text-encoder
  context   NanoGen's in-context DiT-DH: the flow step with 8 class tokens (t4c8) vs 256 text tokens (bench/context.py);
            images/s, MFU, peak memory, the ratio beside the FLOP ratio
  meanflow  DiT-XL/2's --objective meanflow step (plain and with training guidance) vs its flow step, the JVP pass
            (math attention, the only kernel with forward-mode AD) and the forward with the default and the math
            kernel (bench/meanflow_step.py); images/s, MFU, peak memory, the ratio
  parallel  the trainer's step under --parallel ddp, zero2 and fsdp on one GPU (bench/gpu_parallel.py: FSDP2's code
            path and its overhead; the per-GPU memory at 8 and 64 GPUs projected, labelled so)

    bash bench/gpu.sh                        # on the GPU machine (<= 8 minutes)
    python bench/gpu.py --smoke --out DIR    # tiny sizes on a CPU (the test suite runs this)
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

PREFLIGHT = ("numpy", "torch", "diffusers", "webdataset", "safetensors", "click", "yaml", "tqdm", "PIL", "timm")


def preflight() -> None:
    """Import everything first: a missing package fails the run in seconds, not after minutes of work."""
    missing = []
    for name in PREFLIGHT:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - report every failure, whatever it is
            missing.append(f"{name} ({type(e).__name__}: {e})")
    if missing:
        sys.exit("preflight: cannot import " + "; ".join(missing) + " (carry wheels: make gpu-wheels)")


preflight()

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_checkout  # noqa: E402

use_checkout()

from dit_pipeline.train.metrics import peak_tflops  # noqa: E402
from context import context_section  # noqa: E402
from families import families_section  # noqa: E402
from gpu_fid import fid_section  # noqa: E402
from gpu_sections import extract_section, loader_section, sample_section, write_shards  # noqa: E402
from gpu_text import text_section  # noqa: E402
from gpu_train import train_section  # noqa: E402
from gpu_parallel import parallel_section  # noqa: E402
from meanflow_step import meanflow_section  # noqa: E402
from repa import repa_section  # noqa: E402


class Results:
    """Appends one JSON row per measurement to OUT/results.jsonl (flushed and synced at once)."""

    def __init__(self, out: Path, deadline: float):
        self.out, self.deadline = out, deadline
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "results.jsonl"
        self.rows: list[dict[str, Any]] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def add(self, section: str, name: str, **values: Any) -> None:
        row = {"section": section, "name": name, **values}
        self.rows.append(row)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
        shown = " | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())
        print(f"| {section} | {name} | {shown} |", flush=True)

    def section(self, name: str, fn: Callable[[], None], need_s: float) -> None:
        """Run a section unless too little time is left; an error becomes a row, not the end of the run."""
        if self.left() < need_s:
            self.add(name, "skipped", reason=f"{self.left():.0f}s left, the section needs ~{need_s:.0f}s")
            return
        t0 = time.monotonic()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the next sections still run
            self.add(name, "error", error=f"{type(e).__name__}: {str(e)[:500]}")
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        print(f"# section {name}: {time.monotonic() - t0:.1f}s", flush=True)


def sizes(smoke: bool) -> dict[str, Any]:
    if smoke:  # tiny everything, CPU, well under 2 minutes on a loaded 2-core machine
        return {"model": "DiT-S/2", "overrides": {"depth": 2, "hidden_size": 64, "num_heads": 2}, "latent": 8,
                "batch": 4, "steps": 2, "warmup": 1, "compile_backend": "eager", "vae": "tiny", "image": 32,
                "enc_batch": 4, "enc_batches": 2, "baseline_images": 2, "sample_batch": 2, "sample_steps": 2,
                "loader_shards": 4, "loader_per_shard": 16, "loader_workers": 2, "loader_batch": 8, "loader_latent": 8,
                "fid_batch": 2, "fid_steps": 2, "inception_batch": 4, "inception_batches": 2, "inception_size": 75,
                "parallel_batch": 4}
    return {"model": "DiT-XL/2", "overrides": {}, "latent": 32, "batch": 256, "steps": 8, "warmup": 2,
            "compile_backend": "inductor", "vae": "sd", "image": 256, "enc_batch": 64, "enc_batches": 12,
            "baseline_images": 48, "sample_batch": 256, "sample_steps": 6, "loader_shards": 64,
            "loader_per_shard": 256, "loader_workers": 16, "loader_batch": 256, "loader_latent": 32,
            "fid_batch": None, "fid_steps": 10, "inception_batch": None, "inception_batches": 8, "inception_size": 299,
            "parallel_batch": 64}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench-gpu-out", help="folder for results.jsonl")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, runs on a CPU")
    p.add_argument("--budget-s", type=float, default=450.0, help="stop starting sections after this long")
    p.add_argument("--only", nargs="+", choices=["train", "extract", "sample", "fid", "loader", "repa", "families", "meanflow",
                                                 "text", "context", "parallel"], default=None)
    a = p.parse_args(argv)
    t_start = time.monotonic()
    res = Results(Path(a.out), t_start + a.budget_s)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type != "cuda" and not a.smoke:
        sys.exit("no GPU visible: bench/gpu.py measures GPUs (use --smoke to check the script on a CPU)")
    s = sizes(a.smoke)
    res.add("env", "machine", date=datetime.date.today().isoformat(), torch=torch.__version__,
            device=torch.cuda.get_device_name(0) if device.type == "cuda" else f"{platform.machine()} CPU",
            cuda=torch.version.cuda, peak_tflops=peak_tflops(device), smoke=a.smoke)
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    want = set(a.only or ["train", "extract", "sample", "fid", "loader", "repa", "families", "meanflow", "text", "context",
                          "parallel"])
    try:
        shards = work / "shards"
        write_shards(shards, shards=1, per_shard=2 * s["batch"], latent=s["latent"])
        if "train" in want:
            res.section("train", lambda: train_section(res, s, device, shards), 120)
        if "extract" in want:
            res.section("extract", lambda: extract_section(res, s, device), 60)
        if "sample" in want:
            res.section("sample", lambda: sample_section(res, s, device), 40)
        if "fid" in want:
            res.section("fid", lambda: fid_section(res, s, device), 60)
        if "loader" in want:
            res.section("loader", lambda: loader_section(res, s, work / "loader"), 30)
        if "repa" in want:
            res.section("repa", lambda: repa_section(res, s, device), 90)
        if "families" in want:
            res.section("families", lambda: families_section(res, s, device), 60)
        if "meanflow" in want:
            res.section("meanflow", lambda: meanflow_section(res, s, device), 60)
        if "text" in want:
            res.section("text", lambda: text_section(res, s, device, work / "text"), 60)
        if "context" in want:
            res.section("context", lambda: context_section(res, s, device), 60)
        if "parallel" in want:
            res.section("parallel", lambda: parallel_section(res, s, device, shards), 60)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res.add("env", "done", wall_s=time.monotonic() - t_start,
            errors=sum(r["name"] == "error" for r in res.rows), skipped=sum(r["name"] == "skipped" for r in res.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
