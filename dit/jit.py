"""JiT, "Just image Transformers" (Li & He 2025, "Back to Basics: Let Denoising Generative Models Denoise",
arXiv:2511.13720; github LTH14/JiT, model_jit.py): a plain ViT on pixels in large patches that predicts the clean
image (train it with `--objective flow --prediction x`, dit/flow.py), built here from LightningDiT's blocks.

Facts of the release that differ from LightningDiT (dit/lightningdit.py), whose blocks JiT uses as they are
(learned RMSNorm eps 1e-6, SwiGLU of width int(2/3 x int(4 D)) with biases, EVA's 2-D RoPE on q and k, RMSNorm
QK-norm, adaLN-Zero with c = t_emb + y_emb, DiT's sinusoidal time features, the sin-cos position table):
- the bottleneck patch embedding: a p x p convolution to `bottleneck_dim` channels without bias (`proj1`), then a
  1 x 1 convolution to the width with bias (`proj2`); both initialised xavier-uniform as Linears;
- in-context class tokens: before block `in_context_start`, `in_context_len` copies of the class embedding plus
  a learned position table (`in_context_posemb`, N(0, 0.02)) are put in front of the image tokens; from there on
  the RoPE tables have identity rows (cos 1, sin 0) for them; the final layer sees the image tokens only;
- presets B/L/H at patch 16 and 32 (JiT_models): B 12 x 768, 12 heads, bottleneck 128, start 4; L 24 x 1024,
  16 heads, bottleneck 128, start 8; H 32 x 1280, 16 heads, bottleneck 256, start 10; 32 in-context tokens.
Not reproduced: JiT's attention and projection dropout in the middle half of the blocks (0 in its B and L runs)
and its float32 attention logits; its own RoPE tables are not in its state_dict, ours are buffers.
"""
from __future__ import annotations

from typing import Any, Mapping, cast

import torch
from torch import nn

from .family import register_family
from .flops import FREQUENCY_EMBEDDING_SIZE, block_macs
from .infer import WeightsError, shapes_of
from .layers import run_block
from .lightningdit import OPTIONS, LightningDiT, swiglu_width
from .rope import EvaRope

_ARCH = ("depth", "hidden_size", "num_heads", "patch_size", "bottleneck_dim", "in_context_len", "in_context_start")
_SIZES = {"B": (12, 768, 12, 128, 32, 4), "L": (24, 1024, 16, 128, 32, 8), "H": (32, 1280, 16, 256, 32, 10)}


class BottleneckPatchEmbed(nn.Module):
    """[N, C, H, W] -> [N, T, D]: a p x p convolution to `bottleneck` channels (no bias), then a 1 x 1 one to D."""

    def __init__(self, patch_size: int, in_channels: int, bottleneck: int, hidden_size: int):
        super().__init__()
        self.proj1 = nn.Conv2d(in_channels, bottleneck, kernel_size=patch_size, stride=patch_size, bias=False)
        self.proj2 = nn.Conv2d(bottleneck, hidden_size, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj2(self.proj1(x)).flatten(2).transpose(1, 2)


class InContextRope(EvaRope):
    """EvaRope over `prefix` unrotated tokens (identity rows) followed by the patch grid."""

    def __init__(self, grid: int, head_dim: int, prefix: int):
        super().__init__(grid, head_dim)
        cos, sin = cast(torch.Tensor, getattr(self, "freqs_cos")), cast(torch.Tensor, getattr(self, "freqs_sin"))
        self.register_buffer("freqs_cos", torch.cat([torch.ones(prefix, head_dim), cos]))
        self.register_buffer("freqs_sin", torch.cat([torch.zeros(prefix, head_dim), sin]))


@register_family
class JiT(LightningDiT):
    """JiT: (x [N, C, S, S], t [N], y [N]) -> [N, C or 2C, S, S] (module docstring)."""

    family = "JiT"
    presets = {f"JiT-{k}/{p}": dict(zip(_ARCH, (d, w, h, p, b, n, s))) for k, (d, w, h, b, n, s) in _SIZES.items()
               for p in (16, 32)}
    overrides = (*_ARCH, *OPTIONS)  # type: ignore[assignment]
    config_keys = ("family", "model", "input_size", "num_classes", "learn_sigma",  # type: ignore[assignment]
                   "in_channels", *_ARCH, "class_dropout_prob", *OPTIONS)

    def __init__(self, input_size: int = 256, patch_size: int = 16, in_channels: int = 3, hidden_size: int = 768,
                 depth: int = 12, num_heads: int = 12, bottleneck_dim: int = 128, in_context_len: int = 32,
                 in_context_start: int = 4, class_dropout_prob: float = 0.1, num_classes: int = 1000,
                 learn_sigma: bool = False, qk_norm: bool = True, rms_norm: bool = True, swiglu: bool = True,
                 rope: bool = True, wo_shift: bool = False):
        if bottleneck_dim < 1 or in_context_len < 0 or not 0 <= in_context_start < depth:
            raise ValueError(f"invalid JiT configuration: bottleneck_dim {bottleneck_dim} must be >= 1, "
                             f"in_context_len {in_context_len} >= 0, in_context_start {in_context_start} in [0, {depth})")
        super().__init__(input_size=input_size, patch_size=patch_size, in_channels=in_channels,
                         hidden_size=hidden_size, depth=depth, num_heads=num_heads,
                         class_dropout_prob=class_dropout_prob, num_classes=num_classes, learn_sigma=learn_sigma,
                         qk_norm=qk_norm, rms_norm=rms_norm, swiglu=swiglu, rope=rope, wo_shift=wo_shift)
        self.bottleneck_dim, self.in_context_len, self.in_context_start = bottleneck_dim, in_context_len, in_context_start
        self.x_embedder = BottleneckPatchEmbed(patch_size, in_channels, bottleneck_dim, hidden_size)  # type: ignore[assignment]
        self.in_context_posemb = nn.Parameter(torch.zeros(1, in_context_len, hidden_size))
        self.feat_rope_incontext = (InContextRope(self.grid_size, hidden_size // num_heads, in_context_len)
                                    if rope else None)
        self._init_jit()

    @torch.no_grad()
    def _init_jit(self) -> None:
        """JiT's initialisation of what it adds: both patch convolutions xavier-uniform as [out, in*k*k] matrices,
        the second's bias zero; the in-context position table N(0, 0.02)."""
        emb = cast(BottleneckPatchEmbed, self.x_embedder)
        for conv in (emb.proj1, emb.proj2):
            nn.init.xavier_uniform_(conv.weight.view(conv.weight.shape[0], -1))
        nn.init.zeros_(cast(torch.Tensor, emb.proj2.bias))
        nn.init.normal_(self.in_context_posemb, std=0.02)

    @property
    def config(self) -> dict[str, Any]:
        base = super().config
        arch = {"bottleneck_dim": self.bottleneck_dim, "in_context_len": self.in_context_len,
                "in_context_start": self.in_context_start}
        return {**self.finish_config({**base, **arch}), **self.condition_config()}

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, force_drop_ids: torch.Tensor | None = None,
                generator: torch.Generator | None = None, return_hidden: int | None = None) -> Any:
        """As DiT's forward (dit/models.py), with the in-context class tokens of the module docstring;
        `return_hidden=k` returns the image tokens after block k."""
        self.check_inputs(x, t, y)
        self.check_return_hidden(return_hidden)
        h = self.x_embedder(x) + self.pos_embed  # [N, T, D]
        t_emb, y_emb = self.embed_conditions(t, y, force_drop_ids, generator)
        c = t_emb + y_emb  # [N, D]
        rope, hidden, prefix = self.feat_rope, None, 0
        for i, block in enumerate(self.blocks):
            if i == self.in_context_start and self.in_context_len:
                tokens = y_emb[:, None, :].expand(-1, self.in_context_len, -1) + self.in_context_posemb
                h = torch.cat([tokens.to(h.dtype), h], dim=1)  # [N, L + T, D]
                rope, prefix = self.feat_rope_incontext, self.in_context_len
            h = run_block(block, h, c, rope)
            if i + 1 == return_hidden:
                hidden = h[:, prefix:]
        out = self.unpatchify(self.final_layer(h[:, prefix:], c))
        return out if return_hidden is None else (out, hidden)

    @staticmethod
    def forward_macs(config: Mapping[str, Any]) -> int:
        d, p, c = int(config["hidden_size"]), int(config["patch_size"]), int(config["in_channels"])
        b, n, start = int(config["bottleneck_dim"]), int(config["in_context_len"]), int(config["in_context_start"])
        tokens = (int(config["input_size"]) // p) ** 2
        mlp = 3 * d * swiglu_width(d) if config["swiglu"] else 2 * d * 4 * d
        mod = 4 if config["wo_shift"] else 6
        c_out = 2 * c if config["learn_sigma"] else c
        blocks = (start * block_macs(tokens, d, mlp_macs_per_token=mlp, modulation=mod)
                  + (int(config["depth"]) - start) * block_macs(tokens + n, d, mlp_macs_per_token=mlp,
                                                                 modulation=mod))
        return (tokens * (c * p * p * b + b * d) + FREQUENCY_EMBEDDING_SIZE * d + d * d + blocks
                + 2 * d * d + tokens * d * p * p * c_out)

    @classmethod
    def fixed_tensors(cls, config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        out = LightningDiT.fixed_tensors(config)
        if config["rope"]:
            rope = InContextRope(config["input_size"] // config["patch_size"],
                                 config["hidden_size"] // config["num_heads"], config["in_context_len"])
            out.update({"feat_rope_incontext.freqs_cos": cast(torch.Tensor, rope.freqs_cos),
                        "feat_rope_incontext.freqs_sin": cast(torch.Tensor, rope.freqs_sin)})
        return out

    @classmethod
    def infer_config(cls, state_dict: Mapping[str, torch.Tensor], stored: Mapping[str, Any] | None,
                     where: str, hints: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Our own files only (their model_config states everything); the shapes must agree with it."""
        if not stored or stored.get("family") != cls.family:
            raise WeightsError(f"{where}: a JiT state_dict needs its model_config (our checkpoints and sidecars hold "
                               "it); JiT's own release files are not read")
        config = cls.finish_config(dict(stored))
        shapes = shapes_of(state_dict)
        want = {"x_embedder.proj1.weight": (config["bottleneck_dim"], config["in_channels"], config["patch_size"],
                                            config["patch_size"]),
                "in_context_posemb": (1, config["in_context_len"], config["hidden_size"])}
        bad = [f"{k} {list(shapes.get(k, ()))} (model_config: {list(v)})" for k, v in want.items() if shapes.get(k) != v]
        if bad:
            raise WeightsError(f"{where}: tensors contradict the model_config: {'; '.join(bad)}")
        return config

    @classmethod
    def finish_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        from .family import preset_of

        body = {k: config[k] for k in cls.config_keys if k not in ("family", "model")}
        return {"family": cls.family, "model": preset_of({"family": cls.family, **body}), **body}
