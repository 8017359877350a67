"""NanoGen's in-context DiT-DH (github End2End-Diffusion/diffusion-bench, src/stage2/models/DDT.py `DiTwDDTHead`,
its parts in src/stage2/models/model_utils.py): RAE's encoder + wide-head split (dit/ditdh.py), conditioned IN
CONTEXT instead of by adaLN, in its release's parameter names and shapes so its checkpoints load strictly. The
network and its presets; its embedders, blocks and final layer are dit/incontext_blocks.py.

Facts of the release:
- the encoder's sequence (`_build_sequence`): [image tokens s_embedder(x), no position table; `num_t_tokens` time
  tokens; for MeanFlow as many tokens of the second time; the condition tokens: class or text tokens]. A text
  model's padding mask becomes an additive key mask (0 / finfo.min, `_build_attn_mask`) over the whole sequence in
  every encoder block; NanoGen pads its text to `num_c_tokens` = the encoder's max length (256);
- RoPE (`RoPE`): EVA's 2-D layout on integer positions for the image tokens, angle 0 for the time and condition
  tokens that follow them (dit/rope.py `TokenRope`); buffers `enc_rope.freqs_*` [T + condition tokens, head width],
  `dec_rope.freqs_*` [T, head width];
- `depth` encoder blocks (`DDTEncoderBlock`), then the condition tokens are dropped: s = s_projector(silu(t_emb +
  s[:, :T])), t_emb the time MLP's output without the learnable tokens (for MeanFlow the first time embedder's,
  which embeds h);
- head: `head_depth` blocks (`DDTDecoderBlock`) on x_embedder(x), with adaLN of s token by token, RoPE on all its
  tokens, no mask; then the final layer (`DDTFinalLayer`), modulated by s token by token;
- MeanFlow (`is_meanflow`): the network takes h = t - r as its time and t as `t_abs` (`t_abs_embedder`, the same
  kind of time tokens); here the time input is dit/conditions.py's (t, h);
- initialisation (`initialize_weights`): patch embeddings xavier on [D, C p p] with zero bias, label table
  N(0, 0.02), learnable tokens N(0, 1 / sqrt(D)), time MLP weights N(0, 0.02), every adaLN Linear and the final
  linear zero, everything else torch's defaults;
- files `{step, epoch, model, ema, optimizer, scheduler}` (src/utils/checkpoint.py), sampled from `ema`; its runs
  learn the velocity noise - data in REPA's time (t = 1 noise; stage2/transport/transport.py), or x (the flow
  objective's prediction setting: the network is the same).
- REG (`enable_reg`, the `reg0.03` configs; here `reg_dim` = NanoGen's z_dim, the class token's width, 0 = off): the
  noisy DINOv2 class token cls_t [N, z] enters both sequences in front, cls_in_norm_enc(cls_in_proj_enc(cls_t))
  before the encoder's image tokens and cls_in_norm_dec(cls_in_proj_dec(cls_t)) before the head's (`_build_sequence`,
  `forward`; the `rmsnorm` of the config names is this learned RMSNorm after each projection: no setting switches
  it), with RoPE angle 0 (`RoPE(extra_tokens=1)`: one more row in front of both tables); it is kept with the image
  tokens when the condition tokens are dropped, so s has T + 1 tokens; the final layer's `cls_linear` (zero-
  initialised) reads it back after the shared modulation: the forward returns (out, cls_pred [N, z]);
- internal guidance (`DiTwDDTHeadIG`, `internal_guidance.base_model_depth`; here `base_model_depth`, 0 = off): a
  second final layer `base_final_layer` (zero-initialised) on the image tokens after encoder block base_model_depth,
  base_final_layer(silu(t_emb + those tokens)) conditioned on that very tensor; returned on request (`return_base`):
  (out, base[, cls_pred]) in NanoGen's order (dit/guidance.py combines them).
Not built: REPA's projector inside the model (`repa_projector`, dropped when a file holds it: dit/releases.py); a
NanoGen file's base head is dropped too unless its record names base_model_depth (the tensors do not show it).
"""
from __future__ import annotations

from typing import Any, Mapping, cast

import torch
import torch.nn.functional as F
from torch import nn

from .conditioning import CONDITIONINGS, check_text, conditioning_of, kind_of
from .conditions import check_time_input, conditions_of
from .embed import FREQUENCY_EMBEDDING_SIZE
from .family import DiffusionTransformer, preset_of, register_family
from .flops import block_macs
from .incontext_blocks import (ClassTokens, DecoderBlock, EncoderBlock, TextTokensEmbedder, TimeTokens, TokenFinalLayer,
                               swiglu_width)
from .infer import WeightsError, check_stored, require, shapes_of
from .layers import PatchEmbed, RMSNorm, run_block
from .models import check_dims
from .rope import TokenRope

_ARCH = ("depth", "hidden_size", "num_heads", "head_depth", "head_hidden_size", "head_num_heads", "patch_size")
_TOKENS = ("num_t_tokens", "num_c_tokens")
_HEADS = ("reg_dim", "base_model_depth")  # REG's class token and internal guidance's base head; recorded when on
# NanoGen's model names: encoder depth, width, head width; decoder depth, width, head width
# (configs/stage2/training/imagenet/ddt-en28d1152hd72-dn2d2048hd128-*.yaml, t2i/t2i-ddt-en28d1584hd72-*-512res.yaml)
# And larger encoders, named as NanoGen names its models, on SD3's model-size family (Esser et al. 2024, arXiv:2403.03206:
# depth d, hidden size 64 d, d heads of 64) with the release's 2-block head of width 2048: d = 31 (1.64B with a
# 1024-wide text encoder and 256 text tokens) and d = 39 (3.09B).
_PRESETS = {"ddt-en28d1152hd72-dn2d2048hd128": (28, 1152, 16, 2, 2048, 16, 2),
            "ddt-en28d1584hd72-dn2d2048hd128": (28, 1584, 22, 2, 2048, 16, 2),
            "ddt-en31d1984hd64-dn2d2048hd128": (31, 1984, 31, 2, 2048, 16, 2),
            "ddt-en39d2496hd64-dn2d2048hd128": (39, 2496, 39, 2, 2048, 16, 2)}
NULL_DROPOUT = 0.1  # NanoGen's cfg_dropout_prob (configs/stage2.py ConditioningConfig), for files without a record


@register_family
class InContextDiTDH(DiffusionTransformer):
    """NanoGen's DiT-DH: (x [N, C, S, S], t [N], y [N] or text [N, L, D_text] + text_mask [N, L]) -> [N, C, S, S]
    (module docstring)."""

    family = "DiT-DH-IC"
    presets = {name: dict(zip(_ARCH, dims)) for name, dims in _PRESETS.items()}
    aliases = {"DiTwDDTHead": "ddt-en28d1152hd72-dn2d2048hd128", "DiT-DH-IC-1.6B": "ddt-en31d1984hd64-dn2d2048hd128",
               "DiT-DH-IC-3B": "ddt-en39d2496hd64-dn2d2048hd128"}
    overrides = (*_ARCH, *_TOKENS, "conditioning", "text_dim", *_HEADS)
    config_keys = ("family", "model", "input_size", "num_classes", "learn_sigma", "in_channels", *_ARCH, *_TOKENS,
                   "class_dropout_prob")
    conditionings = CONDITIONINGS

    def __init__(self, input_size: int = 32, patch_size: int = 2, in_channels: int = 4, hidden_size: int = 1152,
                 depth: int = 28, num_heads: int = 16, head_depth: int = 2, head_hidden_size: int = 2048,
                 head_num_heads: int = 16, num_t_tokens: int = 4, num_c_tokens: int | None = None,
                 class_dropout_prob: float = NULL_DROPOUT, num_classes: int = 1000, learn_sigma: bool = False,
                 conditioning: str = "class", text_dim: int = 0, reg_dim: int = 0, base_model_depth: int = 0):
        super().__init__()
        check_dims(self.family, input_size, patch_size, in_channels, hidden_size, depth, num_heads,
                   class_dropout_prob, num_classes, head_depth=head_depth, head_hidden_size=head_hidden_size,
                   head_num_heads=head_num_heads, num_t_tokens=num_t_tokens)
        kind = kind_of({"conditioning": conditioning})
        if num_c_tokens is None:  # NanoGen's c8 for labels; none for an unconditional model; text: its longest
            num_c_tokens = {"class": 8, "none": 0}.get(kind, 0)
        problems = []
        if head_hidden_size % head_num_heads or hidden_size // num_heads % 4 or head_hidden_size // head_num_heads % 4:
            problems.append(f"head_hidden_size {head_hidden_size} must divide into {head_num_heads} heads, and both "
                            "head widths by 4 (2-D RoPE)")
        if kind == "none" and num_c_tokens:
            problems.append(f"an unconditional model has no condition tokens: num_c_tokens 0, got {num_c_tokens}")
        elif kind != "none" and (isinstance(num_c_tokens, bool) or not isinstance(num_c_tokens, int)
                                 or num_c_tokens < 1):
            problems.append(f"num_c_tokens (class tokens, or the longest text) must be >= 1, got {num_c_tokens!r}")
        if kind == "text" and (isinstance(text_dim, bool) or not isinstance(text_dim, int) or text_dim < 1):
            problems.append(f"a text-conditional model needs text_dim >= 1 (its text features' width), got {text_dim!r}")
        if isinstance(reg_dim, bool) or not isinstance(reg_dim, int) or reg_dim < 0:
            problems.append(f"reg_dim (REG's class token width; 0: none) must be an integer >= 0, got {reg_dim!r}")
        if isinstance(base_model_depth, bool) or not isinstance(base_model_depth, int) \
                or not 0 <= base_model_depth <= depth:
            problems.append(f"base_model_depth (internal guidance's base head after that encoder block; 0: none) must "
                            f"be in 0..{depth}, got {base_model_depth!r}")
        if problems:
            raise ValueError("invalid DiT-DH-IC configuration: " + "; ".join(problems))
        self.input_size, self.patch_size, self.in_channels = input_size, patch_size, in_channels
        self.hidden_size, self.depth, self.num_heads = hidden_size, depth, num_heads
        self.head_hidden_size, self.head_depth, self.head_num_heads = head_hidden_size, head_depth, head_num_heads
        self.num_t_tokens, self.num_c_tokens = num_t_tokens, num_c_tokens
        self.num_classes, self.class_dropout_prob = num_classes, float(class_dropout_prob)
        self.learn_sigma = bool(learn_sigma)
        self.condition_kind, self.text_dim = kind, int(text_dim) if kind == "text" else 0
        self.reg_dim, self.base_model_depth = reg_dim, base_model_depth
        r = 1 if reg_dim else 0  # REG's class token in front of both sequences
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.grid_size = input_size // patch_size
        # the release's construction order
        self.s_embedder = PatchEmbed(patch_size, in_channels, hidden_size)
        self.x_embedder = PatchEmbed(patch_size, in_channels, head_hidden_size)
        self.s_projector = nn.Linear(hidden_size, head_hidden_size) if hidden_size != head_hidden_size else nn.Identity()
        self.t_embedder = TimeTokens(hidden_size, num_t_tokens)
        self.ctx_embedder: nn.Module | None = (
            ClassTokens(num_classes, hidden_size, class_dropout_prob, num_c_tokens) if kind == "class"
            else TextTokensEmbedder(text_dim, hidden_size) if kind == "text" else None)
        self.blocks = nn.ModuleList([*(EncoderBlock(hidden_size, num_heads) for _ in range(depth)),
                                     *(DecoderBlock(head_hidden_size, head_num_heads) for _ in range(head_depth))])
        self.final_layer = TokenFinalLayer(head_hidden_size, patch_size * patch_size * self.out_channels, reg_dim)
        self.enc_rope = TokenRope(self.grid_size, hidden_size // num_heads, num_t_tokens + num_c_tokens, prefix=r)
        self.dec_rope = TokenRope(self.grid_size, head_hidden_size // head_num_heads, prefix=r)
        if reg_dim:
            self.cls_in_proj_enc = nn.Linear(reg_dim, hidden_size)
            self.cls_in_norm_enc = RMSNorm(hidden_size)
            self.cls_in_proj_dec = nn.Linear(reg_dim, head_hidden_size)
            self.cls_in_norm_dec = RMSNorm(head_hidden_size)
        self.initialize_weights()
        if base_model_depth:  # DiTwDDTHeadIG: built after the rest, adaLN and linear zero
            self.base_final_layer = TokenFinalLayer(hidden_size, patch_size * patch_size * in_channels)
            for layer in (cast(nn.Linear, self.base_final_layer.adaln_modulation[-1]), self.base_final_layer.linear):
                nn.init.zeros_(layer.weight)
                nn.init.zeros_(layer.bias)

    @torch.no_grad()
    def initialize_weights(self) -> None:
        """The release's initialisation (module docstring)."""
        for embed in (self.x_embedder, self.s_embedder):
            nn.init.xavier_uniform_(embed.proj.weight.view(embed.proj.weight.shape[0], -1))
            nn.init.zeros_(cast(torch.Tensor, embed.proj.bias))
        if isinstance(self.ctx_embedder, ClassTokens):
            nn.init.normal_(self.ctx_embedder.embedding_table.weight, std=0.02)
        for block in self.blocks[self.depth:]:
            layer = cast(nn.Linear, cast(DecoderBlock, block).adaln_modulation[-1])
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)
        nn.init.normal_(cast(nn.Linear, self.t_embedder.mlp[0]).weight, std=0.02)
        nn.init.normal_(cast(nn.Linear, self.t_embedder.mlp[2]).weight, std=0.02)
        for layer in (cast(nn.Linear, self.final_layer.adaln_modulation[-1]), self.final_layer.linear,
                      *([self.final_layer.cls_linear] if self.reg_dim else [])):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def set_conditions(self, kind: str) -> "InContextDiTDH":
        """MeanFlow's second time as NanoGen builds it: `t_abs_embedder`, time tokens of the same kind (its MLP
        weights N(0, 0.02)); the encoder's RoPE table grows by those tokens. iMF's inputs are not built."""
        if kind == self.conditions:
            return self
        if kind != "meanflow" or self.conditions != "t":
            raise ValueError(f"a {self.family} takes the time input 't' or MeanFlow's 'meanflow', not {kind!r}")
        self.conditions = kind
        device = self.t_embedder.W.device
        with torch.device(device):
            self.t_abs_embedder = TimeTokens(self.hidden_size, self.num_t_tokens)
            self.enc_rope = TokenRope(self.grid_size, self.hidden_size // self.num_heads,
                                      2 * self.num_t_tokens + self.num_c_tokens, prefix=1 if self.reg_dim else 0)
        if device.type != "meta":
            with torch.no_grad():
                nn.init.normal_(cast(nn.Linear, self.t_abs_embedder.mlp[0]).weight, std=0.02)
                nn.init.normal_(cast(nn.Linear, self.t_abs_embedder.mlp[2]).weight, std=0.02)
        return self

    @property
    def config(self) -> dict[str, Any]:
        body = {"input_size": self.input_size, "num_classes": self.num_classes, "learn_sigma": self.learn_sigma,
                "in_channels": self.in_channels, "depth": self.depth, "hidden_size": self.hidden_size,
                "num_heads": self.num_heads, "head_depth": self.head_depth, "head_hidden_size": self.head_hidden_size,
                "head_num_heads": self.head_num_heads, "patch_size": self.patch_size,
                "num_t_tokens": self.num_t_tokens, "num_c_tokens": self.num_c_tokens,
                "class_dropout_prob": self.class_dropout_prob}
        return {"family": self.family, "model": preset_of({"family": self.family, **body}), **body,
                **self.conditioning().model_config(), **self.condition_config(),
                **{k: getattr(self, k) for k in _HEADS if getattr(self, k)}}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "InContextDiTDH":
        kind = kind_of(config)
        return cls(**{k: config[k] for k in cls.config_keys if k not in ("model", "family")}, conditioning=kind,
                   text_dim=int(config.get("text_dim", 0)) if kind == "text" else 0,
                   reg_dim=int(config.get("reg_dim") or 0), base_model_depth=int(config.get("base_model_depth") or 0))

    def hidden_size_at(self, k: int) -> int:
        return self.hidden_size if k <= self.depth else self.head_hidden_size

    # -- the forward pass ------------------------------------------------------------------------------------------
    def _time_tokens(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(t_emb [N, 1, D], the time tokens [N, n_t (x 2 for MeanFlow), D])."""
        if self.conditions == "t":
            return self.t_embedder.tokens(t)
        base, tokens = self.t_embedder.tokens(t[:, 1])  # NanoGen's network time is h = t - r ...
        _, absolute = self.t_abs_embedder.tokens(t[:, 0])  # ... and t_abs = t
        return base, torch.cat([tokens, absolute], dim=1)

    def _condition_tokens(self, n: int, y: torch.Tensor | None, force_drop_ids: torch.Tensor | None,
                          generator: torch.Generator | None, text: torch.Tensor | None,
                          text_mask: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(the condition tokens [N, n_c or L, D] or None, the padding mask of the text tokens [N, L] or None)."""
        if self.condition_kind == "class":
            if y is None or y.shape != (n,):
                raise ValueError(f"a class-conditional {self.family} takes labels y of shape [{n}]")
            return cast(ClassTokens, self.ctx_embedder)(y, force_drop_ids, generator), None
        if self.condition_kind == "text":
            if text is None or text_mask is None:
                raise ValueError(f"a text-conditional {self.family} takes text [N, L, {self.text_dim}] and text_mask "
                                 "[N, L] (bool, True = a real token)")
            check_text(text, text_mask, self.text_dim)
            if text.shape[0] != n or text.shape[1] > self.num_c_tokens:
                raise ValueError(f"text of shape {list(text.shape)}: this model takes {n} rows of at most "
                                 f"{self.num_c_tokens} tokens")
            embedder = cast(TextTokensEmbedder, self.ctx_embedder)
            return embedder(text), text_mask.bool()
        return None, None

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None,
                force_drop_ids: torch.Tensor | None = None, generator: torch.Generator | None = None,
                return_hidden: int | None = None, *, text: torch.Tensor | None = None,
                text_mask: torch.Tensor | None = None, cls_t: torch.Tensor | None = None,
                return_base: bool = False) -> Any:
        """As DiT.forward, with text and text_mask in place of y for a text-conditional model; `return_hidden=k`
        returns the image tokens after block k too (encoder width for k <= depth, the head's beyond). A REG model
        takes the noisy class token `cls_t` [N, reg_dim] and returns (out, cls_pred); `return_base` (a model with
        internal guidance's base head) returns (out, base[, cls_pred]), NanoGen's order (module docstring)."""
        want = (self.in_channels, self.input_size, self.input_size)
        if x.dim() != 4 or tuple(x.shape[1:]) != want:
            raise ValueError(f"{self.family} expects x of shape [N, {want[0]}, {want[1]}, {want[2]}], "
                             f"got {list(x.shape)}")
        check_time_input(self, t, x.shape[0])
        self.check_return_hidden(return_hidden)
        n, tokens, r = x.shape[0], self.grid_size ** 2, 1 if self.reg_dim else 0
        self._check_heads(n, cls_t, return_base)
        t_emb, time = self._time_tokens(t)
        cond, text_keep = self._condition_tokens(n, y, force_drop_ids, generator, text, text_mask)
        front = [self.cls_in_norm_enc(self.cls_in_proj_enc(cls_t))[:, None]] if cls_t is not None else []
        s = torch.cat([*front, self.s_embedder(x), time, *([] if cond is None else [cond])], dim=1)  # [N, R+T+E, D]
        keep = None if text_keep is None else torch.cat([text_keep.new_ones(n, s.shape[1] - text_keep.shape[1]),
                                                         text_keep], dim=1)
        hidden, base = [], None
        for i, block in enumerate(list(self.blocks)[: self.depth]):
            s = run_block(block, s, self.enc_rope, keep)
            hidden.append(s[:, r:r + tokens])
            if return_base and i + 1 == self.base_model_depth:
                base = s[:, r:r + tokens]
        s = self.s_projector(F.silu(t_emb + s[:, :r + tokens]))  # [N, R+T, D_head]: the condition tokens dropped
        h = self.x_embedder(x)
        if cls_t is not None:
            h = torch.cat([self.cls_in_norm_dec(self.cls_in_proj_dec(cls_t))[:, None], h], dim=1)
        for block in list(self.blocks)[self.depth:]:
            h = run_block(block, h, s, self.dec_rope)
            hidden.append(h[:, r:])
        out: Any = self.final_layer(h, s)
        extras: list[torch.Tensor] = []
        if cls_t is not None:
            out, cls_pred = out
        out = self.unpatchify(out)
        if base is not None:
            b = F.silu(t_emb + base)
            extras.append(self.unpatchify(self.base_final_layer(b, b), self.in_channels))
        if cls_t is not None:
            extras.append(cls_pred)
        result = (out, *extras) if extras else out
        return result if return_hidden is None else (result, hidden[return_hidden - 1])

    def _check_heads(self, n: int, cls_t: torch.Tensor | None, return_base: bool) -> None:
        if self.reg_dim and (cls_t is None or tuple(cls_t.shape) != (n, self.reg_dim)):
            got = "none" if cls_t is None else list(cls_t.shape)
            raise ValueError(f"this {self.family} has REG's class token: it takes cls_t of shape [{n}, "
                             f"{self.reg_dim}], got {got}")
        if not self.reg_dim and cls_t is not None:
            raise ValueError(f"cls_t given, but this {self.family} has no REG class token (reg_dim 0)")
        if return_base and not self.base_model_depth:
            raise ValueError(f"return_base: this {self.family} has no internal-guidance base head "
                             "(base_model_depth 0)")

    # -- files ---------------------------------------------------------------------------------------------------
    @staticmethod
    def forward_macs(config: Mapping[str, Any]) -> int:
        d, dh, p = int(config["hidden_size"]), int(config["head_hidden_size"]), int(config["patch_size"])
        c = int(config["in_channels"])
        tokens = (int(config["input_size"]) // p) ** 2
        times = 2 if conditions_of(config) == "meanflow" else 1
        extra = times * int(config["num_t_tokens"]) + int(config["num_c_tokens"])  # text: its longest, NanoGen's pad
        text = int(config["num_c_tokens"]) * int(config.get("text_dim", 0)) * d if kind_of(config) == "text" else 0
        z = int(config.get("reg_dim") or 0)
        r = 1 if z else 0  # REG's class token in both sequences: its two input projections and cls_linear
        base = tokens * (2 * d * d + d * p * p * c) if config.get("base_model_depth") else 0  # the IG base head
        return (tokens * c * p * p * (d + dh) + (d * dh * (tokens + r) if d != dh else 0)
                + times * (2 * FREQUENCY_EMBEDDING_SIZE * d + d * d) + text + z * (d + 2 * dh)
                + int(config["depth"]) * block_macs(tokens + r + extra, d, mlp_macs_per_token=3 * d * swiglu_width(d),
                                                    modulation=0)
                + int(config["head_depth"]) * block_macs(tokens + r, dh, mlp_macs_per_token=3 * dh * swiglu_width(dh),
                                                         modulation=6, per_token_condition=True)
                + (tokens + r) * 2 * dh * dh + tokens * dh * p * p * c * (2 if config["learn_sigma"] else 1) + base)

    @classmethod
    def block_widths(cls, config: Mapping[str, Any]) -> list[int]:
        return [int(config["hidden_size"])] * int(config["depth"]) + \
            [int(config["head_hidden_size"])] * int(config["head_depth"])

    @classmethod
    def describe(cls, config: Mapping[str, Any]) -> str:
        kind = kind_of(config)
        cond = (f"{config['num_c_tokens']} class tokens" if kind == "class" else
                f"up to {config['num_c_tokens']} text tokens of width {config.get('text_dim')}" if kind == "text"
                else "unconditional")
        return (f"depth {config['depth']}, hidden {config['hidden_size']}, heads {config['num_heads']}, head "
                f"{config['head_depth']} x {config['head_hidden_size']} ({config['head_num_heads']} heads), patch "
                f"{config['patch_size']}, in context: {config['num_t_tokens']} time tokens, {cond}"
                + (f", REG class token of width {config['reg_dim']}" if config.get("reg_dim") else "")
                + (f", internal-guidance base head after block {config['base_model_depth']}"
                   if config.get("base_model_depth") else ""))

    @classmethod
    def fixed_tensors(cls, config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        grid = config["input_size"] // config["patch_size"]
        extra = (2 if conditions_of(config) == "meanflow" else 1) * config["num_t_tokens"] + config["num_c_tokens"]
        out: dict[str, torch.Tensor] = {}
        r = 1 if config.get("reg_dim") else 0
        for name, width, n, rows in (("enc", "hidden_size", "num_heads", extra),
                                     ("dec", "head_hidden_size", "head_num_heads", 0)):
            rope = TokenRope(grid, config[width] // config[n], rows, prefix=r)
            out.update({f"{name}_rope.freqs_cos": cast(torch.Tensor, rope.freqs_cos),
                        f"{name}_rope.freqs_sin": cast(torch.Tensor, rope.freqs_sin)})
        return out

    @classmethod
    def infer_config(cls, state_dict: Mapping[str, torch.Tensor], stored: Mapping[str, Any] | None,
                     where: str, hints: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Everything shows in the shapes: the head widths in the RoPE tables, the text length in the encoder's."""
        shapes, stored = shapes_of(state_dict), dict(stored or {})
        require(shapes, ("s_embedder.proj.weight", "x_embedder.proj.weight", "t_embedder.learnable_tokens",
                         "enc_rope.freqs_cos", "dec_rope.freqs_cos", "final_layer.linear.weight"), cls.family, where)
        reg = shapes["cls_in_proj_enc.weight"][1] if "cls_in_proj_enc.weight" in shapes else 0  # REG's z_dim
        d, channels, patch, _ = shapes["s_embedder.proj.weight"]
        dh, _, x_patch, _ = shapes["x_embedder.proj.weight"]
        if x_patch != patch:
            raise WeightsError(f"{where}: encoder patch {patch} and head patch {x_patch} differ; this project builds "
                               "one patch size")
        r = 1 if reg else 0  # the class token's row in front of both RoPE tables
        tokens, enc_rows = shapes["dec_rope.freqs_cos"][0] - r, shapes["enc_rope.freqs_cos"][0] - r
        grid = int(round(tokens ** 0.5))
        n_t = shapes["t_embedder.learnable_tokens"][0]
        times = 2 if "t_abs_embedder.learnable_tokens" in shapes else 1
        config: dict[str, Any] = {"input_size": grid * patch, "in_channels": channels, "hidden_size": d,
                                  "head_hidden_size": dh, "patch_size": patch, "num_t_tokens": n_t}
        adaln = {int(k.split(".")[1]) for k in shapes if k.startswith("blocks.") and ".adaln_modulation." in k}
        config["depth"] = len({int(k.split(".")[1]) for k in shapes if k.startswith("blocks.")} - adaln)
        config["head_depth"] = len(adaln)
        config["num_heads"] = d // shapes["enc_rope.freqs_cos"][1]
        config["head_num_heads"] = dh // shapes["dec_rope.freqs_cos"][1]
        config["learn_sigma"] = shapes["final_layer.linear.weight"][0] == 2 * patch * patch * channels
        if "ctx_embedder.embedding_table.weight" in shapes:
            config["num_classes"] = shapes["ctx_embedder.embedding_table.weight"][0] - 1
            config["num_c_tokens"] = shapes["ctx_embedder.learnable_tokens"][0]
        else:
            config["num_classes"] = int(stored.get("num_classes", 1000))
            config["num_c_tokens"] = enc_rows - tokens - times * n_t
        config["class_dropout_prob"] = float(stored.get("class_dropout_prob", NULL_DROPOUT))
        check_stored(config, stored, [k for k in config if k != "class_dropout_prob"], where)
        kind = "class" if "ctx_embedder.embedding_table.weight" in shapes else \
            "text" if "ctx_embedder.proj.weight" in shapes else "none"
        extra = conditioning_of({"conditioning": kind, "num_classes": config["num_classes"],
                                 "text_dim": shapes.get("ctx_embedder.proj.weight", (0, 0))[1]}).model_config()
        check_stored(extra, stored, extra, where)
        if kind_of(stored) != kind and "conditioning" in stored:
            raise WeightsError(f"{where}: its model_config records conditioning {kind_of(stored)!r} but its tensors "
                               f"are those of {kind!r}")
        body = {k: config[k] for k in cls.config_keys if k not in ("family", "model")}
        heads = {"reg_dim": int(reg), "base_model_depth": _base_depth(shapes, stored, where)}
        check_stored(heads, stored, [k for k in heads if k in stored], where)
        return {"family": cls.family, "model": preset_of({"family": cls.family, **body}), **body, **extra,
                **{k: v for k, v in heads.items() if v}}


def _base_depth(shapes: Mapping[str, Any], stored: Mapping[str, Any], where: str) -> int:
    """Internal guidance's base-head depth: the file's record (its tensors do not show it); 0 without the head."""
    if "base_final_layer.linear.weight" not in shapes:
        return 0
    depth = stored.get("base_model_depth")
    if not isinstance(depth, int) or depth < 1:
        raise WeightsError(f"{where}: it holds internal guidance's base head (base_final_layer) but records no "
                           "base_model_depth, the encoder block it reads")
    return depth


def text_tokens_macs(config: Mapping[str, Any], text_tokens: int) -> int:
    """Forward MACs of a model_config with `text_tokens` condition tokens in place of its num_c_tokens (what a run
    that pads its text to L tokens costs; bench/)."""
    return InContextDiTDH.forward_macs({**config, "num_c_tokens": int(text_tokens)})
