"""NanoGen's representation encoders (its RAE latent spaces) as `--encoder` presets: `dit-extract --encoder
dinov2-vit-b` stores the tokens NanoGen computes online at every training step, once.

NanoGen (End2End-Diffusion/diffusion-bench) encodes with `RAE.encode` (src/stage1/rae.py l.64-84) around one
`VisionEncoder` per name (src/encoders/vision_encoder.py): the [0, 1] image times 255, resized bicubic to the
resolution R when it is not R already, the encoder's own `preprocess` and `forward_features`, the patch tokens
[B, N, C] -> [B, C, h, w], then the statistics file's per channel-and-position normalization (z - mean) /
sqrt(var + 1e-5) (our `mean_var` record: `dit-extract --latent-stats stats.pt`). Per name (`ENCODER_SPACES`):

- dinov2-vit-b: torch.hub facebookresearch/dinov2 `dinov2_vitb14_reg` (timm `vit_base_patch14_reg4_dinov2`, its
  position table resampled to 16*(R/256) tokens a side by timm's `resample_abs_pos_embed`, bicubic with
  antialias: the call NanoGen makes, l.197-201); the final norm replaced by `nn.LayerNorm(768,
  elementwise_affine=False)`, so eps 1e-5 where DINOv2's is 1e-6; preprocess x/255, ImageNet Normalize, THEN
  `F.interpolate(x, 224*(R/256), mode='bicubic')` (l.216-223; RAE resizes first: common/features.py).
- dinov3-vit-b16: torch.hub facebookresearch/dinov3 `dinov3_vitb16` with the LVD-1689M weights (timm
  `vit_base_patch16_dinov3`, RoPE, 4 storage tokens); final norm as above (its own eps is 1e-5 too);
  preprocess x/255, torchvision `Resize((R, R), antialias=True)` (bilinear), ImageNet Normalize
  (src/encoders/models/dinov3_loader.py `make_dinov3_transform`).
- siglip2-vit-b: transformers `SiglipVisionModel` `google/siglip2-base-patch16-256`; NanoGen sets
  `post_layernorm.elementwise_affine = False` (l.142), which torch's LayerNorm.forward does not read (it
  applies `self.weight` and `self.bias` whenever they exist), so the affine STAYS, and so it does here;
  preprocess x/255, Normalize(0.5, 0.5), `F.interpolate(x, R, mode='bicubic')`; tokens = `last_hidden_state`
  (no CLS).
- pe-vit-l, langpe-vit-l, spatialpe-vit-l: NanoGen's own PE `VisionTransformer.from_config("PE-Core-L14-336" /
  "PE-Lang-L14-448" / "PE-Spatial-L14-448")` (timm `vit_pe_core_large_patch14_336`,
  `vit_pe_lang_large_patch14_448`, `vit_pe_spatial_large_patch14_448`); forward_features with `norm=False` (no
  ln_post; timm's final `norm` dropped for Core, absent for Lang and Spatial), CLS dropped; preprocess x/255,
  `F.interpolate(x, 14*(R/16), mode='bilinear')`, Normalize(0.5, 0.5) (l.588-594). PE resamples its absolute
  position table at every forward from the pretraining grid, bilinear without antialias (src/encoders/models/
  pe.py `_sample_abs_posemb`), and puts RoPE at integer positions 1..g (CLS at 0; `Rope2D.update_grid`): timm
  resamples bicubic with antialias at load time and, with its `ref_feat_shape`, rescales the RoPE positions to
  the pretraining grid. So the timm model is built at its pretraining size (the weights load unresampled), its
  table resampled by PE's rule here, and rebuilt at 14*(R/16) px with `ref_feat_shape` the grid itself (plain
  positions).

timm's and transformers' ports are assumed to compute what the torch.hub / PE originals compute with the same
weights (they load those checkpoints: `--encoder-weights` takes the original DINOv2, DINOv3 and PE files, timm
converts them); this module's tests check everything around the network against NanoGen's code on tiny random
models of the real classes. Every NanoGen decoder is fitted to [0, 1] images: the identity says
`decoder_output: "unit"` (common/rae_decoder.py).

REG's target (`dit-extract --encoder dinov2-vit-b --encoder-formula reg`, for `dit-train --use-reg`): NanoGen's
`repa.target_encoder` is the same `VisionEncoder`, loaded at `repa.target_encoder_resolution` (256 in every config,
whatever the image size: `REG_RESOLUTION`) and fed the training images directly, without RAE's resize
(src/stage2/engine.py l.114-120: images * 255, the encoder's `preprocess`, `forward_features`' `x_norm_clstoken`):
the class token after the affine-free final norm, one [C, 1, 1] latent per view. Only the encoders whose
`x_norm_clstoken` is the normed class token as timm's port gives it have it here (`class_token`).

timm gained the PE models in 1.0.16 and DINOv3 in 1.0.20 (the project's floor is 1.0.3): an older timm is refused
naming the version.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import sha256_file

IMAGENET_MEAN = (0.485, 0.456, 0.406)  # timm.data IMAGENET_DEFAULT_MEAN / STD, as NanoGen imports them
IMAGENET_STD = (0.229, 0.224, 0.225)
HALF = (0.5, 0.5, 0.5)
FORMULA = ("x in [0, 1] times 255; bicubic to R if not R (RAE.encode); the encoder's preprocess (x/255, its resize "
           "and Normalize); forward_features; prefix tokens dropped; tokens -> [C, h, w] (NanoGen's RAE)")
# the geometry of google/siglip2-base-patch16-256 (its config.json), for a random model without the hub
# repa.target_encoder_resolution (src/configs/stage2.py l.115; every reg0.03 config keeps it)
REG_RESOLUTION = 256
FORMULA_REG = ("x in [0, 1] times 255 (engine.py l.115); the encoder's preprocess at target_encoder_resolution 256 "
               "(x/255, ImageNet Normalize, bicubic to 224); forward_features with the affine-free final norm "
               "(eps 1e-5); x_norm_clstoken, the class token -> [C, 1, 1] (NanoGen's REG target)")
SIGLIP2_B16_256 = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                       image_size=256, patch_size=16)


def _normalize(x: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    from torchvision.transforms import functional as TF

    return TF.normalize(x, list(mean), list(std))  # what torchvision's Normalize(mean, std)(x) runs


def pre_dinov2(x: torch.Tensor, r: int) -> torch.Tensor:
    x = _normalize(x / 255., IMAGENET_MEAN, IMAGENET_STD)
    return F.interpolate(x, 224 * (r // 256), mode="bicubic")


def pre_dinov3(x: torch.Tensor, r: int) -> torch.Tensor:
    from torchvision.transforms import functional as TF

    x = TF.resize(x / 255., [r, r], antialias=True)  # transforms.Resize((r, r), antialias=True): bilinear
    return _normalize(x, IMAGENET_MEAN, IMAGENET_STD)


def pre_siglip2(x: torch.Tensor, r: int) -> torch.Tensor:
    return F.interpolate(_normalize(x / 255., HALF, HALF), r, mode="bicubic")


def pre_pe(x: torch.Tensor, r: int) -> torch.Tensor:
    return _normalize(F.interpolate(x / 255., 14 * (r // 16), mode="bilinear"), HALF, HALF)


@dataclass(frozen=True)
class EncoderSpace:
    """One of NanoGen's RAE encoders: its name, what NanoGen loads, the port we load, its preprocessing."""

    name: str                         # NanoGen's encoder_name (configs/stage1/*.yaml)
    nanogen_loads: str                # exactly what NanoGen's VisionEncoder loads
    backend: str                      # "timm" or "transformers"
    model: str                        # the timm name, or the transformers hub id
    preprocess: Callable[[torch.Tensor, int], torch.Tensor]
    input_size: Callable[[int], int]  # the encoder's input side at resolution R
    final_norm: str = "affine-free"   # "affine-free" (nn.LayerNorm(C, eps=1e-5) without affine), "none", "kept"
    pe_positions: bool = False        # PE's table and RoPE rule (the module docstring)
    min_timm: str | None = None
    note: str = ""
    channels: int = 768
    patch: int = 16                   # the ViT's patch: input_size(256) // patch = 16 tokens a side
    prefix: int = 1                   # tokens before the patches (class token, registers) the latent drops
    class_token: bool = False         # REG's target: x_norm_clstoken is the normed class token (module docstring)

    def latent_256(self) -> tuple[int, int, int]:
        return (self.channels, 16, 16)


ENCODER_SPACES: dict[str, EncoderSpace] = {s.name: s for s in (
    EncoderSpace("dinov2-vit-b", "torch.hub facebookresearch/dinov2 dinov2_vitb14_reg", "timm",
                 "vit_base_patch14_reg4_dinov2", pre_dinov2, lambda r: 224 * (r // 256),
                 note="DINOv2-B/14 with 4 registers", patch=14, prefix=5, class_token=True),
    EncoderSpace("dinov3-vit-b16", "torch.hub facebookresearch/dinov3 dinov3_vitb16 (LVD-1689M weights)", "timm",
                 "vit_base_patch16_dinov3", pre_dinov3, lambda r: r, min_timm="1.0.20", note="DINOv3 ViT-B/16",
                 prefix=5),
    EncoderSpace("siglip2-vit-b", "transformers SiglipVisionModel google/siglip2-base-patch16-256", "transformers",
                 "google/siglip2-base-patch16-256", pre_siglip2, lambda r: r, final_norm="kept",
                 note="SigLIP2 ViT-B/16 at 256 px", prefix=0),
    EncoderSpace("pe-vit-l", "PE VisionTransformer.from_config('PE-Core-L14-336')", "timm",
                 "vit_pe_core_large_patch14_336", pre_pe, lambda r: 14 * (r // 16), final_norm="none",
                 pe_positions=True, min_timm="1.0.16", note="Perception Encoder Core L/14", channels=1024, patch=14),
    EncoderSpace("langpe-vit-l", "PE VisionTransformer.from_config('PE-Lang-L14-448')", "timm",
                 "vit_pe_lang_large_patch14_448", pre_pe, lambda r: 14 * (r // 16), final_norm="none",
                 pe_positions=True, min_timm="1.0.16", note="Perception Encoder Lang L/14 (23 blocks)",
                 channels=1024, patch=14),
    EncoderSpace("spatialpe-vit-l", "PE VisionTransformer.from_config('PE-Spatial-L14-448')", "timm",
                 "vit_pe_spatial_large_patch14_448", pre_pe, lambda r: 14 * (r // 16), final_norm="none",
                 pe_positions=True, min_timm="1.0.16", note="Perception Encoder Spatial L/14", channels=1024, patch=14),
)}


def is_encoder_space(spec: str | None) -> bool:
    return spec is not None and spec in ENCODER_SPACES and not Path(spec).expanduser().exists()


@dataclass
class _Latent:
    latent: torch.Tensor


class NanoGenEncoder(nn.Module):
    """`encode(x [B, 3, H, W] in [0, 1]).latent` -> [B, C, h, w]: NanoGen's RAE.encode without the statistics
    (the manifest's normalization applies them)."""

    def __init__(self, space: EncoderSpace, model: nn.Module, resolution: int, prefix: int, formula: str = "nanogen"):
        super().__init__()
        self.space = space
        self.model = model
        self.resolution = int(resolution)
        self.prefix = int(prefix)
        self.formula = formula  # "nanogen": RAE's latent; "reg": REG's class token

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        if self.space.backend == "transformers":
            return self.model(pixel_values=x).last_hidden_state
        return self.model.forward_features(x)[:, self.prefix:]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 255.0  # RAE.encode: `if x.max() <= 1.0: x = x * 255.0` (the crops are [0, 1]); engine.py l.115
        r = self.resolution
        if self.formula == "reg":  # no RAE resize: the images go to the preprocess as they are (engine.py l.116)
            t = self.model.forward_features(self.space.preprocess(x, r))  # the final norm is the affine-free one
            return t[:, 0, :, None, None]                                 # x_norm_clstoken: [B, C, 1, 1]
        if x.shape[-2] != r or x.shape[-1] != r:
            x = F.interpolate(x, size=(r, r), mode="bicubic", align_corners=False)
        t = self.tokens(self.space.preprocess(x, r))
        b, n, c = t.shape
        side = math.isqrt(n)
        return t.transpose(1, 2).reshape(b, c, side, side)

    def encode(self, x: torch.Tensor) -> _Latent:
        return _Latent(self(x))


def pe_table(pos: torch.Tensor, grid: int) -> torch.Tensor:
    """PE's `_sample_abs_posemb` (src/encoders/models/pe.py l.503-525) of a timm [1, 1 + G*G, C] table to grid
    x grid: the CLS row kept, the G x G rows resized bilinear (align_corners False, no antialias)."""
    cls, rows = pos[0, :1], pos[0, 1:]
    g0 = math.isqrt(rows.shape[0])
    if g0 == grid:
        return pos
    t = rows.reshape(1, g0, g0, -1).permute(0, 3, 1, 2).contiguous()
    t = F.interpolate(t, size=(grid, grid), mode="bilinear", align_corners=False)
    return torch.cat([cls, t.permute(0, 2, 3, 1).reshape(-1, pos.shape[-1])], dim=0)[None]


def _check_timm(space: EncoderSpace) -> None:
    import timm

    if not timm.is_model(space.model):
        need = f" (timm provides it from version {space.min_timm} on: pip install 'timm>={space.min_timm}')" \
            if space.min_timm else ""
        raise UserError(f"--encoder {space.name}: timm {timm.__version__} has no model {space.model!r}{need}")


def _timm_model(space: EncoderSpace, *, resolution: int, model_args: dict[str, Any], weights: Path | None,
                pretrained: bool) -> nn.Module:
    import timm

    _check_timm(space)
    size = space.input_size(resolution)
    kw = dict(model_args)
    kw.setdefault("num_classes", 0)

    def create(**more: Any) -> nn.Module:
        args = {**kw, **more}
        try:
            if weights is not None:
                return timm.create_model(space.model, pretrained=True, pretrained_cfg_overlay={"file": str(weights)},
                                         **args)
            return timm.create_model(space.model, pretrained=pretrained, **args)
        except Exception as e:  # no network, weights of another model: one line
            reason = " ".join(str(e).split())[:400]
            what = f"--encoder-weights {weights}" if weights is not None else "its pretrained weights"
            raise UserError(f"--encoder {space.name}: timm {space.model!r} with {what}: {type(e).__name__}: {reason}."
                            " Offline: pass --encoder-weights FILE (the original checkpoint or a timm state_dict)"
                            ) from None

    if not space.pe_positions:
        model = create(img_size=size)
    else:  # built at the pretraining size, the table resampled by PE's rule, rebuilt at `size` with plain RoPE
        native = create()
        sd = native.state_dict()
        grid = size // 14
        sd["pos_embed"] = pe_table(sd["pos_embed"], grid)
        # timm drops a None ref_feat_shape for its registered default (the pretraining grid); the grid itself
        # makes the positions t / g * g = t, exactly for NanoGen's power-of-two grids (16 at 256 px)
        kw_target = {**kw, "img_size": size, "ref_feat_shape": (grid, grid)}
        model = timm.create_model(space.model, pretrained=False, **kw_target)
        missing, unexpected = model.load_state_dict(sd, strict=False)
        bad = [k for k in missing if "rope" not in k] + list(unexpected)
        assert not bad, f"PE rebuild left tensors unmatched: {bad[:5]}"
    if space.final_norm == "affine-free":  # nn.LayerNorm(embed_dim, elementwise_affine=False): eps 1e-5
        model.norm = nn.LayerNorm(int(model.num_features), elementwise_affine=False)
    elif space.final_norm == "none":
        model.norm = nn.Identity()
    return model


def _transformers_model(space: EncoderSpace, *, model_args: dict[str, Any], weights: Path | None,
                        pretrained: bool) -> nn.Module:
    from transformers import SiglipVisionConfig, SiglipVisionModel

    source = str(weights) if weights is not None else space.model
    try:
        if weights is not None or pretrained:  # the architecture is the folder's (model_args apply to random ones)
            return SiglipVisionModel.from_pretrained(source)
    except Exception as e:
        reason = " ".join(str(e).split())[:400]
        raise UserError(f"--encoder {space.name}: transformers SiglipVisionModel from {source!r}: "
                        f"{type(e).__name__}: {reason}. Offline: pass --encoder-weights FOLDER (a local copy of "
                        f"{space.model}, or its Hugging Face cache with HF_HUB_OFFLINE=1)") from None
    return SiglipVisionModel(SiglipVisionConfig(**{**SIGLIP2_B16_256, **model_args}))


def load_encoder_space(name: str, *, weights: str | None = None, model_args: dict[str, Any] | None = None,
                       pretrained: bool = True, device: torch.device | str = "cpu", image_size: int = 256,
                       source: dict[str, Any] | None = None, formula: str = "nanogen"
                       ) -> tuple[NanoGenEncoder, dict[str, Any]]:
    """(NanoGenEncoder in eval mode, identity) of NanoGen's encoder `name` at resolution `image_size`, or with
    `formula` "reg" its class token, REG's target (at REG_RESOLUTION, whatever the image size). `weights`: a timm
    weight file (the original checkpoint converts) or a transformers folder; `model_args`: the architecture's
    overrides (tiny tests); `pretrained=False`: random weights (benchmarks, tests)."""
    space = ENCODER_SPACES[name]
    args = dict(model_args or {})
    wpath = Path(weights).expanduser() if weights else None
    if wpath is not None and not wpath.exists():
        raise UserError(f"--encoder-weights {weights}: no such file or folder ({wpath.absolute()})")
    if formula == "reg" and not space.class_token:
        have = ", ".join(n for n, s in ENCODER_SPACES.items() if s.class_token)
        raise UserError(f"--encoder {name} --encoder-formula reg: REG's class token is NanoGen's x_norm_clstoken, "
                        f"which this build takes from {have} (NanoGen's target_encoder); pass one of them")
    if image_size % 16 or image_size < 16:
        raise UserError(f"--encoder {name}: NanoGen's encoders work at multiples of 16 px (16 x 16 tokens at 256); "
                        f"--image-size is {image_size}")
    resolution = REG_RESOLUTION if formula == "reg" else image_size
    with torch.random.fork_rng(devices=[]):
        if space.backend == "timm":
            model = _timm_model(space, resolution=resolution, model_args=args, weights=wpath, pretrained=pretrained)
            prefix = int(getattr(model, "num_prefix_tokens", 1))
            patch = model.patch_embed.patch_size
            patch = int(patch[0] if isinstance(patch, (tuple, list)) else patch)
        else:
            model = _transformers_model(space, model_args=args, weights=wpath, pretrained=pretrained)
            prefix, patch = 0, int(model.config.patch_size)
    enc = NanoGenEncoder(space, model, resolution, prefix, formula)
    channels = int(getattr(model, "num_features", 0) or model.config.hidden_size)
    wsrc = weights_record(space, wpath, pretrained)
    cls = f"{space.backend}:{type(model).__name__ if space.backend == 'transformers' else space.model}"
    identity = space_encoder_identity(space, image_size=image_size, channels=channels, patch=patch, prefix=prefix,
                                      cls=cls, model_args=args, weights={**wsrc, **(source or {})}, formula=formula)
    return enc.to(device).eval().requires_grad_(False), identity


def weights_record(space: EncoderSpace, weights: Path | None, pretrained: bool) -> dict[str, Any]:
    """What the identity says of the weights: a file or folder (its path and sha256), the backend's pretrained
    weights of the model (NanoGen's name alone), or random ones."""
    if weights is not None:
        return {"weights": str(weights.resolve()),
                "weights_sha256": sha256_file(weights) if weights.is_file() else _folder_hash(weights)}
    if pretrained:
        return {"weights": f"{space.backend}:{space.model} (pretrained)"}
    return {"weights": "random (not pretrained)"}


def space_encoder_identity(space: EncoderSpace, *, image_size: int, weights: dict[str, Any],
                           channels: int | None = None, patch: int | None = None, prefix: int | None = None,
                           cls: str | None = None, model_args: dict[str, Any] | None = None,
                           formula: str = "nanogen") -> dict[str, Any]:
    """The identity `dit-extract --encoder NAME [--encoder-formula reg]` records for NanoGen's encoder `space` at
    `image_size` (a manifest's `extraction.encoder`): its name, model, formula, geometry and `weights` (the
    record of the weights loaded). `channels`, `patch`, `prefix`: the loaded model's; None: the registry's (the real
    model's). The `reg` formula's set is no latent space: its identity names the target encoder instead."""
    channels = space.channels if channels is None else channels
    patch = space.patch if patch is None else patch
    prefix = space.prefix if prefix is None else prefix
    reg = formula == "reg"
    resolution = REG_RESOLUTION if reg else image_size
    grid = 1 if reg else space.input_size(image_size) // patch  # the class token: one position per image
    named = {"target_encoder": space.name, "target_encoder_resolution": resolution} if reg else \
        {"latent_space": space.name, "decoder_output": "unit"}
    return {
        "kind": "features", "nanogen_loads": space.nanogen_loads,
        "class": cls or f"{space.backend}:{space.model}", "model": space.model, "model_args": dict(model_args or {}),
        "input_size": space.input_size(resolution), "patch_size": patch, "layers": 1, "prefix_tokens": prefix,
        "formula_name": "reg" if reg else "nanogen", "formula": FORMULA_REG if reg else FORMULA,
        "final_norm": space.final_norm, "resolution": resolution, "input_range": "0,1", "spec": space.name,
        **weights, "latent_channels": channels, "downsample_factor": image_size // grid, "encoder_output": "latent",
        "scaling_factor": 1.0, "shift_factor": None, **named,
    }


def _folder_hash(folder: Path) -> str | None:
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (folder / name).is_file():
            return sha256_file(folder / name)
    return None

