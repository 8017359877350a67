"""A DiT conditioned on text by cross-attention, as PixArt-alpha builds it (Chen et al. 2023, "PixArt-alpha: Fast
Training of Diffusion Transformer for Photorealistic Text-to-Image Synthesis", arXiv:2310.00426; github
PixArt-alpha/PixArt-alpha, diffusion/model/nets/PixArt.py and PixArt_blocks.py), from DiT's skeleton and the shared
cross-attention block (dit/layers.py `CrossAttentionBlock`), in its parameter names.

Facts of the release:
- tokens: x_embedder(x) + DiT's 2-D sin-cos table (`pos_embed`; its lewei_scale 1 and base size = the grid give DiT's
  table);
- time: DiT's sinusoidal embedder t = t_embedder(t); adaLN-single: one `t_block` = (SiLU, Linear(D, 6 D)) for every
  block, t0 = t_block(t), each block adding its own `scale_shift_table` [6, D];
- text (`CaptionEmbedder`): y_embedder.y_proj = Mlp(caption width -> D -> D, GELU tanh: fc1, fc2) of every text
  token; the blocks cross-attend to them with the padding keys masked;
- final layer (`T2IFinalLayer`): non-affine LayerNorm, shift and scale = `scale_shift_table` [2, D] + t (the time
  embedding itself, not t0), `linear`;
- initialisation (`initialize_weights`): every Linear xavier-uniform with zero bias, the patch embedding xavier on
  [D, C p p], the timestep MLP, t_block and y_proj weights N(0, 0.02), each cross-attention's output projection and
  the final linear zero; the scale-shift tables N(0, 1) / sqrt(D).
One departure: PixArt's caption dropout swaps in a fixed random caption (`y_embedding`, [120, 4096], a buffer); here the
null condition is the run's empty prompt's features, as for every text model (dit/conditioning.py).
"""
from __future__ import annotations

from typing import Any, Mapping, cast

import torch
from torch import nn

from .conditioning import check_text
from .conditions import check_time_input
from .embed import FREQUENCY_EMBEDDING_SIZE, pos_embed_2d
from .family import DiffusionTransformer, preset_of, register_family
from .infer import WeightsError, check_stored, require, shapes_of
from .layers import CrossAttentionBlock, Mlp, PatchEmbed, TimestepEmbedder, modulate, run_block
from .blocks import make_norm
from .models import MLP_RATIO, check_dims

_ARCH = ("depth", "hidden_size", "num_heads", "patch_size")
# PixArt.py PixArt_XL_2 (0.61B with T5-XXL's 4096-wide text); and the block at the sizes T2I models grow to, on the
# model-size family of SD3 (Esser et al. 2024, "Scaling Rectified Flow Transformers for High-Resolution Image
# Synthesis", arXiv:2403.03206: depth d, hidden size 64 d, d heads of 64): d = 29 (1.64B) and d = 36 (3.11B)
_PRESETS = {"PixArt-XL/2": (28, 1152, 16, 2), "PixArt-1.6B": (29, 1856, 29, 2), "PixArt-3B": (36, 2304, 36, 2)}


class CaptionEmbedder(nn.Module):
    """y_proj: Mlp(text width -> D -> D) of every text token (GELU tanh)."""

    def __init__(self, text_dim: int, hidden_size: int):
        super().__init__()
        self.y_proj = Mlp(text_dim, hidden_size, hidden_size)

    def forward(self, text: torch.Tensor) -> torch.Tensor:
        return self.y_proj(text)


class T2IFinalLayer(nn.Module):
    """linear(norm_final(x) * (1 + scale) + shift), (shift, scale) = scale_shift_table [2, D] + t [N, D]."""

    def __init__(self, dim: int, out_features: int):
        super().__init__()
        self.norm_final = make_norm(dim, rms_norm=False)
        self.linear = nn.Linear(dim, out_features)
        self.scale_shift_table = nn.Parameter(torch.randn(2, dim) / dim ** 0.5)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        shift, scale = (self.scale_shift_table[None] + t[:, None]).chunk(2, dim=1)  # each [N, 1, D]
        return self.linear(modulate(self.norm_final(x), shift, scale))


@register_family
class PixArt(DiffusionTransformer):
    """PixArt-alpha's network: (x [N, C, S, S], t [N], text [N, L, D_text], text_mask [N, L]) -> [N, C or 2C, S, S]
    (module docstring)."""

    family = "PixArt"
    presets = {name: dict(zip(_ARCH, dims)) for name, dims in _PRESETS.items()}
    overrides = (*_ARCH, "conditioning", "text_dim")
    config_keys = ("family", "model", "input_size", "num_classes", "learn_sigma", "in_channels", *_ARCH,
                   "class_dropout_prob")
    conditionings = ("text",)
    default_objective = "ddpm"  # PixArt-alpha trains DiT's diffusion (IDDPM, learned sigma)

    def __init__(self, input_size: int = 32, patch_size: int = 2, in_channels: int = 4, hidden_size: int = 1152,
                 depth: int = 28, num_heads: int = 16, class_dropout_prob: float = 0.1, num_classes: int = 1000,
                 learn_sigma: bool = True, conditioning: str = "text", text_dim: int = 4096):
        super().__init__()
        check_dims(self.family, input_size, patch_size, in_channels, hidden_size, depth, num_heads,
                   class_dropout_prob, num_classes, text_dim=text_dim)
        if conditioning != "text":
            raise ValueError(f"a {self.family} is conditioned on text, not {conditioning}")
        self.input_size, self.patch_size, self.in_channels = input_size, patch_size, in_channels
        self.hidden_size, self.depth, self.num_heads = hidden_size, depth, num_heads
        self.num_classes, self.class_dropout_prob = num_classes, float(class_dropout_prob)
        self.learn_sigma = bool(learn_sigma)
        self.condition_kind, self.text_dim = "text", int(text_dim)
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.grid_size = input_size // patch_size
        self.x_embedder = PatchEmbed(patch_size, in_channels, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid_size ** 2, hidden_size), requires_grad=False)
        self.t_block = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))
        self.y_embedder = CaptionEmbedder(text_dim, hidden_size)
        self.blocks = nn.ModuleList(CrossAttentionBlock(hidden_size, num_heads, MLP_RATIO) for _ in range(depth))
        self.final_layer = T2IFinalLayer(hidden_size, patch_size * patch_size * self.out_channels)
        self.initialize_weights()

    @torch.no_grad()
    def initialize_weights(self) -> None:
        """The release's initialisation (module docstring)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        self.pos_embed.copy_(torch.from_numpy(pos_embed_2d(self.hidden_size, self.grid_size)).float().unsqueeze(0))
        proj = self.x_embedder.proj
        nn.init.xavier_uniform_(proj.weight.view(proj.weight.shape[0], -1))
        nn.init.zeros_(cast(torch.Tensor, proj.bias))
        for layer in (self.t_embedder.mlp[0], self.t_embedder.mlp[2], self.t_block[1], self.y_embedder.y_proj.fc1,
                      self.y_embedder.y_proj.fc2):
            nn.init.normal_(cast(nn.Linear, layer).weight, std=0.02)
        for block in self.blocks:
            nn.init.zeros_(cast(CrossAttentionBlock, block).cross_attn.proj.weight)
            nn.init.zeros_(cast(CrossAttentionBlock, block).cross_attn.proj.bias)
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)

    @property
    def config(self) -> dict[str, Any]:
        body = {"input_size": self.input_size, "num_classes": self.num_classes, "learn_sigma": self.learn_sigma,
                "in_channels": self.in_channels, "depth": self.depth, "hidden_size": self.hidden_size,
                "num_heads": self.num_heads, "patch_size": self.patch_size,
                "class_dropout_prob": self.class_dropout_prob}
        return {"family": self.family, "model": preset_of({"family": self.family, **body}), **body,
                **self.conditioning().model_config(), **self.condition_config()}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "PixArt":
        return cls(**{k: config[k] for k in cls.config_keys if k not in ("model", "family")},
                   text_dim=int(config["text_dim"]))

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None,
                force_drop_ids: torch.Tensor | None = None, generator: torch.Generator | None = None,
                return_hidden: int | None = None, *, text: torch.Tensor | None = None,
                text_mask: torch.Tensor | None = None) -> Any:
        """x [N, C, S, S], t [N], text [N, L, text_dim] with text_mask [N, L] (True = a real token);
        `return_hidden=k` also returns the tokens after block k."""
        want = (self.in_channels, self.input_size, self.input_size)
        if x.dim() != 4 or tuple(x.shape[1:]) != want:
            raise ValueError(f"{self.family} expects x of shape [N, {want[0]}, {want[1]}, {want[2]}], got {list(x.shape)}")
        if text is None or text_mask is None:
            raise ValueError(f"a {self.family} takes text [N, L, {self.text_dim}] and text_mask [N, L]")
        check_text(text, text_mask, self.text_dim)
        check_time_input(self, t, x.shape[0])
        self.check_return_hidden(return_hidden)
        h = self.x_embedder(x) + self.pos_embed  # [N, T, D]
        t_emb = self.t_embedder(t)  # [N, D]
        t0 = self.t_block(t_emb)  # [N, 6 D]: adaLN-single
        tokens = self.y_embedder(text.to(self.y_embedder.y_proj.fc1.weight.dtype))  # [N, L, D]
        hidden = None
        for i, block in enumerate(self.blocks):
            h = run_block(block, h, tokens, t0, text_mask.bool())
            if i + 1 == return_hidden:
                hidden = h
        out = self.unpatchify(self.final_layer(h, t_emb))
        return out if return_hidden is None else (out, hidden)

    @staticmethod
    def forward_macs(config: Mapping[str, Any]) -> int:
        """Per image with L = 0 text tokens counted in the cross-attention's keys (their count varies by caption;
        `text_macs` adds them)."""
        d, p, c = int(config["hidden_size"]), int(config["patch_size"]), int(config["in_channels"])
        tokens = (int(config["input_size"]) // p) ** 2
        block = tokens * 4 * d * d + 2 * tokens * tokens * d + tokens * 2 * d * MLP_RATIO * d + tokens * 2 * d * d
        return int(tokens * d * c * p * p + FREQUENCY_EMBEDDING_SIZE * d + d * d + 6 * d * d
                   + int(config["depth"]) * block + tokens * d * p * p * c * (2 if config["learn_sigma"] else 1))

    @classmethod
    def fixed_tensors(cls, config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        grid = config["input_size"] // config["patch_size"]
        return {"pos_embed": torch.from_numpy(pos_embed_2d(config["hidden_size"], grid)).float().unsqueeze(0)}

    @classmethod
    def infer_config(cls, state_dict: Mapping[str, torch.Tensor], stored: Mapping[str, Any] | None,
                     where: str, hints: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The shapes, and the head count from the stored config, the preset or --num-heads."""
        shapes, stored, hints = shapes_of(state_dict), dict(stored or {}), dict(hints or {})
        require(shapes, ("x_embedder.proj.weight", "pos_embed", "t_block.1.weight", "y_embedder.y_proj.fc1.weight",
                         "final_layer.linear.weight"), cls.family, where)
        d, channels, patch, _ = shapes["x_embedder.proj.weight"]
        grid = int(round(shapes["pos_embed"][1] ** 0.5))
        depth = len({k.split(".")[1] for k in shapes if k.startswith("blocks.")})
        config: dict[str, Any] = {"input_size": grid * patch, "in_channels": channels, "depth": depth,
                                  "hidden_size": d, "patch_size": patch,
                                  "learn_sigma": shapes["final_layer.linear.weight"][0] == 2 * patch * patch * channels}
        check_stored(config, stored, list(config), where)
        heads = stored.get("num_heads") or next((a["num_heads"] for a in cls.presets.values()
                                                 if (a["depth"], a["hidden_size"]) == (depth, d)), None) \
            or hints.get("num_heads")
        if heads is None:
            raise WeightsError(f"{where}: a {cls.family} of depth {depth} and width {d} is no preset; pass --num-heads")
        config.update(num_heads=int(heads), num_classes=int(stored.get("num_classes", 1000)),
                      class_dropout_prob=float(stored.get("class_dropout_prob", 0.1)))
        body = {k: config[k] for k in cls.config_keys if k not in ("family", "model")}
        return {"family": cls.family, "model": preset_of({"family": cls.family, **body}), **body,
                "conditioning": "text", "text_dim": shapes["y_embedder.y_proj.fc1.weight"][1]}


def text_macs(config: Mapping[str, Any], text_tokens: int) -> int:
    """The MACs the cross-attention to `text_tokens` tokens adds per image: the text MLP, the keys and values, and
    the attention's two products."""
    d, td = int(config["hidden_size"]), int(config["text_dim"])
    tokens = (int(config["input_size"]) // int(config["patch_size"])) ** 2
    return text_tokens * (td * d + d * d) + int(config["depth"]) * (text_tokens * 2 * d * d
                                                                     + 2 * tokens * text_tokens * d)
