"""NanoGen's VAE latent spaces as data, and the two latent layouts a DiT sees differently from its VAE's output.

NanoGen (End2End-Diffusion/diffusion-bench, the DiffusionBench yardstick) encodes every training image online
through a VAE wrapper (src/stage1/vae.py). This module names each of its VAEs by NanoGen's own `vae_type`
(`VAE_SPACES`: hub id + subfolder, the diffusers class NanoGen loads, its scale overrides), so that `dit-extract
--vae flux2` encodes that space once, into shards, with NanoGen's preprocessing and normalization:

- pixels: [0, 1] -> x * 2 - 1 (vae.py l.196), the same bits as our ToTensor/Normalize(0.5, 0.5) input
  (scaling by 2 commutes with rounding); the posterior's mode (NanoGen's `sample_mode: "mode"`) is our stored
  posterior mean.
- normalization (vae.py l.137-149, `nanogen_normalization`): shift = the config's `latents_mean` where it has
  one, else the preset's `shift_factor`, else the config's; scale = 1 / `latents_std` (float32, no
  `scaling_factor` factor) where the config has it, else the preset's `scaling_factor`, else the config's; then
  x = (z - shift) * scale. Scalars stay our scalar form (exactly NanoGen's two float32 ops); vectors become a
  `scale_shift` record holding NanoGen's float32 values, so x is again bit-identical.
- FLUX.2 (`Flux2VAE`, vae.py l.249-371): AutoencoderKLFlux2's 32 x H/8 x W/8 latent patchified 2 x 2 (channel
  c*4 + 2*dy + dx) to 128 x H/16 x W/16, normalized by the VAE's own BatchNorm running statistics:
  (z - running_mean) / sqrt(running_var + 1e-5) (NanoGen's eps; the diffusers FLUX.2 pipeline adds the config's
  batch_norm_eps, 1e-4, which a VAE loaded from a folder uses). Stored as a `mean_std` record; our x = (z - mean)
  * float32(1 / std) differs from NanoGen's division by at most one float32 rounding.
- Qwen-Image (`QwenVAE`, vae.py l.374-406): AutoencoderKLQwenImage is a video VAE; an image is read as a video of
  ONE frame: [B, 3, H, W] -> [B, 3, 1, H, W] (the VAE encodes a video's first frame alone, then chunks of four,
  its causal convolutions zero-padding the time axis: an image is encoded as a video's first frame), the
  posterior's [B, 16, 1, h, w] mean and log-variance squeezed back to [B, 16, h, w]; decoding unsqueezes the
  latent the same way and squeezes the one decoded frame.

`Patchified` and `SingleFrame` wrap the diffusers VAE so that everyone else (extract/encode.py, the sample
grids, `sample.generate.decode_latents`) keeps seeing `encode(x).latent_dist` with `.mean`/`.std` and
`decode(z).sample` in the DiT's layout; `common.vae.load_vae` picks the wrapper by the VAE's class (`LAYOUTS`),
whether the VAE comes from a preset name, a hub id or a local folder.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dit_pipeline.common.errors import UserError

# The diffusers release that first ships each class (checked against the wheels: 0.34.0 has no QwenImage VAE,
# 0.35.0 has it; 0.35.x has no Flux2, 0.36.0 has it; AutoencoderRAE from 0.37.0). The project's floor stays
# 0.29.2: a class an older diffusers lacks is refused naming this version (common.vae.vae_class).
DIFFUSERS_MIN = {"AutoencoderDC": "0.32", "AutoencoderKLQwenImage": "0.35.0", "AutoencoderKLFlux2": "0.36.0",
                 "AutoencoderRAE": "0.37.0"}
FLUX2_NANOGEN_EPS = 1e-5  # src/stage1/vae.py Flux2VAE(eps=1e-5): sqrt(running_var + eps)


@dataclass(frozen=True)
class VaeSpace:
    """One of NanoGen's VAE_CONFIGS (src/stage1/vae.py l.24-95), the class its wrapper loads and the latent a
    256 px image becomes (misc.latent_size of its training configs)."""

    name: str                        # NanoGen's vae_type
    hub_id: str                      # pretrained_path
    subfolder: str | None            # subfolder ("" in NanoGen: None here)
    cls: str = "AutoencoderKL"       # VAE -> AutoencoderKL, Flux2VAE -> AutoencoderKLFlux2, QwenVAE -> ...QwenImage
    scaling_factor: float | None = None   # NanoGen's override (None: from the config)
    shift_factor: float | None = None
    latent_256: tuple[int, int, int] = (16, 32, 32)  # [C, h, w] at 256 px, as the DiT sees it
    note: str = ""

    @property
    def downsample_factor(self) -> int:
        return 256 // self.latent_256[1]


VAE_SPACES: dict[str, VaeSpace] = {s.name: s for s in (
    VaeSpace("sdvae-ema", "stabilityai/sd-vae-ft-ema", None, scaling_factor=0.18215, shift_factor=0.0,
             latent_256=(4, 32, 32), note="SD-VAE ft-EMA"),
    VaeSpace("sdvae-mse", "stabilityai/sd-vae-ft-mse", None, scaling_factor=0.18215, shift_factor=0.0,
             latent_256=(4, 32, 32), note="SD-VAE ft-MSE"),
    VaeSpace("sdxl-vae", "madebyollin/sdxl-vae-fp16-fix", None, scaling_factor=0.13025, shift_factor=0.0,
             latent_256=(4, 32, 32), note="SDXL's VAE (fp16-fix)"),
    VaeSpace("sd3.5", "stabilityai/stable-diffusion-3.5-large", "vae", note="SD3.5's VAE"),
    VaeSpace("flux", "black-forest-labs/FLUX.1-dev", "vae", note="FLUX.1's VAE"),
    VaeSpace("flux2", "black-forest-labs/FLUX.2-dev", "vae", cls="AutoencoderKLFlux2", latent_256=(128, 16, 16),
             note="FLUX.2's VAE, patchified 2 x 2, BatchNorm statistics"),
    VaeSpace("qwen-vae", "Qwen/Qwen-Image", "vae", cls="AutoencoderKLQwenImage",
             note="Qwen-Image's video VAE, one frame"),
    VaeSpace("e2e-flux", "REPA-E/e2e-flux-vae", None, note="REPA-E's end-to-end tuned FLUX.1 VAE"),
    VaeSpace("e2e-sd3.5", "REPA-E/e2e-sd3.5-vae", None, note="REPA-E's end-to-end tuned SD3.5 VAE"),
    VaeSpace("e2e-vavae", "REPA-E/e2e-vavae-hf", None, latent_256=(32, 16, 16),
             note="REPA-E's end-to-end tuned VA-VAE (f16, 32 channels)"),
    VaeSpace("e2e-qwen-vae", "REPA-E/e2e-qwenimage-vae", None, cls="AutoencoderKLQwenImage",
             note="REPA-E's end-to-end tuned Qwen-Image VAE, one frame"),
    VaeSpace("e2e-sdvae-mse", "REPA-E/e2e-sdvae-hf", None, latent_256=(4, 32, 32),
             note="REPA-E's end-to-end tuned SD-VAE"),
)}


def is_vae_space(spec: str | None) -> bool:
    return spec is not None and spec in VAE_SPACES


# ---------------------------------------------------------------------------------------------------------
# Layouts: the DiT's view of a VAE whose latent is not already [B, C, h, w] at the DiT's grid


@dataclass
class _Posterior:
    mean: torch.Tensor
    std: torch.Tensor


@dataclass
class _Encoded:
    latent_dist: _Posterior


@dataclass
class _Decoded:
    sample: torch.Tensor


class Layout(nn.Module):
    """A diffusers VAE seen in the DiT's layout: `encode(x [B, 3, H, W]).latent_dist` (.mean, .std) and
    `decode(z).sample`; `describe(eps)` gives the identity fields and the VAE's own normalization record."""

    preferred_memory_format = torch.channels_last

    def __init__(self, vae: nn.Module):
        super().__init__()
        self.vae = vae

    @property
    def config(self) -> Any:
        return self.vae.config

    @property
    def encoder(self) -> nn.Module:  # what `dit-extract --compile` compiles
        return self.vae.encoder

    def encode(self, x: torch.Tensor) -> _Encoded:
        dist = self._encode(x).latent_dist
        return _Encoded(_Posterior(self.to_dit(dist.mean), self.to_dit(dist.std)))

    def decode(self, z: torch.Tensor) -> _Decoded:
        return _Decoded(self._decode(self.from_dit(z)))

    # the layout itself
    def _encode(self, x: torch.Tensor) -> Any:
        return self.vae.encode(x)

    def _decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(z).sample

    def to_dit(self, z: torch.Tensor) -> torch.Tensor:
        return z

    def from_dit(self, z: torch.Tensor) -> torch.Tensor:
        return z

    def describe(self, eps: float | None = None) -> dict[str, Any]:
        raise NotImplementedError


class Patchified(Layout):
    """FLUX.2: the 32-channel latent patchified 2 x 2 into 128 channels at half the side (NanoGen's
    Flux2VAE._patchify, the diffusers FLUX.2 pipeline's _patchify_latents), normalized by the VAE's BatchNorm
    running statistics."""

    def __init__(self, vae: nn.Module):
        super().__init__(vae)
        p = tuple(int(v) for v in vae.config.get("patch_size", (2, 2)))
        self.patch = (p[0], p[1])

    def to_dit(self, z: torch.Tensor) -> torch.Tensor:
        b, c, h, w = z.shape
        ph, pw = self.patch
        z = z.view(b, c, h // ph, ph, w // pw, pw).permute(0, 1, 3, 5, 2, 4)
        return z.reshape(b, c * ph * pw, h // ph, w // pw)

    def from_dit(self, z: torch.Tensor) -> torch.Tensor:
        b, c4, h, w = z.shape
        ph, pw = self.patch
        c = c4 // (ph * pw)
        return z.view(b, c, ph, pw, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c, h * ph, w * pw)

    def describe(self, eps: float | None = None) -> dict[str, Any]:
        """128 channels, downsampling 16; the mean/std record of the BatchNorm statistics with `eps` (None: the
        config's batch_norm_eps, as diffusers' FLUX.2 pipeline)."""
        cfg = self.vae.config
        ph, pw = self.patch
        eps = float(cfg.get("batch_norm_eps", 1e-4)) if eps is None else float(eps)
        bn = self.vae.bn
        std = torch.sqrt(bn.running_var.detach().float().cpu() + eps)  # float32, as NanoGen and the pipeline
        record = {"form": "mean_std", "mean": [float(v) for v in bn.running_mean.detach().float().cpu()],
                  "std": [float(v) for v in std], "multiplier": 1.0,
                  "source": {"kind": "vae_weights", "what": f"BatchNorm running_mean, sqrt(running_var + {eps:g})",
                             "eps": eps}}
        return {"latent_channels": int(cfg["latent_channels"]) * ph * pw,
                "downsample_factor": 2 ** (len(cfg["block_out_channels"]) - 1) * ph,
                "layout": f"patchify {ph}x{pw}: channel c*{ph * pw} + {pw}*dy + dx", "normalization": record}


class SingleFrame(Layout):
    """Qwen-Image's video VAE read as single frames: [B, 3, H, W] -> [B, 3, 1, H, W] in, the one latent frame
    squeezed out (NanoGen's QwenVAE._vae_encode / _vae_decode)."""

    preferred_memory_format = torch.contiguous_format  # 3-D convolutions: channels_last is a 4-D format

    def _encode(self, x: torch.Tensor) -> Any:
        return self.vae.encode(x.unsqueeze(2))

    def _decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(z).sample.squeeze(2)

    def to_dit(self, z: torch.Tensor) -> torch.Tensor:
        return z.squeeze(2)

    def from_dit(self, z: torch.Tensor) -> torch.Tensor:
        return z.unsqueeze(2)

    def describe(self, eps: float | None = None) -> dict[str, Any]:
        cfg = self.vae.config
        out: dict[str, Any] = {"latent_channels": int(cfg["z_dim"]),
                               "downsample_factor": 2 ** len(cfg["temperal_downsample"]),
                               "layout": "single frame: [B, 3, H, W] as [B, 3, 1, H, W]"}
        norm = nanogen_normalization(cfg, None)
        if norm is not None:
            out["normalization"] = norm
        return out


LAYOUTS: dict[str, type[Layout]] = {"AutoencoderKLFlux2": Patchified, "AutoencoderKLQwenImage": SingleFrame}


def with_layout(vae: nn.Module) -> nn.Module:
    """`vae` in the DiT's layout: wrapped when its class has one (`LAYOUTS`), else itself."""
    layout = LAYOUTS.get(type(vae).__name__)
    return layout(vae) if layout is not None else vae


# ---------------------------------------------------------------------------------------------------------
# NanoGen's normalization rule (src/stage1/vae.py l.137-149)


def _config_get(cfg: Any, key: str) -> Any:
    """The key NanoGen reads with hasattr/getattr: absent and None are both None."""
    return cfg.get(key) if hasattr(cfg, "get") else getattr(cfg, key, None)


def nanogen_normalization(cfg: Any, space: VaeSpace | None) -> dict[str, Any] | None:
    """The scale_shift record of NanoGen's rule when it is per channel (the config has latents_mean or
    latents_std), None when it is scalar (`nanogen_scalars`). The values are NanoGen's float32 tensors:
    `torch.tensor(latents_mean)` and `1 / torch.tensor(latents_std)`."""
    mean, std = _config_get(cfg, "latents_mean"), _config_get(cfg, "latents_std")
    if mean is None and std is None:
        return None
    shift_s, scale_s = nanogen_scalars(cfg, space, need=(mean is None, std is None))
    n = len(mean if mean is not None else std)
    shift = torch.tensor(mean) if mean is not None else torch.full((n,), shift_s, dtype=torch.float32)
    scale = 1 / torch.tensor(std) if std is not None else torch.full((n,), scale_s, dtype=torch.float32)
    return {"form": "scale_shift", "scale": [float(v) for v in scale.float()],
            "shift": [float(v) for v in shift.float()],
            "source": {"kind": "vae_config", "rule": "NanoGen src/stage1/vae.py: shift = latents_mean, "
                                                     "scale = 1 / latents_std (float32)"}}


def nanogen_scalars(cfg: Any, space: VaeSpace | None, need: tuple[bool, bool] = (True, True)) -> tuple[float, float]:
    """(shift, scale) of NanoGen's scalar branches: the preset's value, else the config's (`getattr(config,
    'shift_factor', 0.0)`, `getattr(config, 'scaling_factor', 1.0)`). A config whose shift_factor is None (with
    no preset value) makes NanoGen compute `z - None`: refused, naming the VAE."""
    shift: Any = 0.0
    scale: Any = 1.0
    if need[0]:
        if space is not None and space.shift_factor is not None:
            shift = space.shift_factor
        else:
            shift = _config_get(cfg, "shift_factor") if "shift_factor" in _keys(cfg) else 0.0
    if need[1]:
        if space is not None and space.scaling_factor is not None:
            scale = space.scaling_factor
        else:
            scale = _config_get(cfg, "scaling_factor") if "scaling_factor" in _keys(cfg) else 1.0
    if shift is None or scale is None:
        name = space.name if space is not None else "this VAE"
        raise UserError(f"--vae {name}: its config has shift_factor/scaling_factor None and no latents_mean/"
                        "latents_std, so NanoGen's VAE wrapper (src/stage1/vae.py) computes (z - None) and fails; "
                        "there is no NanoGen latent space to reproduce")
    return float(shift), float(scale)


def _keys(cfg: Any) -> set[str]:
    return set(cfg.keys()) if hasattr(cfg, "keys") else set(vars(cfg))


def space_identity(space: VaeSpace, vae: nn.Module) -> dict[str, Any]:
    """The identity fields NanoGen's wrapper decides for `space` (loaded as `vae`, already in its layout): the
    latent geometry, the normalization (scalar factors, or a record) and NanoGen's name."""
    out: dict[str, Any] = {"latent_space": space.name}
    if isinstance(vae, Patchified):
        out.update(vae.describe(FLUX2_NANOGEN_EPS))
        out["scaling_factor"], out["shift_factor"] = 1.0, None
        return out
    if isinstance(vae, Layout):
        out.update(vae.describe())
        out.pop("normalization", None)  # decided below by NanoGen's rule with the preset
    record = nanogen_normalization(vae.config, space)
    if record is not None:
        out["normalization"] = record
        out["scaling_factor"], out["shift_factor"] = 1.0, None
    else:
        shift, scale = nanogen_scalars(vae.config, space)
        out["scaling_factor"], out["shift_factor"] = scale, shift
    return out


def space_name(extraction: dict[str, Any] | None) -> str | None:
    """NanoGen's name of the latent space a manifest's `extraction` record (or a checkpoint's `latent`) holds:
    the recorded `latent_space` of its VAE or feature encoder; for a VAE loaded by hub id without a name, the
    preset with that hub id and subfolder whose normalization is the VAE config's own (the SD-VAEs). None when
    the set is no NanoGen latent space (pixels, other VAEs)."""
    if not extraction:
        return None
    for key in ("vae", "encoder"):
        ident = extraction.get(key) or {}
        if ident.get("latent_space"):
            return str(ident["latent_space"])
    vae = extraction.get("vae") or {}
    if vae.get("kind") == "hub":
        for s in VAE_SPACES.values():
            if (s.hub_id, s.subfolder) == (vae.get("source"), vae.get("subfolder")) and s.cls == vae.get("class") \
                    and s.scaling_factor == vae.get("scaling_factor") and not vae.get("shift_factor") \
                    and not vae.get("latents_mean"):
                return s.name
    return None
