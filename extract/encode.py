"""Batched VAE encoding of cropped uint8 images into posterior mean/std (or a posterior sample, or the latent
of an encoder without a posterior).

Follows docs/REFERENCE.md: pixels to [-1, 1] exactly like ToTensor then Normalize(0.5, 0.5) (x/255, -0.5,
/0.5 in float32, bit-identical to torchvision), the second view is the exact horizontal mirror of the crop,
and the posterior is diffusers' `DiagonalGaussianDistribution` as the VAE computes it (mean, and
std = exp(0.5 * logvar) after its clamp), stored unscaled: the manifest carries the normalization
(common/latent_norm.py) for whoever turns them into model latents. An encoder whose `encode` returns a
deterministic `.latent` (AutoencoderDC; common.vae.encode_latents) has no posterior: its latent is stored
as it is (`--store sample`, no noise added).

Speed: uint8 crops travel to the GPU (4x fewer bytes than float) from pinned memory with non-blocking
copies, the model and input are `channels_last`, the encoder runs under `torch.inference_mode` and
autocast, and results come back through pinned buffers while the next batch is already running.

`compile=True` compiles the VAE encoder in place with static shapes (an option: bench/gpu.py measures it).

Determinism: cuDNN autotuning is off and only deterministic algorithms are used, TF32 is off for fp32, so
the same batch gives the same bits in every run (what makes resumed shards byte-identical). A batch that
comes out non-finite under fp16/bf16 (an overflow) is encoded again in fp32, deterministically.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dit_pipeline.common.log import get_logger
from dit_pipeline.common.errors import UserError
from dit_pipeline.common.precision import AUTOCAST_DTYPES, set_tf32
from dit_pipeline.common.seeding import derive_seed
from dit_pipeline.common.vae import encode_latents

# Our own seed stream for `--store sample` noise: seed = derive_seed(seed, STREAM, global_index).
STREAM_EXTRACT_SAMPLE = 101

log = get_logger()


def to_model_input(pixels: torch.Tensor, views: int, unit_range: bool = False) -> torch.Tensor:
    """uint8 [b, H, W, 3] -> float32 [views*b, 3, H, W] in [-1, 1] ([0, 1]: x/255 with `unit_range`, a feature
    encoder's input, common/features.py), channels_last.

    Rows [0, b) are the crops, rows [b, 2b) their exact horizontal mirrors.
    """
    x = pixels.permute(0, 3, 1, 2).float()  # a channels_last view of the NHWC bytes
    x = x.div_(255.0) if unit_range else x.div_(255.0).sub_(0.5).div_(0.5)
    if views == 2:
        x = torch.cat([x, x.flip(-1)])
    return x.contiguous(memory_format=torch.channels_last)


@dataclass
class Pending:
    """One submitted batch; `arrays()` waits for it and returns float32 numpy [b, V, C, h, w] arrays."""

    encoder: "LatentEncoder | None"
    indices: list[int]
    x: torch.Tensor | None             # the model input, kept for an fp32 re-encode if needed
    mean: torch.Tensor | None          # host tensors, valid once `event` has completed
    std: torch.Tensor | None
    finite: torch.Tensor | None
    event: "torch.cuda.Event | None"

    def arrays(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        if self.mean is None:
            return None, None
        if self.event is not None:
            self.event.synchronize()
        if not bool(self.finite) and self.encoder is not None and self.encoder.precision != "fp32":
            # fp32 output that is not finite is left as is: the ShardWriter refuses it with the key.
            assert self.encoder is not None and self.x is not None
            self.mean, self.std = self.encoder.reencode_fp32(self.x, self.indices)
        self.x = None
        return self.mean.numpy(), (self.std.numpy() if self.std is not None else None)


class LatentEncoder:
    """Wraps the VAE: `submit(pixels, indices)` starts a batch, `Pending.arrays()` waits for its result."""

    def __init__(self, vae: torch.nn.Module, *, device: torch.device, precision: str, views: int,
                 store: str = "posterior", seed: int = 0, compile: bool = False,
                 latent_shape: tuple[int, ...] | None = None, unit_range: bool = False):
        if precision not in AUTOCAST_DTYPES:
            raise ValueError(f"precision must be one of {sorted(AUTOCAST_DTYPES)}, got {precision!r}")
        # channels_last for 2-D convolutions; a VAE may prefer another (Qwen-Image's 3-D convolutions: a layout
        # of common/latent_spaces.py says so)
        fmt = getattr(vae, "preferred_memory_format", torch.channels_last)
        self.vae = vae.to(device=device, memory_format=fmt).eval().requires_grad_(False)
        self.device = device
        self.precision = precision
        self.views = views
        self.store = store
        self.seed = seed
        self.unit_range = unit_range  # a feature encoder takes [0, 1] pixels (common/features.py)
        self.latent_shape = tuple(latent_shape) if latent_shape is not None else None  # checked on every batch
        self.fp32_retries = 0
        if compile:
            # In place (names unchanged), static shapes: fixed batch shapes compile once per shape and
            # autocast dtype (an fp32 re-encode of an overflowed batch compiles once more).
            getattr(self.vae, "encoder", self.vae).compile(dynamic=False)
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = False
            torch.backends.cudnn.deterministic = True
            if precision == "fp32":
                set_tf32(False)

    def _posterior(self, x: torch.Tensor, precision: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(mean, std) of the posterior, or (latent, None) for an encoder without one."""
        dtype = AUTOCAST_DTYPES[precision]
        with torch.autocast(self.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            mean, std = encode_latents(self.vae, x)
        if self.latent_shape is not None and tuple(mean.shape[1:]) != self.latent_shape:
            raise UserError(f"the VAE encoded {x.shape[-1]} px crops to latents of shape {list(mean.shape[1:])}, "
                            f"not the {list(self.latent_shape)} its config implies (latent channels and "
                            "downsampling factor); nothing of this batch was written")
        return mean.float(), None if std is None else std.float()

    def _views_first(self, t: torch.Tensor, b: int) -> torch.Tensor:
        # [views*b, C, h, w] -> [b, views, C, h, w] (view v of image i is row v*b + i)
        return t.view(self.views, b, *t.shape[1:]).transpose(0, 1).contiguous()

    def _noise(self, indices: list[int], shape: tuple[int, ...]) -> torch.Tensor:
        # One generator per image: the noise of an image depends on (seed, index) only, never on batching.
        out = torch.empty((len(indices), *shape), dtype=torch.float32)
        for row, index in enumerate(indices):
            g = torch.Generator().manual_seed(derive_seed(self.seed, STREAM_EXTRACT_SAMPLE, index))
            out[row] = torch.randn(shape, generator=g)
        return out.to(self.device, non_blocking=True)

    def _outputs(self, x: torch.Tensor, indices: list[int], precision: str):
        mean, std = self._posterior(x, precision)
        finite = torch.isfinite(mean).all() & (torch.isfinite(std).all() if std is not None else True)
        b = len(indices)
        mean = self._views_first(mean, b)
        if std is None or self.store == "mode":  # a deterministic encoder's latent, or the posterior's mean
            assert self.store in ("sample", "mode"), "an encoder without a posterior stores its latent"
            return mean, None, finite
        std = self._views_first(std, b)
        if self.store == "sample":
            return mean + std * self._noise(indices, tuple(mean.shape[1:])), None, finite
        return mean, std, finite

    @torch.inference_mode()
    def submit(self, pixels: torch.Tensor | None, indices: list[int]) -> Pending:
        """Start encoding `pixels` (uint8 [b, H, W, 3], pinned on CUDA) of the images `indices`."""
        if pixels is None or len(indices) == 0 or self.store == "pixels":  # a pixel-space set stores no encoding
            return Pending(None, [], None, None, None, None, None)
        x = to_model_input(pixels.to(self.device, non_blocking=True), self.views, self.unit_range)
        mean, std, finite = self._outputs(x, indices, self.precision)
        if self.device.type != "cuda":
            return Pending(self, indices, x, mean, std, finite, None)
        # Device -> pinned host copies queued behind the encode; the host collects them one batch later.
        host = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                for t in (mean, std, finite)]
        event = torch.cuda.Event()
        event.record()
        return Pending(self, indices, x, host[0], host[1], host[2], event)

    @torch.inference_mode()
    def reencode_fp32(self, x: torch.Tensor, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fallback for a batch that overflowed under fp16/bf16: the same batch in fp32 (host tensors)."""
        log.warning("non-finite %s posterior for images %d..%d; encoding this batch again in fp32",
                    self.precision, indices[0], indices[-1])
        self.fp32_retries += 1
        mean, std, _ = self._outputs(x, indices, "fp32")
        return mean.cpu(), None if std is None else std.cpu()
