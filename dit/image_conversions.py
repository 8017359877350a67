"""The image conversions of the releases' sampling protocols: from the decoder's output to the uint8 images a
release measured its FID on, each with that release's own arithmetic, by name (`CONVERSIONS`). A protocol row names
its conversion (dit/protocol_types.py); evaluate/ reads them through sample/config.py. Pure tensor arithmetic: no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


# Each takes the decoder's images as a float tensor [B, 3, H, W] and returns uint8 [B, H, W, 3] on the CPU, with the
# release's own arithmetic (float -> uint8 truncates toward zero, as torch's .to(uint8) and jnp.astype(uint8) do).

def dit_uint8(x: torch.Tensor) -> torch.Tensor:
    """x in [-1, 1]: clamp(127.5 x + 128, 0, 255), truncated (facebookresearch/DiT sample_ddp.py l.132; SiT,
    LightningDiT's vavae.py, MeanFlow and iMF the same)."""
    return torch.clamp(127.5 * x + 128.0, 0, 255).permute(0, 2, 3, 1).to("cpu", dtype=torch.uint8)


def ddt_uint8(x: torch.Tensor) -> torch.Tensor:
    """x in [-1, 1]: clip((x + 1) 127.5 + 0.5, 0, 255), truncated (MCG-NJU/DDT src/models/vae.py l.79 fp2uint8)."""
    return torch.clip((x + 1) * 127.5 + 0.5, 0, 255).permute(0, 2, 3, 1).to("cpu", dtype=torch.uint8)


def repa_uint8(x: torch.Tensor) -> torch.Tensor:
    """x in [-1, 1]: clamp(255 ((x + 1) / 2), 0, 255), truncated (sihyun-yu/REPA generate.py l.151-154): the
    floor of 255 u, u in [0, 1], where DiT's rounds (about half of the pixel values end one level lower)."""
    return torch.clamp(255.0 * ((x + 1) / 2.0), 0, 255).permute(0, 2, 3, 1).to("cpu", dtype=torch.uint8)


def unit_uint8(u: torch.Tensor) -> torch.Tensor:
    """u in [0, 1] (the decoder's own [0, 1] output): clamp(0, 1) then mul(255), truncated (bytetriper/RAE
    src/sample_ddp.py l.276-277)."""
    return u.clamp(0, 1).mul(255).permute(0, 2, 3, 1).to("cpu", dtype=torch.uint8)


@dataclass(frozen=True)
class Conversion:
    name: str
    domain: str  # "[-1, 1]" (a VAE's decode) or "[0, 1]" (a decoder's own [0, 1] images, e.g. RAE's)
    fn: Callable[[torch.Tensor], torch.Tensor]
    source: str

    def __call__(self, images: torch.Tensor, unit: torch.Tensor | None = None) -> torch.Tensor:
        """images in [-1, 1] (a diffusers VAE's `decode(z).sample`); `unit`: the decoder's own [0, 1] images where it
        has them (RAE's decoder), else (images + 1) / 2 for a [0, 1] conversion."""
        if self.domain == "[-1, 1]":
            return self.fn(images.float())
        return self.fn((unit if unit is not None else (images.float() + 1) / 2).float())


CONVERSIONS: dict[str, Conversion] = {c.name: c for c in (
    Conversion("dit", "[-1, 1]", dit_uint8, "facebookresearch/DiT sample_ddp.py l.132"),
    Conversion("ddt", "[-1, 1]", ddt_uint8, "MCG-NJU/DDT src/models/vae.py l.78-80"),
    Conversion("repa", "[-1, 1]", repa_uint8, "sihyun-yu/REPA generate.py l.151-154"),
    Conversion("rae", "[0, 1]", unit_uint8, "bytetriper/RAE src/sample_ddp.py l.276-277"),
    # NanoGen decodes to [0, 1] ((x + 1) / 2 for a VAE, src/stage1/vae.py l.239), then RAE's arithmetic
    Conversion("nanogen", "[0, 1]", unit_uint8, "End2End-Diffusion/diffusion-bench src/eval/generation.py l.167-168"),
)}


def conversion(name: str) -> Conversion:
    if name not in CONVERSIONS:
        raise ValueError(f"unknown image conversion {name!r}; choose one of: {', '.join(CONVERSIONS)}")
    return CONVERSIONS[name]
