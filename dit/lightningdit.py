"""LightningDiT (Yao et al. 2025, "Reconstruction vs. Generation: Taming Optimization Dilemma in Latent Diffusion
Models", arXiv:2501.01423; github hustvl/LightningDiT, models/lightningdit.py): DiT's skeleton (dit/models.py)
with the block its release trains, in the release's parameter names and shapes so its checkpoints load strictly.

Facts of the release (each a switch of its model class, recorded in the model_config):
- `rms_norm`: RMSNorm with a learned scale (`norm1.weight`, `norm2.weight`, `final_layer.norm_final.weight`,
  eps 1e-6) in place of DiT's non-affine LayerNorm;
- `swiglu`: SwiGLU MLP, `w12` one Linear to 2h, silu(first half) * second half, `w3`; h = int(2/3 x int(4 x D)),
  not rounded (2730 at L/2, 3072 at XL);
- `rope`: EVA's 2-D RoPE (dit/rope.py `EvaRope`) on q and k, tables as buffers `feat_rope.freqs_cos/sin`
  [T, head_dim]; the absolute sin-cos table `pos_embed` stays;
- `qk_norm`: per-head norm of q and k: RMSNorm (learned) with rms_norm, else LayerNorm (affine, eps 1e-5);
- `wo_shift`: adaLN without shifts (4 x D: scale and gate of attention and MLP).
The published XL/1 (FID 1.35) uses rms_norm, swiglu and rope, without qk_norm and wo_shift: this family's
defaults. Conditioning c = t_emb + y_emb as DiT (sinusoid, max_period 10000, raw t in [0, 1]); learn_sigma False
(with learn_sigma the release returns the first C channels; here the 2C channels come back, of which a flow
sampler reads the first C: the same samples).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from .blocks import LayerNorm32, SwiGLU
from .family import preset_of, register_family
from .flops import dit_forward_macs
from .infer import Shapes, check_stored
from .layers import AdaLNBlock, Mlp, RMSNorm
from .models import DiT, LN_EPS, infer_single_stream
from .rope import EvaRope, eva_angles

MLP_RATIO = 4.0
OPTIONS = ("qk_norm", "rms_norm", "swiglu", "rope", "wo_shift")
_ARCH = ("depth", "hidden_size", "num_heads", "patch_size")
# the release's LightningDiT_models: name -> (depth, hidden, heads, patch)
_PRESETS = {"B/1": (12, 768, 12, 1), "B/2": (12, 768, 12, 2), "L/2": (24, 1024, 16, 2), "XL/1": (28, 1152, 16, 1),
            "XL/2": (28, 1152, 16, 2), "1p0B/1": (24, 1536, 24, 1), "1p0B/2": (24, 1536, 24, 2),
            "1p6B/1": (28, 1792, 28, 1), "1p6B/2": (28, 1792, 28, 2)}


def swiglu_width(dim: int) -> int:
    """The release's SwiGLU hidden width: int(2/3 x int(dim x 4.0)), the float expression as written."""
    return int(2 / 3 * int(dim * MLP_RATIO))


@register_family
class LightningDiT(DiT):
    """LightningDiT: (x [N, C, S, S], t [N], y [N]) -> [N, C or 2C, S, S] (module docstring)."""

    family = "LightningDiT"
    default_objective = "flow"
    diffusers_class = None  # diffusers' DiT blocks have none of its switches
    presets = {f"LightningDiT-{k}": dict(zip(_ARCH, v)) for k, v in _PRESETS.items()}
    overrides = (*_ARCH, *OPTIONS)
    config_keys = ("family", "model", "input_size", "num_classes", "learn_sigma", "in_channels", "depth",
                   "hidden_size", "num_heads", "patch_size", "class_dropout_prob", *OPTIONS)
    options_ = OPTIONS
    extra_options = ("wo_shift",)

    def __init__(self, input_size: int = 16, patch_size: int = 1, in_channels: int = 32, hidden_size: int = 1152,
                 depth: int = 28, num_heads: int = 16, class_dropout_prob: float = 0.1, num_classes: int = 1000,
                 learn_sigma: bool = False, qk_norm: bool = False, rms_norm: bool = True, swiglu: bool = True,
                 rope: bool = True, wo_shift: bool = False):
        super().__init__(input_size=input_size, patch_size=patch_size, in_channels=in_channels,
                         hidden_size=hidden_size, depth=depth, num_heads=num_heads,
                         class_dropout_prob=class_dropout_prob, num_classes=num_classes, learn_sigma=learn_sigma,
                         qk_norm=qk_norm, rms_norm=rms_norm, swiglu=swiglu, rope=rope, wo_shift=wo_shift)

    def make_norm(self, dim: int) -> nn.Module:
        return RMSNorm(dim) if self.options["rms_norm"] else LayerNorm32(dim, elementwise_affine=False, eps=LN_EPS)

    def make_block(self) -> nn.Module:
        o = self.options
        mlp = ((lambda dim: SwiGLU(dim, swiglu_width(dim))) if o["swiglu"]
               else (lambda dim: Mlp(dim, int(dim * MLP_RATIO))))
        qk = None if not o["qk_norm"] else RMSNorm if o["rms_norm"] else LayerNorm32
        return AdaLNBlock(self.hidden_size, self.num_heads, norm=self.make_norm, mlp=mlp, qk_norm=qk,
                          shift=not o["wo_shift"])

    def make_rope(self) -> nn.Module:
        return EvaRope(self.grid_size, self.hidden_size // self.num_heads)

    @property
    def config(self) -> dict[str, Any]:
        base = {"input_size": self.input_size, "num_classes": self.num_classes, "learn_sigma": self.learn_sigma,
                "in_channels": self.in_channels, "depth": self.depth, "hidden_size": self.hidden_size,
                "num_heads": self.num_heads, "patch_size": self.patch_size,
                "class_dropout_prob": self.class_dropout_prob, **self.options}
        return {"family": self.family, "model": preset_of({"family": self.family, **base}), **base,
                **self.condition_config()}

    @staticmethod
    def forward_macs(config: Mapping[str, Any]) -> int:
        d = int(config["hidden_size"])
        mlp = 3 * d * swiglu_width(d) if config["swiglu"] else 2 * d * int(d * MLP_RATIO)
        return dit_forward_macs(config, mlp_macs_per_token=mlp, modulation=4 if config["wo_shift"] else 6)

    @classmethod
    def fixed_tensors(cls, config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        out = DiT.fixed_tensors(config)
        if config["rope"]:
            grid = config["input_size"] // config["patch_size"]
            angles = eva_angles(grid, config["hidden_size"] // config["num_heads"]).repeat_interleave(2, dim=-1)
            out.update({"feat_rope.freqs_cos": angles.cos(), "feat_rope.freqs_sin": angles.sin()})
        return out

    @classmethod
    def infer_config(cls, state_dict: Mapping[str, torch.Tensor], stored: Mapping[str, Any] | None,
                     where: str, hints: Mapping[str, Any] | None = None) -> dict[str, Any]:
        from .infer import shapes_of

        return infer_single_stream(cls, shapes_of(state_dict), stored, where, hints)

    @staticmethod
    def options_from_shapes(shapes: Shapes, stored: Mapping[str, Any] | None, where: str) -> dict[str, bool]:
        """Every option shows in the tensors: learned norm scales, w12, RoPE buffers, q_norm, a 4D adaLN."""
        hidden = shapes["x_embedder.proj.weight"][0]
        found = {"qk_norm": "blocks.0.attn.q_norm.weight" in shapes, "rms_norm": "blocks.0.norm1.weight" in shapes,
                 "swiglu": "blocks.0.mlp.w12.weight" in shapes, "rope": "feat_rope.freqs_cos" in shapes,
                 "wo_shift": shapes.get("blocks.0.adaLN_modulation.1.weight", (0,))[0] == 4 * hidden}
        check_stored(found, stored, found, where)
        return found

    @classmethod
    def finish_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        body = {k: config[k] for k in cls.config_keys if k not in ("family", "model")}
        return {"family": cls.family, "model": preset_of({"family": cls.family, **body}), **body}
