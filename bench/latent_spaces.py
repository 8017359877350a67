"""Benchmark: every latent space of NanoGen's matrix (issue 44 item 2), encoded once against online.

For each architecture (one row per distinct network; NanoGen names sharing it are listed):
  bytes    bytes per sample as dit-extract stores it by default (float16; a VAE's posterior mean + std, a feature
           encoder's latent; both views), from a real 8-sample shard of arrays of the space's shape (tar and .npy
           headers, label and meta included), and per view
  encode   images/s of one 256 px view through extract.encode.LatentEncoder as dit-extract runs it, timed in
           pairs with the SD-VAE encoder (SD-VAE, space, SD-VAE, space, ...: each ratio from back-to-back runs,
           so a load change between pairs does not bias it), best of --repeat pairs
  FLOPs    GFLOP per 256 px view (torch.utils.flop_counter: convolutions and matmuls, 2 per multiply-add; the
           CPU's fused attention, which the counter leaves at 0, from its shapes), and what NanoGen's online
           encoding costs per training step: that times its global batch of 1024 (every NanoGen training config:
           training.global_batch_size), one view per image, in float32 (src/stage2/engine.py encodes outside
           autocast)

Real geometries with random weights (the cost does not depend on them; no weights can be downloaded here): the
diffusers classes at the published configs (SD-VAE, SD3.5/FLUX.1's 16-channel KL-f8, AutoencoderKLFlux2's and
AutoencoderKLQwenImage's defaults, which are FLUX.2's and Qwen-Image's; VA-VAE as an AutoencoderKL f16 with 32
channels, ch 128, ch_mult 1,1,2,2,4, two blocks: LightningDiT's published VA-VAE geometry, assumed for REPA-E's
e2e-vavae-hf), timm's DINOv2-B reg, DINOv3-B/16 and PE-L ViTs, transformers' SigLIP at siglip2-base-patch16-256's
config: each built by the loader dit-extract uses, so the formula around the network is the one timed.

    python bench/latent_spaces.py --repeat 2 --threads 2
    python bench/latent_spaces.py --only flux2,pe-vit-l --repeat 1      # a subset (SD-VAE always runs)
    python bench/latent_spaces.py --static                              # bytes per sample, DiT step FLOPs
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_checkout  # noqa: E402

use_checkout()

from dit_pipeline.common.latent_spaces import Patchified, SingleFrame  # noqa: E402
from dit_pipeline.common.nanogen_encoders import load_encoder_space  # noqa: E402
from dit_pipeline.common.vae import build_sd_vae  # noqa: E402
from dit_pipeline.extract.encode import LatentEncoder  # noqa: E402
from dit_pipeline.shards import ShardWriter, sample_key  # noqa: E402

NANOGEN_BATCH = 1024  # training.global_batch_size of every configs/stage2/training/*/*.yaml


def kl(**kw: Any):
    from diffusers import AutoencoderKL

    base = dict(block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2, latent_channels=4)
    base.update(kw)
    return AutoencoderKL(**base)


def flux2():
    from diffusers import AutoencoderKLFlux2

    return Patchified(AutoencoderKLFlux2())


def qwen():
    from diffusers import AutoencoderKLQwenImage

    return SingleFrame(AutoencoderKLQwenImage())


def encoder(name: str) -> Callable[[], Any]:
    return lambda: load_encoder_space(name, pretrained=False, image_size=256)[0]


# (row label, NanoGen names, builder, "posterior" | "sample", the DiT's latent [C, h, w] at 256 px)
SPACES: list[tuple[str, str, Callable[[], Any], str, tuple[int, int, int]]] = [
    ("SD-VAE (KL-f8, 4 ch)", "sdvae-ema, sdvae-mse, sdxl-vae, e2e-sdvae-mse", build_sd_vae, "posterior", (4, 32, 32)),
    ("KL-f8, 16 ch", "sd3.5, flux, e2e-sd3.5, e2e-flux",
     lambda: kl(latent_channels=16, use_quant_conv=False, use_post_quant_conv=False), "posterior", (16, 32, 32)),
    ("FLUX.2 (patchified 2x2)", "flux2", flux2, "posterior", (128, 16, 16)),
    ("Qwen-Image (one frame)", "qwen-vae, e2e-qwen-vae", qwen, "posterior", (16, 32, 32)),
    ("VA-VAE (KL-f16, 32 ch)", "e2e-vavae",
     lambda: kl(block_out_channels=(128, 128, 256, 256, 512), down_block_types=("DownEncoderBlock2D",) * 5,
                up_block_types=("UpDecoderBlock2D",) * 5, latent_channels=32), "posterior", (32, 16, 16)),
    ("DINOv2-B reg (224 px)", "dinov2-vit-b", encoder("dinov2-vit-b"), "sample", (768, 16, 16)),
    ("DINOv3-B/16 (256 px)", "dinov3-vit-b16", encoder("dinov3-vit-b16"), "sample", (768, 16, 16)),
    ("SigLIP2-B/16 (256 px)", "siglip2-vit-b", encoder("siglip2-vit-b"), "sample", (768, 16, 16)),
    ("PE-Core-L/14 (224 px)", "pe-vit-l", encoder("pe-vit-l"), "sample", (1024, 16, 16)),
    ("PE-Lang-L/14 (224 px)", "langpe-vit-l", encoder("langpe-vit-l"), "sample", (1024, 16, 16)),
    ("PE-Spatial-L/14 (224 px)", "spatialpe-vit-l", encoder("spatialpe-vit-l"), "sample", (1024, 16, 16)),
]


def latent_encoder(model: Any, store: str) -> LatentEncoder:
    return LatentEncoder(model, device=torch.device("cpu"), precision="fp32", views=1, store=store,
                         unit_range=store == "sample")


def _sdpa_flops(q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    b, h, length, e = q
    return 2 * b * h * length * k[-2] * e + 2 * b * h * length * k[-2] * v[-1]


def gflop(enc: LatentEncoder, pixels: torch.Tensor) -> float:
    """GFLOP of one view of one image (also the warm-up run)."""
    from torch.utils.flop_counter import FlopCounterMode

    ops = torch.ops.aten
    mapping = {op: _sdpa_flops for op in (getattr(ops, "_scaled_dot_product_flash_attention_for_cpu", None),)
               if op is not None}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        enc.submit(pixels[:1], [0]).arrays()
    return counter.get_total_flops() / 1e9


def seconds(enc: LatentEncoder, pixels: torch.Tensor) -> float:
    t0 = time.perf_counter()
    enc.submit(pixels, list(range(len(pixels)))).arrays()
    return time.perf_counter() - t0


def sample_bytes(shape: tuple[int, int, int], store: str, views: int, folder: Path, name: str) -> int:
    """Bytes of one float16 sample in a shard (members and tar headers): an 8-sample shard, / 8."""
    z = np.zeros((views, *shape), np.float32)
    arrays = {"mean": z, "std": z} if store == "posterior" else {"latent": z}
    path = folder / f"{name}.tar"
    with ShardWriter(path, dtype="float16") as w:
        for i in range(8):
            w.write(sample_key(i), label=i, meta={"path": f"n01440764/n01440764_{i:05d}.JPEG"}, **arrays)
        rec = w.close()
    return rec.bytes // 8


def dit_step_tflop(shape: tuple[int, int, int]) -> float:
    """TFLOP of one NanoGen training step of its DiT-DH (ddt-en28d1152hd72-dn2d2048hd128, patch 2 on 32 x 32
    latents and 1 on 16 x 16, as its configs) on this latent: the family's forward MACs x 2 FLOP x 3 (forward
    and backward) x the global batch of 1024."""
    from dit_pipeline import dit

    c, h, _ = shape
    with torch.device("meta"):
        m = dit.create_model("ddt-en28d1152hd72-dn2d2048hd128", input_size=h, in_channels=c,
                             patch_size=2 if h == 32 else 1, num_classes=1000)
    return type(m).forward_macs(m.config) * 2 * 3 * NANOGEN_BATCH / 1e12


def static_table() -> dict[str, Any]:
    """Bytes per sample of every space, float16, both views and one: a VAE's posterior (mean + std, the default
    --store) and its one latent (--store mode, NanoGen's), a feature encoder's latent; ImageNet-1k train
    (1,281,167 images) in GiB at the smaller one with both views; and NanoGen's DiT step on that latent."""
    folder = Path(tempfile.mkdtemp(prefix="bench-latent-bytes-"))
    out: dict[str, Any] = {}
    print(f"{'space':26s} {'latent':>12s} {'posterior 2v':>13s} {'posterior 1v':>13s} {'latent 2v':>10s} "
          f"{'latent 1v':>10s} {'IN-1k GiB':>10s} {'DiT step TFLOP':>15s}")
    for label, names, _, store, shape in SPACES:
        post = [sample_bytes(shape, "posterior", v, folder, f"p{v}") for v in (2, 1)] if store == "posterior" \
            else [None, None]
        lat = [sample_bytes(shape, "sample", v, folder, f"l{v}") for v in (2, 1)]
        step = dit_step_tflop(shape)
        out[label] = {"nanogen": names, "latent": list(shape), "posterior": post, "latent_only": lat,
                      "dit_step_tflop": step}
        fmt = lambda b: f"{b:,d}" if b is not None else "-"  # noqa: E731
        print(f"{label:26s} {'x'.join(map(str, shape)):>12s} {fmt(post[0]):>13s} {fmt(post[1]):>13s} "
              f"{fmt(lat[0]):>10s} {fmt(lat[1]):>10s} {lat[0] * 1_281_167 / 2 ** 30:10.1f} {step:15.1f}")
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2, help="timed (SD-VAE, space) pairs per space")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default=None, help="comma-separated NanoGen names (rows that list one of them)")
    ap.add_argument("--json", default=None, help="also write the numbers to this file")
    ap.add_argument("--static", action="store_true", help="only what needs no encoder run: bytes per sample and "
                    "NanoGen's DiT step FLOPs per space")
    a = ap.parse_args(argv)
    if a.static:
        return static_table()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    pixels = torch.randint(0, 256, (1, 256, 256, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    folder = Path(tempfile.mkdtemp(prefix="bench-latent-spaces-"))
    want = set(a.only.split(",")) if a.only else None
    rows = [r for r in SPACES if r is SPACES[0] or want is None or want & {n.strip() for n in r[1].split(",")}]
    load0 = os.getloadavg()[0]
    base = latent_encoder(SPACES[0][2](), "posterior")
    base_gflop = gflop(base, pixels)
    out: dict[str, Any] = {"rows": [], "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                           "threads": a.threads}
    print(f"# CPU fp32, 1 view of a 256 px image, {a.threads} thread(s), best of {a.repeat} (SD-VAE, space) pairs; "
          f"torch {torch.__version__}")
    print(f"{'space':26s} {'NanoGen names':44s} {'B/sample':>9s} {'B/view':>8s} {'img/s':>7s} {'vs SD-VAE':>9s} "
          f"{'per pair':>16s} {'GFLOP':>7s} {'TFLOP/step':>10s}")
    for label, names, build, store, shape in rows:
        enc = base if label == SPACES[0][0] else latent_encoder(build(), store)
        g = base_gflop if enc is base else gflop(enc, pixels)
        pairs = []
        for _ in range(a.repeat):
            t_base = seconds(base, pixels)
            t = t_base if enc is base else seconds(enc, pixels)
            pairs.append((t_base, t))
        best = min(t for _, t in pairs)
        ratios = [tb / t for tb, t in pairs]
        b2, b1 = (sample_bytes(shape, store, v, folder, f"{label[:6]}{v}") for v in (2, 1))
        row = {"space": label, "nanogen": names, "latent": list(shape), "store": store, "bytes_2_views": b2,
               "bytes_1_view": b1, "images_per_s": 1 / best, "vs_sdvae": float(np.mean(ratios)), "ratios": ratios,
               "gflop_per_view": g, "tflop_per_nanogen_step": g * NANOGEN_BATCH / 1e3}
        out["rows"].append(row)
        print(f"{label:26s} {names:44s} {b2:9,d} {b1:8,d} {1 / best:7.3f} {float(np.mean(ratios)):8.2f}x "
              f"{','.join(f'{r:.2f}' for r in ratios):>16s} {g:7.1f} {row['tflop_per_nanogen_step']:10.1f}")
        if enc is not base:
            del enc
            gc.collect()
    out["load_average"] = [load0, os.getloadavg()[0]]
    print(f"# load average {load0:.1f} before, {out['load_average'][1]:.1f} after (the machine is shared)")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
