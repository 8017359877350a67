"""bench/gpu.py's extraction, sampling and loader sections, and the synthetic shard set they share."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from dit_pipeline import dit
from dit_pipeline.common.vae import build_sd_vae
from dit_pipeline.extract.encode import LatentEncoder
from dit_pipeline.sample.generate import guided_model_fn, make_diffusion
from dit_pipeline.shards import FORMAT_VERSION, Manifest, ShardWriter, sample_key, shard_name, write_manifest
from dit_pipeline.train.data import EpochStream, make_loader
from dit_pipeline.train.shard_source import open_shards
from dit_pipeline.train.partition import plan_epoch
from dit_pipeline.train.speed import regional_compile

TINY_VAE = dict(in_channels=3, out_channels=3, latent_channels=4, down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 16, 16), layers_per_block=1,
                norm_num_groups=4, act_fn="silu", sample_size=32, scaling_factor=0.5)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_shards(folder: Path, *, shards: int, per_shard: int, latent: int) -> None:
    """`shards` x `per_shard` float16 posterior samples (one view) of 4 x latent x latent, 1000 classes."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    records = []
    for i in range(shards):
        with ShardWriter(folder / shard_name(i), dtype="float16") as w:
            mean = rng.standard_normal((per_shard, 1, 4, latent, latent), dtype=np.float32)
            for k in range(per_shard):
                key = i * per_shard + k
                w.write(sample_key(key), label=key % 1000, meta={}, mean=mean[k], std=np.full_like(mean[k], 0.1))
            records.append(w.close())
    write_manifest(folder, Manifest(
        format_version=FORMAT_VERSION, tool_version="bench", extraction={"vae": {"source": "bench"}},
        scaling_factor=0.18215, shift_factor=None, image_size=8 * latent, views=1, store="posterior",
        dtype="float16", latent_shape=[4, latent, latent], class_names=[f"c{c}" for c in range(1000)],
        num_classes=1000, total_samples=shards * per_shard, samples_per_shard=per_shard, shards=records, skipped=[]))


# ----------------------------------------------------------------------------------------------------------
# Extraction

def _vae(s: dict, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    if s["vae"] == "tiny":
        from diffusers import AutoencoderKL

        return AutoencoderKL(**TINY_VAE).to(device).eval()
    return build_sd_vae().to(device).eval()  # the SD-VAE architecture, random weights: the real cost


def _baseline(res, s: dict, device: torch.device, vae: torch.nn.Module, pixels: torch.Tensor) -> float:
    """fast-DiT-style: one image at a time, fp32, one view, posterior sample x scaling factor, .cpu()."""
    sf = float(vae.config.scaling_factor)
    n = s["baseline_images"]
    with torch.no_grad():
        for warm in (True, False):
            _sync(device)
            t0 = time.perf_counter()
            for i in range(1 if warm else n):
                x = pixels[i:i + 1].to(device).permute(0, 3, 1, 2).float().div(255).sub(0.5).div(0.5)
                vae.encode(x).latent_dist.sample().mul(sf).cpu()
            _sync(device)
    rate = n / (time.perf_counter() - t0)
    res.add("extract", "baseline fp32 batch 1, one view", encodes_s=rate, images=n)
    return rate


def _encoder_rate(s: dict, device: torch.device, vae, pixels: torch.Tensor, *, precision: str, views: int,
                  compile_: bool, deterministic: bool = True) -> tuple[float, float]:
    """(seconds of the first batch incl. compile, steady encodes/s) through LatentEncoder, pipelined."""
    enc = LatentEncoder(vae, device=device, precision=precision, views=views, compile=False)
    if compile_:
        vae.encoder.compile(backend="inductor" if s["vae"] == "sd" else "eager", dynamic=False)
    if device.type == "cuda" and not deterministic:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, True
    b = s["enc_batch"]
    batch = pixels[:b].pin_memory() if device.type == "cuda" else pixels[:b]
    t0 = time.perf_counter()
    enc.submit(batch, list(range(b))).arrays()
    first = time.perf_counter() - t0
    enc.submit(batch, list(range(b))).arrays()
    t0 = time.perf_counter()
    pending = None
    for k in range(s["enc_batches"]):
        nxt = enc.submit(batch, list(range(k * b, (k + 1) * b)))
        if pending is not None:
            pending.arrays()
        pending = nxt
    pending.arrays()
    rate = s["enc_batches"] * b * views / (time.perf_counter() - t0)
    if compile_:  # back to eager for the next configuration
        vae.encoder._compiled_call_impl = None
    if device.type == "cuda":
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    return first, rate


def extract_section(res, s: dict, device: torch.device) -> None:
    vae = _vae(s, device)
    g = torch.Generator().manual_seed(0)
    n = max(s["enc_batch"], s["baseline_images"])
    pixels = torch.randint(0, 256, (n, s["image"], s["image"], 3), dtype=torch.uint8, generator=g)
    base = _baseline(res, s, device, vae, pixels)
    vae_rates: dict[str, float] = {}
    precisions = ("bf16", "fp16") if device.type == "cuda" else ("fp32",)
    configs = [(p, v, False, True) for p in precisions for v in (1, 2)]
    configs += [(p, 2, True, True) for p in precisions] + [(precisions[0], 2, False, False)]
    for precision, views, comp, det in configs:
        if res.left() < 25:
            break
        first, rate = _encoder_rate(s, device, vae, pixels, precision=precision, views=views, compile_=comp,
                                    deterministic=det)
        name = (f"ours {precision} {'compiled' if comp else 'eager'} {views} view(s)"
                f"{'' if det else ', cuDNN autotuned (not deterministic)'}")
        res.add("extract", name, batch=s["enc_batch"], encodes_s=rate, vs_baseline=rate / base, first_batch_s=first)
        if views == 2 and not comp and det:
            vae_rates[precision] = rate
    features_rows(res, s, device, pixels, vae_rates)


def _feature_encoder(s: dict, device: torch.device):
    """DINOv2-B with registers by RAE's formula (common/features.py), random weights; a tiny one for --smoke."""
    import json
    import tempfile

    from dit_pipeline.common.features import load_feature_encoder

    if s["vae"] != "tiny":
        return load_feature_encoder("dinov2-b-reg", pretrained=False, device=device, image_size=s["image"])[0]
    spec = Path(tempfile.mkdtemp(prefix="bench-enc-")) / "enc.json"
    spec.write_text(json.dumps({"model": "vit_base_patch14_reg4_dinov2", "input_size": 28,
                                "model_args": {"embed_dim": 32, "depth": 2, "num_heads": 2}}))
    return load_feature_encoder(str(spec), pretrained=False, device=device, image_size=s["image"])[0]


def features_rows(res, s: dict, device: torch.device, pixels: torch.Tensor, vae_rates: dict[str, float]) -> None:
    """Feature encodes/s (2 views, eager, deterministic) beside the SD-VAE's at the same precision (issue #32)."""
    enc_model = _feature_encoder(s, device)
    b = s["enc_batch"]
    batch = pixels[:b].pin_memory() if device.type == "cuda" else pixels[:b]
    for precision, vae_rate in vae_rates.items():
        if res.left() < 15:
            break
        enc = LatentEncoder(enc_model, device=device, precision=precision, views=2, store="sample", unit_range=True)
        enc.submit(batch, list(range(b))).arrays()
        t0 = time.perf_counter()
        pending = None
        for k in range(s["enc_batches"]):
            nxt = enc.submit(batch, list(range(k * b, (k + 1) * b)))
            if pending is not None:
                pending.arrays()
            pending = nxt
        pending.arrays()
        rate = s["enc_batches"] * b * 2 / (time.perf_counter() - t0)
        res.add("extract", f"DINOv2-B reg features {precision} eager 2 view(s)", batch=b, encodes_s=rate,
                vs_sd_vae=rate / vae_rate)


# ----------------------------------------------------------------------------------------------------------
# Sampling

def sample_section(res, s: dict, device: torch.device) -> None:
    torch.manual_seed(0)
    model = dit.create_model(s["model"], input_size=s["latent"], num_classes=1000, **s["overrides"]).to(device)
    model.eval()
    regional_compile(model, backend="inductor" if device.type == "cuda" else "eager")
    dtype = torch.bfloat16 if device.type == "cuda" else None
    fn = guided_model_fn(model, cfg_scale=4.0, autocast_dtype=dtype)
    diffusion = make_diffusion("ddpm", 250)
    b, lat = s["sample_batch"], s["latent"]
    x = torch.randn(b, 4, lat, lat, device=device)
    y = torch.randint(0, 1000, (b,), device=device)

    def step(i: int) -> torch.Tensor:
        t = torch.full((b,), 249 - i, device=device, dtype=torch.long)
        return diffusion.p_sample(fn, x, t, model_kwargs={"y": y})["sample"]

    with torch.no_grad():
        _sync(device)
        t0 = time.perf_counter()
        step(0)
        _sync(device)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(1, 1 + s["sample_steps"]):
            x = step(i)
        _sync(device)
    per_step = (time.perf_counter() - t0) / s["sample_steps"]
    img_s = b / (per_step * 250)
    res.add("sample", "DDPM-250 CFG 4 bf16 per-block compile (latents; VAE decode not included)", batch=b,
            step_ms=per_step * 1e3, img_s=img_s, fid50k_hours=50_000 / img_s / 3600, first_step_s=first)


# ----------------------------------------------------------------------------------------------------------
# Loader

def loader_section(res, s: dict, folder: Path) -> None:
    write_shards(folder, shards=s["loader_shards"], per_shard=s["loader_per_shard"], latent=s["loader_latent"])
    src = open_shards(str(folder))
    workers, batch = s["loader_workers"], s["loader_batch"]
    plan = plan_epoch(src.sizes, seed=0, epoch=0, world_size=1, workers=workers, micro_batch=batch, accum=1)
    stream = EpochStream(src, plan, 0, seed=0, buffer=1000)
    loader = make_loader(stream, num_workers=workers, prefetch_factor=4, pin_memory=torch.cuda.is_available())
    t_start = time.perf_counter()
    counts: list[tuple[float, int]] = []
    for item in loader:
        counts.append((time.perf_counter(), getattr(item, "latents", torch.empty(0)).shape[0]))
    skip = len(counts) // 4  # start-up (worker spawn, first shards) excluded
    t0 = counts[skip][0]
    n = sum(c for _, c in counts[skip + 1:])
    rate = n / max(counts[-1][0] - t0, 1e-9)
    res.add("loader", f"latents/s, {workers} workers, batch {batch}", latents_s=rate, batches=len(counts),
            startup_s=counts[0][0] - t_start)

