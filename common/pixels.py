"""Pixels as a latent space: the "tokenizer" of a pixel-space model (JiT, NanoGen's JiT-DDT and PixelGen), whose
encoder and decoder are the identity, behind the same seam as a VAE (common/vae.py) and a feature encoder
(common/features.py), so that extraction, training, sampling, the grids and FID need no case of their own.

The formula is NanoGen's `PixelEncoder` (End2End-Diffusion/diffusion-bench src/stage1/pixel.py): the uint8 crop
to [0, 1] (ToTensor: x / 255 in float32), then x * 2 - 1, giving [-1, 1]; bit for bit what the VAE path's
`(x / 255 - 0.5) / 0.5` gives (dit-extract's `to_model_input`: both round x / 255 once, and scaling by 2 or by
1 / 0.5 is exact). Decoding is the identity; the image conversion to uint8 is the sampler's, as for any VAE.

`dit-extract --encoder pixels` stores no arrays for such a set: its latent is the stored crop itself (shard store
"pixels", docs/FORMAT.md), and the trainer's loader makes the [-1, 1] latent of each sample's view from it
(`to_latent`). `load_vae("pixels")` is the decoder a pixel checkpoint records.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

PIXELS = "pixels"  # the --encoder / --vae name, and the identity's `kind` and `source`
FORMULA = "x = (p / 255) * 2 - 1 in float32 (NanoGen's PixelEncoder: ToTensor, then x * 2 - 1); view 1 the mirror"


def is_pixel_space(spec: str | None) -> bool:
    return spec == PIXELS


@dataclass
class _Out:
    latent: torch.Tensor | None = None
    sample: torch.Tensor | None = None


class PixelSpace(nn.Module):
    """The identity tokenizer: `encode(x).latent` = x and `decode(z).sample` = z for [-1, 1] images [B, 3, H, W]."""

    def __init__(self) -> None:
        super().__init__()
        # no weights; an empty parameter carries the device and dtype the decoding code asks a VAE for
        self.anchor = nn.Parameter(torch.zeros(0), requires_grad=False)

    def encode(self, x: torch.Tensor) -> _Out:
        return _Out(latent=x)

    def decode(self, z: torch.Tensor) -> _Out:
        return _Out(sample=z)


def pixel_identity(image_size: int) -> dict[str, Any]:
    """What manifests and checkpoints record of a pixel space (the fields extract/ and sample/ read of a VAE's)."""
    return {"kind": PIXELS, "class": "PixelSpace", "source": PIXELS, "formula": FORMULA, "input_range": "-1,1",
            "latent_channels": 3, "downsample_factor": 1, "encoder_output": "latent", "scaling_factor": 1.0,
            "shift_factor": None, "image_size": int(image_size)}


def load_pixel_space(image_size: int = 256, device: torch.device | str = "cpu") -> tuple[PixelSpace, dict[str, Any]]:
    """(PixelSpace on `device`, its identity), as `load_vae` and `load_feature_encoder` return theirs."""
    return PixelSpace().to(device).eval(), pixel_identity(image_size)


def to_latent(crops: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 [B, H, W, 3] crops -> float32 [B, 3, H, W] in [-1, 1]: (p / 255) * 2 - 1, one exactly rounded float32
    operation at a time (so a sample's values do not depend on its batch). `out`: where to write."""
    src = torch.from_numpy(np.ascontiguousarray(crops)).permute(0, 3, 1, 2)
    x = out if out is not None else torch.empty(src.shape, dtype=torch.float32)
    return x.copy_(src).div_(255.0).mul_(2.0).sub_(1.0)
