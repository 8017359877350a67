"""Benchmark: sampling throughput of dit-sample against a straightforward reference-style loop.

Both run in the same process on the same model, side by side (interleaved when repeated), for DDPM-250
and DDIM-50 with classifier-free guidance:
- reference: the reference sampler's structure: the doubled batch [z; z] with labels [y; null] through
  `model.forward_with_cfg` inside dit's loop, one un-compiled float32 model call per step, global RNG;
- ours: `sample.generate.sample_latents` as dit-sample runs it: the loop holds the conditional half,
  per-sample noise generators (seed, index), autocast precision and optionally torch.compile.
The VAE decode (the SD-VAE architecture with random weights, at the bench's image size) is timed
separately, one image at a time as dit-sample decodes and batched, and added to the end-to-end figures.
Throughput is images/s; TFLOP/s counts 2 x the analytic forward MACs x 2 (CFG) x steps.

    python bench/sample.py                                   # CPU: DiT-S/2 on 8x8 latents, batch 4
    python bench/sample.py --model DiT-XL/2 --input-size 32 --batch 64 --precision bf16 --compile  # GPU
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_checkout  # noqa: E402

use_checkout()  # run from a checkout without installing

import torch  # noqa: E402

from dit_pipeline import dit  # noqa: E402
from dit_pipeline.common.precision import AUTOCAST_DTYPES  # noqa: E402
from dit_pipeline.common.vae import SD_VAE_CONFIG, build_sd_vae  # noqa: E402
from dit_pipeline.sample.generate import (decode_latents, guided_model_fn, make_diffusion,  # noqa: E402
                             sample_latents)
from dit_pipeline.sample.plan import noise_generators  # noqa: E402

MODES = {"ddpm250": ("ddpm", 250), "ddim50": ("ddim", 50)}
FID_SAMPLES = 50_000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="DiT-S/2")
    p.add_argument("--input-size", type=int, default=8, help="latent size (image size / 8)")
    p.add_argument("--batch", type=int, default=4, help="images per batch (the model sees 2x with CFG)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--cfg-scale", type=float, default=4.0)
    p.add_argument("--precision", default=None, choices=list(AUTOCAST_DTYPES),
                   help="our sampler's autocast (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--compile", action="store_true", help="torch.compile our sampler's model")
    p.add_argument("--no-tf32", action="store_true", help="keep float32 matmuls exact on GPU (default: TF32 "
                   "on, as the reference sampler sets)")
    p.add_argument("--repeat", type=int, default=1, help="interleaved rounds; medians are reported")
    p.add_argument("--no-decode", action="store_true", help="skip the VAE decode timing")
    p.add_argument("--device", default=None)
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--diffusers-residual", action="store_true",
                   help="instead: how far stock diffusers (timestep shift 1) is from DiT on the exported model")
    return p.parse_args(argv)


def build_model(name: str, input_size: int, device: torch.device) -> dit.DiT:
    """A preset DiT with non-zero adaLN/output weights (a fresh DiT outputs zeros; cost is the same)."""
    torch.manual_seed(0)
    model = dit.create_model(name, input_size=input_size).to(device).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "adaLN" in key or "final_layer.linear" in key:
                p.normal_(0, 0.02)
    return model


def _timed(fn, device: torch.device) -> tuple[float, object]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - start, out


def reference_loop(model: dit.DiT, diffusion, sampler: str, batch: int, cfg_scale: float,
                   device: torch.device) -> torch.Tensor:
    """The reference sampler's shape of work: doubled batch, forward_with_cfg per step, fp32, global RNG."""
    s = model.input_size
    z = torch.randn(batch, model.in_channels, s, s, device=device)
    y = torch.randint(0, model.num_classes, (batch,), device=device)
    z2, y2 = torch.cat([z, z]), torch.cat([y, torch.full_like(y, model.num_classes)])
    loop = diffusion.ddim_sample_loop if sampler == "ddim" else diffusion.p_sample_loop
    with torch.no_grad():
        out = loop(model.forward_with_cfg, z2.shape, noise=z2, clip_denoised=False,
                   model_kwargs={"y": y2, "cfg_scale": cfg_scale})
    return out[:batch]


def ours_loop(model: dit.DiT, model_fn, diffusion, sampler: str, batch: int, device: torch.device) -> torch.Tensor:
    """dit-sample's path: half-batch loop, model_fn doubling for CFG, one noise generator per sample."""
    y = torch.randint(0, model.num_classes, (batch,), device=device)
    return sample_latents(model, diffusion, y, noise_generators(0, range(batch)), sampler=sampler,
                          model_fn=model_fn)


def bench_modes(args: argparse.Namespace, device: torch.device, precision: str) -> tuple[list[dict], torch.Tensor]:
    ref_model = build_model(args.model, args.input_size, device)
    our_model = copy.deepcopy(ref_model)  # compiled or not, never shared with the reference loop
    model_fn = guided_model_fn(our_model, cfg_scale=args.cfg_scale, cfg_channels="3",
                               autocast_dtype=AUTOCAST_DTYPES[precision], compile=args.compile)
    macs = dit.forward_macs(ref_model.config)
    rows, latents = [], None
    for mode in args.modes:
        sampler, steps = MODES[mode]
        diffusion = make_diffusion(sampler, steps)
        warm = make_diffusion(sampler, 2)
        ours_loop(our_model, model_fn, warm, sampler, args.batch, device)  # compile, kernel selection
        reference_loop(ref_model, warm, sampler, args.batch, args.cfg_scale, device)
        times: dict[str, list[float]] = {"reference": [], "ours": []}
        for _ in range(args.repeat):
            t, _ = _timed(lambda: reference_loop(ref_model, diffusion, sampler, args.batch, args.cfg_scale,
                                                 device), device)
            times["reference"].append(t)
            t, latents = _timed(lambda: ours_loop(our_model, model_fn, diffusion, sampler, args.batch, device),
                                device)
            times["ours"].append(t)
        flops = 2 * macs * 2 * steps * args.batch
        base = statistics.median(times["reference"])
        for variant, prec, comp in (("reference", "fp32", False), ("ours", precision, args.compile)):
            sec = statistics.median(times[variant])
            rows.append({"mode": mode, "variant": variant, "precision": prec, "compile": comp,
                         "batch": args.batch, "seconds": sec, "img_s": args.batch / sec, "ratio": base / sec,
                         "tflops": flops / sec / 1e12})
    return rows, latents


def bench_decode(latents: torch.Tensor, device: torch.device, repeat: int) -> dict:
    """Seconds per image for our one-image-at-a-time decode and for one batched call."""
    vae = build_sd_vae().to(device).eval().requires_grad_(False)
    scale = SD_VAE_CONFIG["scaling_factor"]
    with torch.no_grad():
        decode_latents(vae, latents[:1], scaling_factor=scale)  # warm-up
        per_image = [_timed(lambda: decode_latents(vae, latents, scaling_factor=scale), device)[0]
                     for _ in range(repeat)]
        batched = [_timed(lambda: vae.decode(latents / scale).sample, device)[0] for _ in range(repeat)]
    n = latents.shape[0]
    return {"per_image_s": statistics.median(per_image) / n, "batched_s": statistics.median(batched) / n}


def diffusers_residual(name: str, input_size: int, batch: int, device: torch.device) -> None:
    """Output of the exported DiTTransformer2DModel, stock (downscale_freq_shift=1) and with DiT's
    frequencies (shift 0), against our model on the same inputs."""
    from dit_pipeline.sample.export import build_diffusers_transformer, set_dit_timestep_frequencies

    model = build_model(name, input_size, device)
    transformer = build_diffusers_transformer(model.state_dict(), model.config).to(device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, model.in_channels, input_size, input_size, generator=g).to(device)
    y = torch.randint(0, model.num_classes, (batch,), generator=g).to(device)
    print(f"# {name}, {input_size}x{input_size} latents, batch {batch}, fp32: diffusers DiTTransformer2DModel vs "
          "our DiT (DiT init, adaLN and output layers N(0, 0.02))")
    print("| t | stock: rel. L2 | stock: max abs | shift 0: max abs |")
    print("|---|---|---|---|")
    for step in (0, 10, 100, 250, 500, 999):
        t = torch.full((batch,), step, device=device)
        with torch.no_grad():
            ours = model(x, t, y)
            for b in transformer.transformer_blocks:
                b.norm1.emb.time_proj.downscale_freq_shift = 1
            stock = transformer(x, timestep=t, class_labels=y).sample
            set_dit_timestep_frequencies(transformer)
            exact = transformer(x, timestep=t, class_labels=y).sample
        print(f"| {step} | {((stock - ours).norm() / ours.norm()).item():.2e} | "
              f"{(stock - ours).abs().max().item():.2e} | {(exact - ours).abs().max().item():.2e} |")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    mode = "ieee" if args.no_tf32 else "tf32"
    torch.backends.cuda.matmul.fp32_precision = torch.backends.cudnn.conv.fp32_precision = mode
    name = dit.canonical_model_name(args.model)
    if args.diffusers_residual:
        diffusers_residual(name, args.input_size, args.batch, device)
        return
    print(f"# {name} on {args.input_size}x{args.input_size} latents ({args.input_size * 8}px), batch "
          f"{args.batch}, cfg {args.cfg_scale}; device: {_device_name(device)}; repeat {args.repeat}")
    rows, latents = bench_modes(args, device, precision)
    decode = None if args.no_decode else bench_decode(latents, device, args.repeat)
    print("| sampler | variant | precision | compile | img/s | ratio vs reference | model TFLOP/s | "
          "img/s with decode | hours for 50K (1 device) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        per_img = r["seconds"] / r["batch"] + (decode["per_image_s"] if decode else 0.0)
        r["img_s_with_decode"], r["hours_50k"] = 1.0 / per_img, FID_SAMPLES * per_img / 3600
        print(f"| {r['mode']} | {r['variant']} | {r['precision']} | {'on' if r['compile'] else 'off'} | "
              f"{r['img_s']:.3g} | {r['ratio']:.2f} | {r['tflops']:.3g} | {r['img_s_with_decode']:.3g} | "
              f"{r['hours_50k']:.3g} |")
    if decode:
        print(f"# VAE decode: {decode['per_image_s'] * 1e3:.1f} ms/image one at a time (dit-sample), "
              f"{decode['batched_s'] * 1e3:.1f} ms/image batched ({args.batch} per call)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "decode": decode}, indent=2))


if __name__ == "__main__":
    main()
