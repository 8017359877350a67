"""bench/gpu.py's FID section: what docs/evaluation.md's FID-50K recipe (`dit-sample` then `dit-eval`) costs on this GPU.

Measured with the recipe's own settings and code paths, not the fastest ones: `dit-sample`'s defaults (fp32
with TF32 matmuls, eager, batch 32 per GPU, deterministic cuDNN) at guidance 1.5 through `sample_latents`
(per-sample noise generators, CFG doubling the network batch) for a few DDPM steps, projected to 250; the
SD-VAE decode one image at a time (`decode_latents`, as dit-sample decodes); the Inception network
(`evaluate.inception`, random weights of the real architecture) at dit-eval's default batch 64 through
`batch_features`. The projection splits the work as the tools do (fixed chunks, chunk k on rank k % W) and
leaves out file I/O (writing the parts, assembling the 9.8 GB npz, reading it) and start-up.
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch

from dit_pipeline import dit
from dit_pipeline.common.determinism import deterministic_cuda
from dit_pipeline.common.precision import set_tf32
from dit_pipeline.evaluate.config import EvalConfig
from dit_pipeline.evaluate.features import batch_features
from dit_pipeline.evaluate.inception import load_inception
from dit_pipeline.sample.config import SampleConfig
from dit_pipeline.sample.generate import decode_latents, make_diffusion, sample_latents
from dit_pipeline.sample.plan import noise_generators

SAMPLES, REFERENCE = 50_000, 10_000  # FID-50K; the ADM reference batch's images (features cached afterwards)
RECIPE_STEPS, RECIPE_CFG = 250, 1.5


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def project_fid50k(*, step_s: float, decode_s: float, inception_img_s: float, batch: int, inception_batch: int,
                   gpus: int, samples: int = SAMPLES, reference: int = REFERENCE,
                   steps: int = RECIPE_STEPS) -> dict[str, float]:
    """Hours of the recipe on `gpus` GPUs: the busiest rank's chunks (ceil(chunks / gpus), each a full batch)
    of `steps` denoising steps plus `batch` one-image decodes, then Inception over the samples and the
    reference batch, each side in its own batches split the same way."""
    chunk_s = steps * step_s + batch * decode_s
    sample_s = math.ceil(math.ceil(samples / batch) / gpus) * chunk_s
    eval_batches = sum(math.ceil(math.ceil(n / inception_batch) / gpus) for n in (samples, reference))
    eval_s = eval_batches * inception_batch / inception_img_s
    return {"gpus": gpus, "dit_sample_h": sample_s / 3600, "dit_eval_h": eval_s / 3600,
            "total_h": (sample_s + eval_s) / 3600}


def _sampling(s: dict, device: torch.device, batch: int) -> tuple[float, float]:
    """(seconds per DDPM step of one batch, seconds per decoded image) with dit-sample's defaults."""
    from gpu_sections import _vae

    torch.manual_seed(0)
    model = dit.create_model(s["model"], input_size=s["latent"], num_classes=1000, **s["overrides"]).to(device).eval()
    vae = _vae(s, device)
    labels = torch.arange(batch, device=device) % 1000

    def denoise(steps: int) -> tuple[float, torch.Tensor]:
        diffusion = make_diffusion("ddpm", steps)
        _sync(device)
        t0 = time.perf_counter()
        latents = sample_latents(model, diffusion, labels, noise_generators(0, range(batch)), cfg_scale=RECIPE_CFG)
        _sync(device)
        return time.perf_counter() - t0, latents

    denoise(2)  # warm-up: kernels, cuBLAS handles
    seconds, latents = denoise(s["fid_steps"])
    scale = float(vae.config.scaling_factor)
    decode_latents(vae, latents[:1], scaling_factor=scale)  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    decode_latents(vae, latents, scaling_factor=scale)
    _sync(device)
    return seconds / s["fid_steps"], (time.perf_counter() - t0) / batch


def _meanflow_sampling(s: dict, device: torch.device, batch: int, steps: int) -> float:
    """Seconds of one batch of `steps`-step mean-flow sampling (dit-sample --sampler meanflow: one network
    evaluation per step, no CFG doubling) with the same network as the DDPM row, its second time input added."""
    torch.manual_seed(0)
    model = dit.create_model(s["model"], input_size=s["latent"], num_classes=1000, learn_sigma=False,
                             conditions="meanflow", **s["overrides"]).to(device).eval()
    labels = torch.arange(batch, device=device) % 1000

    def run() -> float:
        _sync(device)
        t0 = time.perf_counter()
        sample_latents(model, make_diffusion("meanflow", steps), labels, noise_generators(0, range(batch)),
                       sampler="meanflow", cfg_scale=1.0)
        _sync(device)
        return time.perf_counter() - t0

    run()  # warm-up
    return run()


def _inception(s: dict, device: torch.device, batch: int) -> float:
    """Images/s of dit-eval's feature pass (uint8 in, pool/spatial/logits out on the CPU)."""
    model, _ = load_inception(None, device=device, random_seed=0, input_size=s["inception_size"])
    model.eval()
    g = np.random.default_rng(0)
    images = g.integers(0, 256, (batch, s["image"], s["image"], 3), dtype=np.uint8)
    batch_features(model, images, device)  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(s["inception_batches"]):
        batch_features(model, images, device)
    _sync(device)
    return s["inception_batches"] * batch / (time.perf_counter() - t0)


def fid_section(res, s: dict, device: torch.device) -> None:
    set_tf32(SampleConfig.tf32)  # dit-sample's default, set as it sets it
    if device.type == "cuda":
        deterministic_cuda()  # as dit-sample does on a GPU
    batch = s["fid_batch"] or SampleConfig.batch_size  # None: the tools' default batch sizes
    step_s, decode_s = _sampling(s, device, batch)
    res.add("fid", f"dit-sample as the recipe runs it: DDPM cfg {RECIPE_CFG} fp32+TF32 eager (latents)", batch=batch,
            step_ms=step_s * 1e3, img_s=batch / (step_s * RECIPE_STEPS), timed_steps=s["fid_steps"])
    res.add("fid", "SD-VAE decode one image at a time (dit-sample)", batch=batch, img_s=1 / decode_s)
    inc_batch = s["inception_batch"] or EvalConfig.batch_size
    inc = _inception(s, device, inc_batch)
    res.add("fid", f"Inception features, batch {inc_batch} (dit-eval)", batch=inc_batch, img_s=inc,
            input_size=s["inception_size"])
    for gpus in (1, 8):
        hours = project_fid50k(step_s=step_s, decode_s=decode_s, inception_img_s=inc, batch=batch,
                               inception_batch=inc_batch, gpus=gpus)
        res.add("fid", f"FID-50K recipe projected, {gpus} GPU(s) (no file I/O)", **hours)
    for steps in (1, 2):  # MeanFlow (issue #33): the same projection with the measured n-step mean-flow batch
        mf_s = _meanflow_sampling(s, device, batch, steps)
        res.add("fid", f"MeanFlow {steps}-step sampling (dit-sample --sampler meanflow)", batch=batch,
                step_ms=mf_s / steps * 1e3, img_s=batch / mf_s)
        hours = project_fid50k(step_s=mf_s / steps, decode_s=decode_s, inception_img_s=inc, batch=batch,
                               inception_batch=inc_batch, gpus=8, steps=steps)
        res.add("fid", f"FID-50K projected at MeanFlow {steps} step(s), 8 GPUs (no file I/O)",
                vs_250_ddpm=hours["total_h"] / project_fid50k(step_s=step_s, decode_s=decode_s,
                                                               inception_img_s=inc, batch=batch,
                                                               inception_batch=inc_batch, gpus=8)["total_h"],
                **hours)
