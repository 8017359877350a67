"""DDT, the decoupled diffusion transformer (Wang, Tian, Huang & Wang 2025, "DDT: Decoupled Diffusion Transformer",
arXiv:2504.05741; github MCG-NJU/DDT, src/models/denoiser/decoupled_improved_dit.py), in its release's parameter
names and shapes so its checkpoints load strictly.

Facts of the release:
- one stack of `depth` blocks of one width: the first `encoder_depth` encode the noisy input into a condition
  s (one vector per token), the rest decode: DDT-XL/2 is 22 encoder + 6 decoder blocks of width 1152;
- patches are unfolded (torch's unfold: features channel-major, c * p * p + a * p + b) and embedded by a Linear
  (`x_embedder.proj`, `s_embedder.proj`, [D, C p p]); the output is folded back the same way; no position table;
- timestep features: DiT's sinusoid with max_period 10; labels: a table with a null row (num_classes + 1), the
  trainer drops labels (p 0.1);
- c = silu(t_emb + y_emb); encoder blocks are modulated by c, then s = silu(t_emb + s); decoder blocks and the
  final layer are modulated by s token by token. adaLN is one Linear without a SiLU (`adaLN_modulation.0`);
- blocks: RMSNorm with learned scale (norm1, norm2), attention without qkv bias with RMSNorm QK-norm
  (`q_norm`, `k_norm`), RoPE of dit/rope.py `ddt_rope_tables` (positions 0..16, axes interleaved per pair), a
  LLaMA FFN w2(silu(w1 x) * w3 x) of width int(2 x int(4 D) / 3), no biases;
- final layer: non-affine LayerNorm (eps 1e-6), shift and scale from s;
- initialisation: the patch embeddings xavier (as matrices), labels N(0, 0.02), timestep MLP N(0, 0.02), the
  final layer zero; the blocks keep torch's default init (their adaLN is not zeroed).
Time runs as SiT's (x_t = t x + (1 - t) noise, t = 0 noise, the network predicts x - noise, raw t in [0, 1]).
The encoder state can be computed once and reused for neighbouring sampling steps (`encode` / `decode`).
"""
from __future__ import annotations

from typing import Any, Mapping, cast, overload

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import LayerNorm32
from .family import DiffusionTransformer, preset_of, register_family
from .flops import FREQUENCY_EMBEDDING_SIZE, block_macs
from .infer import WeightsError, block_count, check_stored, classes, heads, require, shapes_of
from .layers import AdaLNBlock, FinalLayer, LabelEmbedder, LlamaFFN, RMSNorm, TimestepEmbedder, run_block
from .models import LN_EPS, check_dims
from .rope import DDTRope

MAX_PERIOD = 10.0
_ARCH = ("depth", "encoder_depth", "hidden_size", "num_heads", "patch_size")
# the patch size of a DDT file that states none (no model_config, no preset of its size): the release's default and
# the one of both its configs (MCG-NJU/DDT src/models/denoiser/decoupled_improved_dit.py DDT(patch_size=2),
# configs/repa_improved_ddt_xlen22de6_*.yaml); a file of another patch size needs its sidecar or --model
RELEASE_PATCH = 2


def ffn_width(dim: int) -> int:
    """The release's FeedForward width: int(2 x int(dim x 4.0) / 3)."""
    return int(2 * int(dim * 4.0) / 3)


class TokenEmbed(nn.Module):
    """Linear embedding of unfolded patches [N, T, C p p] -> [N, T, D] (named `proj` as in the release)."""

    def __init__(self, features: int, hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(features, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


@register_family
class DDT(DiffusionTransformer):
    """DDT: (x [N, C, S, S], t [N], y [N]) -> [N, C or 2C, S, S] (module docstring)."""

    family = "DDT"
    presets = {"DDT-XL/2": dict(zip(_ARCH, (28, 22, 1152, 16, 2)))}
    overrides = (*_ARCH, "qk_norm")
    config_keys = ("family", "model", "input_size", "num_classes", "learn_sigma", "in_channels", "depth",
                   "encoder_depth", "hidden_size", "num_heads", "patch_size", "class_dropout_prob", "qk_norm")

    def __init__(self, input_size: int = 32, patch_size: int = 2, in_channels: int = 4, hidden_size: int = 1152,
                 depth: int = 28, encoder_depth: int = 22, num_heads: int = 16, class_dropout_prob: float = 0.1,
                 num_classes: int = 1000, learn_sigma: bool = False, qk_norm: bool = True):
        super().__init__()
        check_dims(self.family, input_size, patch_size, in_channels, hidden_size, depth, num_heads,
                   class_dropout_prob, num_classes, encoder_depth=encoder_depth)
        if not encoder_depth < depth or (hidden_size // num_heads) % 4:
            raise ValueError(f"invalid DDT configuration: encoder_depth {encoder_depth} must be below depth {depth} "
                             f"(the rest decode), and the head width {hidden_size // num_heads} divisible by 4 (RoPE)")
        self.input_size, self.patch_size, self.in_channels = input_size, patch_size, in_channels
        self.hidden_size, self.depth, self.encoder_depth, self.num_heads = hidden_size, depth, encoder_depth, num_heads
        self.num_classes, self.class_dropout_prob = num_classes, float(class_dropout_prob)
        self.learn_sigma, self.qk_norm = bool(learn_sigma), bool(qk_norm)
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.grid_size = input_size // patch_size
        features = in_channels * patch_size * patch_size
        self.x_embedder = TokenEmbed(features, hidden_size)
        self.s_embedder = TokenEmbed(features, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size, max_period=MAX_PERIOD)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        self.final_layer = FinalLayer(hidden_size, self.out_channels * patch_size * patch_size,
                                      LayerNorm32(hidden_size, elementwise_affine=False, eps=LN_EPS), silu=False)
        self.blocks = nn.ModuleList(
            AdaLNBlock(hidden_size, num_heads, norm=RMSNorm, mlp=lambda d: LlamaFFN(d, ffn_width(d)),
                       qk_norm=RMSNorm if qk_norm else None, qkv_bias=False, silu=False) for _ in range(depth))
        self.rope = DDTRope(self.grid_size, hidden_size // num_heads)
        self.initialize_weights()

    @torch.no_grad()
    def initialize_weights(self) -> None:
        """The release's initialisation (module docstring)."""
        for embed in (self.x_embedder, self.s_embedder):
            nn.init.xavier_uniform_(embed.proj.weight)
            nn.init.zeros_(embed.proj.bias)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(cast(nn.Linear, self.t_embedder.mlp[0]).weight, std=0.02)
        nn.init.normal_(cast(nn.Linear, self.t_embedder.mlp[2]).weight, std=0.02)
        for layer in (cast(nn.Linear, self.final_layer.adaLN_modulation[-1]), self.final_layer.linear):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    @property
    def config(self) -> dict[str, Any]:
        body = {"input_size": self.input_size, "num_classes": self.num_classes, "learn_sigma": self.learn_sigma,
                "in_channels": self.in_channels, "depth": self.depth, "encoder_depth": self.encoder_depth,
                "hidden_size": self.hidden_size, "num_heads": self.num_heads, "patch_size": self.patch_size,
                "class_dropout_prob": self.class_dropout_prob, "qk_norm": self.qk_norm}
        return {"family": self.family, "model": preset_of({"family": self.family, **body}), **body,
                **self.condition_config()}

    # -- the two halves ----------------------------------------------------------------------------------------
    def patches(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C, S, S] -> [N, T, C p p], torch's unfold order (channel-major features, row-major tokens)."""
        return F.unfold(x, kernel_size=self.patch_size, stride=self.patch_size).transpose(1, 2)

    def encode(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, force_drop_ids: torch.Tensor | None = None,
               generator: torch.Generator | None = None,
               hidden: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The encoder's condition s [N, T, D] = silu(t_emb + encoder(x)); `hidden` collects each block's output."""
        t_emb, y_emb = self.embed_conditions(t, y, force_drop_ids, generator)
        t_emb = t_emb[:, None]  # [N, 1, D]
        c = F.silu(t_emb + y_emb[:, None])
        s = self.s_embedder(self.patches(x))
        for block in list(self.blocks)[: self.encoder_depth]:
            s = run_block(block, s, c, self.rope)
            if hidden is not None:
                hidden.append(s)
        return F.silu(t_emb + s)

    def decode(self, x: torch.Tensor, s: torch.Tensor, hidden: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The output [N, Cout, S, S] of the decoder blocks and final layer, modulated by s token by token."""
        h = self.x_embedder(self.patches(x))
        for block in list(self.blocks)[self.encoder_depth:]:
            h = run_block(block, h, s, self.rope)
            if hidden is not None:
                hidden.append(h)
        out = self.final_layer(h, s)  # [N, T, Cout p p]
        return F.fold(out.transpose(1, 2), (self.input_size, self.input_size), kernel_size=self.patch_size,
                      stride=self.patch_size)

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
        """As DiT.forward; `return_hidden=k` returns the tokens after block k (encoder or decoder)."""
        self.check_inputs(x, t, y)
        self.check_return_hidden(return_hidden)
        hidden: list[torch.Tensor] | None = [] if return_hidden is not None else None
        out = self.decode(x, self.encode(x, t, y, force_drop_ids, generator, hidden), hidden)
        return out if hidden is None else (out, hidden[cast(int, return_hidden) - 1])

    # -- files ---------------------------------------------------------------------------------------------------
    @staticmethod
    def forward_macs(config: Mapping[str, Any]) -> int:
        d, p = int(config["hidden_size"]), int(config["patch_size"])
        features = int(config["in_channels"]) * p * p
        tokens = (int(config["input_size"]) // p) ** 2
        mlp = 3 * d * ffn_width(d)
        enc, dec = int(config["encoder_depth"]), int(config["depth"]) - int(config["encoder_depth"])
        out = features * (2 if config["learn_sigma"] else 1)
        return (2 * tokens * features * d + FREQUENCY_EMBEDDING_SIZE * d + d * d
                + enc * block_macs(tokens, d, mlp_macs_per_token=mlp)
                + dec * block_macs(tokens, d, mlp_macs_per_token=mlp, per_token_condition=True)
                + tokens * 2 * d * d + tokens * d * out)

    @classmethod
    def describe(cls, config: Mapping[str, Any]) -> str:
        return (f"depth {config['depth']} ({config['encoder_depth']} encoder + "
                f"{config['depth'] - config['encoder_depth']} decoder blocks), hidden {config['hidden_size']}, heads "
                f"{config['num_heads']}, patch {config['patch_size']}")

    @classmethod
    def infer_config(cls, state_dict: Mapping[str, torch.Tensor], stored: Mapping[str, Any] | None,
                     where: str, hints: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The shapes give width, depth, learned sigma and QK-norm; the encoder/decoder split, the patch size (the
        embedding sees C p p features) and the latent size (no position table) come from a stored config or the
        preset of this width and depth."""
        shapes, stored, hints = shapes_of(state_dict), dict(stored or {}), dict(hints or {})
        require(shapes, ("x_embedder.proj.weight", "s_embedder.proj.weight", "y_embedder.embedding_table.weight",
                         "final_layer.linear.weight"), "DDT", where)
        hidden, features = shapes["x_embedder.proj.weight"]
        depth = block_count(shapes)
        config: dict[str, Any] = {"depth": depth, "hidden_size": hidden,
                                  "qk_norm": "blocks.0.attn.q_norm.weight" in shapes}
        check_stored(config, stored, list(config), where)
        preset = next((a for a in cls.presets.values() if (a["depth"], a["hidden_size"]) == (depth, hidden)), {})
        for key in ("encoder_depth", "patch_size"):
            config[key] = next((v for v in (stored.get(key), preset.get(key), hints.get(key),
                                            RELEASE_PATCH if key == "patch_size" else None) if v is not None), None)
            if config[key] is None:
                raise WeightsError(f"{where}: a DDT of depth {depth} x width {hidden} is no preset and the file has no "
                                   f"model_config, so its {key} is unknown; pass --model with its preset, "
                                   "--encoder-depth, or put a JSON sidecar with the model_config beside the file")
        p = int(config["patch_size"])
        if features % (p * p):
            raise WeightsError(f"{where}: x_embedder takes {features} features, not C x {p} x {p}")
        config["in_channels"] = features // (p * p)
        out_features = shapes["final_layer.linear.weight"][0]
        if out_features not in (features, 2 * features):
            raise WeightsError(f"{where}: final_layer.linear has {out_features} outputs; expected {features} or "
                               f"{2 * features}")
        config["learn_sigma"] = out_features == 2 * features
        size = stored.get("input_size", hints.get("input_size"))
        if size is None:
            raise WeightsError(f"{where}: DDT files do not record the latent size (DDT has no position table); pass "
                               "--input-size (the latent side, e.g. 32 for 256 px images and an f8 VAE)")
        config["input_size"] = int(size)
        config["num_classes"], config["class_dropout_prob"] = classes(
            shapes["y_embedder.embedding_table.weight"][0], stored, where)
        config["num_heads"] = heads(hidden, shapes, ("blocks.0.attn.q_norm.weight",), stored.get("num_heads"),
                                    preset.get("num_heads"), where, f"depth {depth} x width {hidden} is no DDT preset",
                                    hints.get("num_heads"))
        body = {k: config[k] for k in cls.config_keys if k not in ("family", "model")}
        return {"family": cls.family, "model": preset_of({"family": cls.family, **body}), **body}
