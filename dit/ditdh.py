"""RAE's DiT-DH (Zheng et al. 2025, "Diffusion Transformers with Representation Autoencoders", arXiv:2510.11690;
github bytetriper/RAE, src/stage2/models/DDT.py `DiTwDDTHead`): a DiT encoder followed by a wide, shallow head,
in its release's parameter names and shapes so its stage-2 checkpoints load strictly.

Facts of the release:
- encoder: `depth` LightningDiT blocks (dit/lightningdit.py: learned RMSNorm, SwiGLU int(2/3 x int(4 D)), EVA
  RoPE, optional QK-norm and wo_shift) of width `hidden_size` on `s_embedder(x) + pos_embed` (DiT's sin-cos
  table), modulated by c = silu(t_emb + y_emb) (its blocks' adaLN applies another SiLU);
- then s = silu(t_emb + s) and `s_projector` (a Linear to the head's width; none when the widths agree);
- head: `head_depth` blocks of the same kind and width `head_hidden_size` on `x_embedder(x)` (no position table,
  its own RoPE), each modulated token by token by s; the final layer (learned RMSNorm, no gate) too;
- time: RAE's Gaussian Fourier features sin/cos(2 pi t W), W ~ N(0, 1) fixed (`t_embedder.W`), into an MLP; time
  runs as REPA's (t = 1 noise, the network predicts noise - data): flow_convention "repa";
- patch embeddings are convolutions (`x_embedder.proj`, `s_embedder.proj`; patch 1 on RAE's 768 x 16 x 16
  DINOv2 features); initialisation: the embeddings xavier, labels N(0, 0.02), timestep MLP N(0, 0.02), every
  adaLN and the final layer zero, the other Linears torch's default (the release's `xavier_uniform_init=False`);
- RoPE tables as buffers `enc_feat_rope.freqs_cos/sin` [T, encoder head width], `dec_feat_rope.*` (head width).
"""
from __future__ import annotations

from typing import Any, Mapping, cast, overload

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import LayerNorm32, SwiGLU
from .embed import pos_embed_2d
from .family import DiffusionTransformer, preset_of, register_family
from .flops import FREQUENCY_EMBEDDING_SIZE, block_macs
from .infer import WeightsError, check_stored, classes, heads, require, shapes_of
from .layers import AdaLNBlock, FinalLayer, FourierTimestepEmbedder, LabelEmbedder, Mlp, PatchEmbed, RMSNorm, run_block
from .lightningdit import MLP_RATIO, OPTIONS, swiglu_width
from .models import LN_EPS, check_dims
from .rope import EvaRope, eva_angles

_ARCH = ("depth", "hidden_size", "num_heads", "head_depth", "head_hidden_size", "head_num_heads", "patch_size")
# RAE's configs/training/ImageNet256/DiTDH-{S,XL}_DINOv2-B.yaml; "/16": the same on 256 x 256 x 3 pixels in 16 x 16
# patches, NanoGen's jit-ddt / pixelgen configs (End2End-Diffusion/diffusion-bench configs/stage2/training/imagenet/
# jit-ddt-en28d1152hd72-dn2d2048hd128-xpred-t4c8.yaml: hidden [1152, 2048], depth [28, 2], heads [16, 16], patch 16)
_PRESETS = {"DiT-DH-S": (12, 384, 6, 2, 2048, 16, 1), "DiT-DH-XL": (28, 1152, 16, 2, 2048, 16, 1),
            "DiT-DH-S/16": (12, 384, 6, 2, 2048, 16, 16), "DiT-DH-XL/16": (28, 1152, 16, 2, 2048, 16, 16)}


@register_family
class DiTDH(DiffusionTransformer):
    """DiT-DH: (x [N, C, S, S], t [N], y [N]) -> [N, C or 2C, S, S] (module docstring)."""

    family = "DiT-DH"
    presets = {name: dict(zip(_ARCH, dims)) for name, dims in _PRESETS.items()}
    aliases = {"DiTDH-S": "DiT-DH-S", "DiTDH-XL": "DiT-DH-XL"}  # RAE's config names
    overrides = (*_ARCH, *OPTIONS)
    config_keys = ("family", "model", "input_size", "num_classes", "learn_sigma", "in_channels", *_ARCH,
                   "class_dropout_prob", *OPTIONS)

    def __init__(self, input_size: int = 16, patch_size: int = 1, in_channels: int = 768, hidden_size: int = 1152,
                 depth: int = 28, num_heads: int = 16, head_depth: int = 2, head_hidden_size: int = 2048,
                 head_num_heads: int = 16, class_dropout_prob: float = 0.1, num_classes: int = 1000,
                 learn_sigma: bool = False, qk_norm: bool = False, rms_norm: bool = True, swiglu: bool = True,
                 rope: bool = True, wo_shift: bool = False):
        super().__init__()
        check_dims(self.family, input_size, patch_size, in_channels, hidden_size, depth, num_heads,
                   class_dropout_prob, num_classes, head_depth=head_depth, head_hidden_size=head_hidden_size,
                   head_num_heads=head_num_heads)
        if head_hidden_size % head_num_heads or (rope and (hidden_size // num_heads % 4
                                                            or head_hidden_size // head_num_heads % 4)):
            raise ValueError(f"invalid DiT-DH configuration: head_hidden_size {head_hidden_size} must divide into "
                             f"{head_num_heads} heads, and with rope both head widths by 4")
        self.input_size, self.patch_size, self.in_channels = input_size, patch_size, in_channels
        self.hidden_size, self.depth, self.num_heads = hidden_size, depth, num_heads
        self.head_hidden_size, self.head_depth, self.head_num_heads = head_hidden_size, head_depth, head_num_heads
        self.num_classes, self.class_dropout_prob = num_classes, float(class_dropout_prob)
        self.learn_sigma = bool(learn_sigma)
        self.options = {"qk_norm": bool(qk_norm), "rms_norm": bool(rms_norm), "swiglu": bool(swiglu),
                        "rope": bool(rope), "wo_shift": bool(wo_shift)}
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.grid_size = input_size // patch_size
        self.x_embedder = PatchEmbed(patch_size, in_channels, head_hidden_size)
        self.s_embedder = PatchEmbed(patch_size, in_channels, hidden_size)
        self.s_projector = nn.Linear(hidden_size, head_hidden_size) if hidden_size != head_hidden_size else nn.Identity()
        self.t_embedder = FourierTimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        self.final_layer = FinalLayer(head_hidden_size, patch_size * patch_size * self.out_channels,
                                      self._norm(head_hidden_size))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid_size ** 2, hidden_size), requires_grad=False)
        self.enc_feat_rope = EvaRope(self.grid_size, hidden_size // num_heads) if rope else None
        self.dec_feat_rope = EvaRope(self.grid_size, head_hidden_size // head_num_heads) if rope else None
        self.blocks = nn.ModuleList([*(self._block(hidden_size, num_heads) for _ in range(depth)),
                                     *(self._block(head_hidden_size, head_num_heads) for _ in range(head_depth))])
        self.initialize_weights()

    def _norm(self, dim: int) -> nn.Module:
        return RMSNorm(dim) if self.options["rms_norm"] else LayerNorm32(dim, elementwise_affine=False, eps=LN_EPS)

    def _block(self, dim: int, num_heads: int) -> AdaLNBlock:
        o = self.options
        mlp = ((lambda d: SwiGLU(d, swiglu_width(d))) if o["swiglu"] else (lambda d: Mlp(d, int(d * MLP_RATIO))))
        qk = None if not o["qk_norm"] else RMSNorm if o["rms_norm"] else LayerNorm32
        return AdaLNBlock(dim, num_heads, norm=self._norm, mlp=mlp, qk_norm=qk, shift=not o["wo_shift"])

    @torch.no_grad()
    def initialize_weights(self) -> None:
        """The release's initialisation (module docstring)."""
        for embed in (self.x_embedder, self.s_embedder):
            nn.init.xavier_uniform_(embed.proj.weight.view(embed.proj.weight.shape[0], -1))
            nn.init.zeros_(cast(torch.Tensor, embed.proj.bias))
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        self.pos_embed.copy_(torch.from_numpy(pos_embed_2d(self.hidden_size, self.grid_size)).float().unsqueeze(0))
        zeroed = [cast(nn.Linear, cast(AdaLNBlock, b).adaLN_modulation[-1]) for b in self.blocks]
        nn.init.normal_(cast(nn.Linear, self.t_embedder.mlp[0]).weight, std=0.02)
        nn.init.normal_(cast(nn.Linear, self.t_embedder.mlp[2]).weight, std=0.02)
        for layer in (*zeroed, cast(nn.Linear, self.final_layer.adaLN_modulation[-1]), self.final_layer.linear):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    @property
    def config(self) -> dict[str, Any]:
        body = {"input_size": self.input_size, "num_classes": self.num_classes, "learn_sigma": self.learn_sigma,
                "in_channels": self.in_channels, "depth": self.depth, "hidden_size": self.hidden_size,
                "num_heads": self.num_heads, "head_depth": self.head_depth, "head_hidden_size": self.head_hidden_size,
                "head_num_heads": self.head_num_heads, "patch_size": self.patch_size,
                "class_dropout_prob": self.class_dropout_prob, **self.options}
        return {"family": self.family, "model": preset_of({"family": self.family, **body}), **body,
                **self.condition_config()}

    def hidden_size_at(self, k: int) -> int:
        return self.hidden_size if k <= self.depth else self.head_hidden_size

    @overload
    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, force_drop_ids: torch.Tensor | None = None,
                generator: torch.Generator | None = None, return_hidden: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, force_drop_ids: torch.Tensor | None = None,
                generator: torch.Generator | None = None, *,
                return_hidden: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, force_drop_ids: torch.Tensor | None = None,
                generator: torch.Generator | None = None,
                return_hidden: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As DiT.forward (t: flow time in REPA's direction); `return_hidden=k` returns the tokens after block k
        (encoder width for k <= depth, the head's beyond)."""
        self.check_inputs(x, t, y)
        self.check_return_hidden(return_hidden)
        t_emb, y_emb = self.embed_conditions(t, y, force_drop_ids, generator)
        c = F.silu(t_emb + y_emb)  # [N, D]
        s = self.s_embedder(x) + self.pos_embed  # [N, T, D]
        hidden = []
        for block in list(self.blocks)[: self.depth]:
            s = run_block(block, s, c, self.enc_feat_rope)
            hidden.append(s)
        s = self.s_projector(F.silu(t_emb[:, None] + s))  # [N, T, D_head]
        h = self.x_embedder(x)
        for block in list(self.blocks)[self.depth:]:
            h = run_block(block, h, s, self.dec_feat_rope)
            hidden.append(h)
        out = self.unpatchify(self.final_layer(h, s))
        return out if return_hidden is None else (out, hidden[return_hidden - 1])

    # -- files ---------------------------------------------------------------------------------------------------
    @staticmethod
    def forward_macs(config: Mapping[str, Any]) -> int:
        d, dh, p = int(config["hidden_size"]), int(config["head_hidden_size"]), int(config["patch_size"])
        c = int(config["in_channels"])
        tokens = (int(config["input_size"]) // p) ** 2
        mod = 4 if config["wo_shift"] else 6

        def mlp(w: int) -> int:
            return 3 * w * swiglu_width(w) if config["swiglu"] else 2 * w * int(w * MLP_RATIO)

        return (tokens * c * p * p * (d + dh) + (d * dh * tokens if d != dh else 0)
                + 2 * FREQUENCY_EMBEDDING_SIZE * d + d * d
                + int(config["depth"]) * block_macs(tokens, d, mlp_macs_per_token=mlp(d), modulation=mod)
                + int(config["head_depth"]) * block_macs(tokens, dh, mlp_macs_per_token=mlp(dh), modulation=mod,
                                                         per_token_condition=True)
                + tokens * 2 * dh * dh + tokens * dh * p * p * c * (2 if config["learn_sigma"] else 1))

    @classmethod
    def block_widths(cls, config: Mapping[str, Any]) -> list[int]:
        return [int(config["hidden_size"])] * int(config["depth"]) + \
            [int(config["head_hidden_size"])] * int(config["head_depth"])

    @classmethod
    def describe(cls, config: Mapping[str, Any]) -> str:
        return (f"depth {config['depth']}, hidden {config['hidden_size']}, heads {config['num_heads']}, head "
                f"{config['head_depth']} x {config['head_hidden_size']} ({config['head_num_heads']} heads), patch "
                f"{config['patch_size']}")

    @classmethod
    def fixed_tensors(cls, config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        grid = config["input_size"] // config["patch_size"]
        out = {"pos_embed": torch.from_numpy(pos_embed_2d(config["hidden_size"], grid)).float().unsqueeze(0)}
        if config["rope"]:
            for name, width, n in (("enc", "hidden_size", "num_heads"), ("dec", "head_hidden_size", "head_num_heads")):
                angles = eva_angles(grid, config[width] // config[n]).repeat_interleave(2, dim=-1)
                out.update({f"{name}_feat_rope.freqs_cos": angles.cos(), f"{name}_feat_rope.freqs_sin": angles.sin()})
        return out

    @classmethod
    def infer_config(cls, state_dict: Mapping[str, torch.Tensor], stored: Mapping[str, Any] | None,
                     where: str, hints: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Everything shows in the shapes (each block's width tells encoder from head) but the head counts, which
        the RoPE tables or QK-norm weights show, else a stored config or the preset."""
        shapes, stored, hints = shapes_of(state_dict), dict(stored or {}), dict(hints or {})
        require(shapes, ("s_embedder.proj.weight", "x_embedder.proj.weight", "pos_embed", "t_embedder.W",
                         "y_embedder.embedding_table.weight", "final_layer.linear.weight"), "DiT-DH", where)
        d, channels, patch, _ = shapes["s_embedder.proj.weight"]
        dh = shapes["x_embedder.proj.weight"][0]
        widths = [shapes[k][1] for k in sorted(shapes, key=_block_index) if k.endswith("adaLN_modulation.1.weight")
                  and k.startswith("blocks.")]
        depth = stored.get("depth", hints.get("depth")) if d == dh else sum(1 for w in widths if w == d)
        if depth is None:
            raise WeightsError(f"{where}: encoder and head have the same width {d}, so the split of the "
                               f"{len(widths)} blocks is unknown; put a JSON sidecar with the model_config beside it")
        grid = int(round(shapes["pos_embed"][1] ** 0.5))
        out_features = shapes["final_layer.linear.weight"][0]
        config: dict[str, Any] = {
            "input_size": grid * patch, "in_channels": channels, "depth": depth, "hidden_size": d,
            "head_depth": len(widths) - depth, "head_hidden_size": dh, "patch_size": patch,
            "learn_sigma": out_features == 2 * patch * patch * channels,
            "qk_norm": "blocks.0.attn.q_norm.weight" in shapes, "rms_norm": "blocks.0.norm1.weight" in shapes,
            "swiglu": "blocks.0.mlp.w12.weight" in shapes, "rope": "enc_feat_rope.freqs_cos" in shapes,
            "wo_shift": bool(widths) and shapes["blocks.0.adaLN_modulation.1.weight"][0] == 4 * d}
        check_stored(config, stored, list(config), where)
        config["num_classes"], config["class_dropout_prob"] = classes(
            shapes["y_embedder.embedding_table.weight"][0], stored, where)
        preset = next((a for a in cls.presets.values() if (a["depth"], a["hidden_size"], a["head_hidden_size"])
                       == (depth, d, dh)), {})
        what = f"a DiT-DH of widths {d}/{dh} is no preset"
        config["num_heads"] = heads(d, shapes, ("enc_feat_rope.freqs_cos", "blocks.0.attn.q_norm.weight"),
                                    stored.get("num_heads"), preset.get("num_heads"), where, what,
                                    hints.get("num_heads"))
        config["head_num_heads"] = heads(dh, shapes, ("dec_feat_rope.freqs_cos", f"blocks.{depth}.attn.q_norm.weight"),
                                         stored.get("head_num_heads"), preset.get("head_num_heads"), where, what,
                                         hints.get("head_num_heads"))
        body = {k: config[k] for k in cls.config_keys if k not in ("family", "model")}
        return {"family": cls.family, "model": preset_of({"family": cls.family, **body}), **body}


def _block_index(key: str) -> tuple[int, str]:
    parts = key.split(".")
    return (int(parts[1]), key) if len(parts) > 1 and parts[1].isdigit() else (-1, key)
