"""The DiT family (Peebles & Xie 2023, "Scalable Diffusion Models with Transformers").

Written from the facts in docs/REFERENCE.md: adaLN-Zero blocks, 2-D sin-cos position table,
sinusoidal timestep embedding, label embedding with a "null" row for classifier-free guidance. Parameter
names and shapes equal the official checkpoints', so `load_state_dict(strict=True)` takes
`DiT-XL-2-256x256.pt` as is. Pure nn: wrapping (DDP, autocast, compile) is applied from outside; activation
checkpointing is switched per block with `set_grad_checkpointing` without renaming any parameter.
Optional block features (QK-norm, RMSNorm, SwiGLU, 2-D RoPE; dit/blocks.py) are off by default. Built from the
shared blocks of dit/layers.py; LightningDiT (dit/lightningdit.py) is this skeleton with other blocks.
"""
from __future__ import annotations

import functools
from typing import Any, ClassVar, Mapping, cast, overload

import torch
from torch import nn

from .blocks import BLOCK_OPTIONS, RMSNorm32, SwiGLU, make_norm, swiglu_hidden
from .embed import FREQUENCY_EMBEDDING_SIZE, pos_embed_2d, timestep_embedding  # noqa: F401 (also dit.models')
from .family import DiffusionTransformer, lookup_preset, register_family
from .family import create_model as _create_model
from .family import model_from_config as _model_from_config
from .infer import Shapes, WeightsError, block_count, check_stored, classes, heads, require, shapes_of
from .layers import (AdaLNBlock, Attention, FinalLayer, LabelEmbedder, Mlp, PatchEmbed,  # noqa: F401 (re-exported)
                     TimestepEmbedder, modulate, run_block)
from .rope import AxialRope

_SIZES = {"S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16)}
# name -> (depth, hidden_size, num_heads, patch_size): the paper's twelve, then patch 1 for the latents of
# f16 / f32 encoders (LightningDiT's XL/1 on VA-VAE's 32x16x16: 256 tokens, as DiT-XL/2 on SD-VAE's 4x32x32)
MODEL_PRESETS: dict[str, tuple[int, int, int, int]] = {
    f"DiT-{size}/{patch}": (depth, hidden, heads, patch)
    for patches in ((2, 4, 8), (1,))
    for size, (depth, hidden, heads) in _SIZES.items()
    for patch in patches
}
_ARCH = ("depth", "hidden_size", "num_heads", "patch_size")

MLP_RATIO = 4
LN_EPS = 1e-6


def canonical_model_name(name: str) -> str:
    """'DiT-XL/2' for 'DiT-XL/2', 'DiT-XL-2' or 'dit-xl/2' (and SiT's 'SiT-XL/2': the same network), and the
    canonical preset of every other family's names; ValueError naming the presets otherwise."""
    return lookup_preset(name)[1]


def preset_name(depth: int, hidden_size: int, num_heads: int, patch_size: int) -> str | None:
    """The DiT preset with exactly these dimensions, or None for a custom architecture."""
    for name, dims in MODEL_PRESETS.items():
        if dims == (depth, hidden_size, num_heads, patch_size):
            return name
    return None


@register_family
class DiT(DiffusionTransformer):
    """Diffusion Transformer: (x [N, C, S, S], t [N], y [N]) -> [N, C or 2C, S, S]."""

    family = "DiT"
    default_objective = "ddpm"
    diffusers_class: ClassVar[str | None] = "DiTTransformer2DModel"  # sample/export.py converts to it
    presets = {name: dict(zip(_ARCH, dims)) for name, dims in MODEL_PRESETS.items()}
    overrides: ClassVar[tuple[str, ...]] = (*_ARCH, *BLOCK_OPTIONS)
    config_keys: ClassVar[tuple[str, ...]] = ("model", "input_size", "num_classes", "learn_sigma", "in_channels", "depth",
                                    "hidden_size", "num_heads", "patch_size", "class_dropout_prob")
    options_: ClassVar[tuple[str, ...]] = BLOCK_OPTIONS  # the block options its config records
    extra_options: ClassVar[tuple[str, ...]] = ()  # options of a family built on this skeleton (LightningDiT's wo_shift)

    def __init__(self, input_size: int = 32, patch_size: int = 2, in_channels: int = 4,
                 hidden_size: int = 1152, depth: int = 28, num_heads: int = 16,
                 class_dropout_prob: float = 0.1, num_classes: int = 1000, learn_sigma: bool = True,
                 qk_norm: bool = False, rms_norm: bool = False, swiglu: bool = False, rope: bool = False,
                 **extra: bool):
        super().__init__()
        unknown = sorted(set(extra) - set(self.extra_options))
        if unknown:
            raise TypeError(f"{self.family} has no option {', '.join(unknown)}")
        self.options = {"qk_norm": bool(qk_norm), "rms_norm": bool(rms_norm), "swiglu": bool(swiglu),
                        "rope": bool(rope), **{k: bool(extra.get(k, False)) for k in self.extra_options}}
        check_dims(self.family, input_size, patch_size, in_channels, hidden_size, depth, num_heads,
                   class_dropout_prob, num_classes)
        if rope and (hidden_size // num_heads) % 4:
            raise ValueError(f"invalid {self.family} configuration: rope needs a head dimension divisible by 4, got "
                             f"{hidden_size // num_heads}")
        self.input_size, self.patch_size, self.in_channels = input_size, patch_size, in_channels
        self.hidden_size, self.depth, self.num_heads = hidden_size, depth, num_heads
        self.num_classes, self.class_dropout_prob = num_classes, float(class_dropout_prob)
        self.learn_sigma = bool(learn_sigma)
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.grid_size = input_size // patch_size

        self.x_embedder = PatchEmbed(patch_size, in_channels, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        # A parameter (so it is in the official state_dict) that is never trained.
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid_size ** 2, hidden_size),
                                      requires_grad=False)
        self.feat_rope = self.make_rope() if self.options["rope"] else None
        self.blocks = nn.ModuleList(self.make_block() for _ in range(depth))
        self.final_layer = FinalLayer(hidden_size, patch_size * patch_size * self.out_channels,
                                      self.make_norm(hidden_size))
        self.initialize_weights()

    # -- the block of this family (LightningDiT overrides these) -------------------------------------------------
    def make_norm(self, dim: int) -> nn.Module:
        """The non-affine token norm of adaLN: LayerNorm (DiT) or RMSNorm."""
        return make_norm(dim, self.options["rms_norm"])

    def make_block(self) -> nn.Module:
        d, o = self.hidden_size, self.options
        mlp = ((lambda dim: SwiGLU(dim, swiglu_hidden(dim, MLP_RATIO))) if o["swiglu"]
               else (lambda dim: Mlp(dim, dim * MLP_RATIO)))
        qk = (lambda dim: RMSNorm32(dim, eps=1e-6)) if o["qk_norm"] else None  # float32 (dit/blocks.py)
        return AdaLNBlock(d, self.num_heads, norm=self.make_norm, mlp=mlp, qk_norm=qk)

    def make_rope(self) -> nn.Module:
        return AxialRope(self.grid_size, self.hidden_size // self.num_heads)

    @property
    def config(self) -> dict[str, Any]:
        """JSON-able architecture description (the checkpoint's `model_config`); a block option appears
        only when it is on, so a plain DiT's config is what it always was."""
        return {
            "model": preset_name(self.depth, self.hidden_size, self.num_heads, self.patch_size),
            "input_size": self.input_size, "num_classes": self.num_classes,
            "learn_sigma": self.learn_sigma, "in_channels": self.in_channels, "depth": self.depth,
            "hidden_size": self.hidden_size, "num_heads": self.num_heads,
            "patch_size": self.patch_size, "class_dropout_prob": self.class_dropout_prob,
            **{k: True for k, on in self.options.items() if on}, **self.condition_config(),
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "DiT":
        base = {k: config[k] for k in cls.config_keys if k not in ("model", "family", *cls.options_)}
        return cls(**base, **{k: bool(config.get(k, False)) for k in cls.options_})

    @torch.no_grad()
    def initialize_weights(self) -> None:
        """The published initialisation; adaLN and output layers are zero, so the output is zero."""
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:  # (every Linear here has a bias)
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        table = torch.from_numpy(pos_embed_2d(self.hidden_size, self.grid_size)).float()
        self.pos_embed.copy_(table.unsqueeze(0))
        proj = self.x_embedder.proj
        nn.init.xavier_uniform_(proj.weight.view(proj.weight.shape[0], -1))  # as a [D, C*p*p] matrix
        nn.init.zeros_(cast(torch.Tensor, proj.bias))
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(cast(nn.Linear, self.t_embedder.mlp[0]).weight, std=0.02)
        nn.init.normal_(cast(nn.Linear, self.t_embedder.mlp[2]).weight, std=0.02)
        zeroed = [cast(nn.Linear, b.adaLN_modulation[-1]) for b in self.dit_blocks]
        for layer in (*zeroed, cast(nn.Linear, self.final_layer.adaLN_modulation[-1]), self.final_layer.linear):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    @property
    def dit_blocks(self) -> list[AdaLNBlock]:
        """The blocks, typed (self.blocks is the nn.ModuleList that names them blocks.i in the state_dict)."""
        return cast("list[AdaLNBlock]", list(self.blocks))

    @overload
    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, force_drop_ids: torch.Tensor | None = None,
                generator: torch.Generator | None = None, return_hidden: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, force_drop_ids: torch.Tensor | None = None,
                generator: torch.Generator | None = None, *,
                return_hidden: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor,
                force_drop_ids: torch.Tensor | None = None,
                generator: torch.Generator | None = None,
                return_hidden: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [N, C, S, S] latents, t [N] timesteps (0..999, or flow times in [0, 1]), y [N] labels (num_classes =
        null).

        Class dropout: in train mode each label becomes null with probability class_dropout_prob,
        drawn from `generator` (or the global RNG). `force_drop_ids` [N] (1 = drop) overrides the draw
        in any mode, so a trainer can make dropout a function of its own seeds.
        `return_hidden=k` (1..depth) also returns the token hidden state after block k, [N, T, D], from the
        same pass: (out, hidden). REPA's `encoder_depth` is this k (REPA aligns it with a teacher).
        """
        self.check_inputs(x, t, y)
        self.check_return_hidden(return_hidden)
        h = self.x_embedder(x) + self.pos_embed  # [N, T, D]
        t_emb, y_emb = self.embed_conditions(t, y, force_drop_ids, generator)
        c = t_emb + y_emb  # [N, D]
        hidden = None
        for i, block in enumerate(self.blocks):
            h = run_block(block, h, c, self.feat_rope)
            if i + 1 == return_hidden:
                hidden = h  # [N, T, D]
        out = self.unpatchify(self.final_layer(h, c))  # [N, Cout, S, S]
        if return_hidden is None:
            return out
        assert hidden is not None  # return_hidden is a block index, checked above
        return out, hidden

    # -- files ----------------------------------------------------------------------------------------------------
    @staticmethod
    def forward_macs(config: Mapping[str, Any]) -> int:
        from .flops import dit_forward_macs

        return dit_forward_macs(config)

    @classmethod
    def fixed_tensors(cls, config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        grid = config["input_size"] // config["patch_size"]
        return {"pos_embed": torch.from_numpy(pos_embed_2d(config["hidden_size"], grid)).float().unsqueeze(0)}

    @classmethod
    def infer_config(cls, state_dict: Mapping[str, torch.Tensor], stored: Mapping[str, Any] | None,
                     where: str, hints: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The model_config matching the tensor shapes (see dit/infer.py for what decides the head count)."""
        return infer_single_stream(cls, shapes_of(state_dict), stored, where, hints)

    @staticmethod
    def options_from_shapes(shapes: Shapes, stored: Mapping[str, Any] | None, where: str) -> dict[str, bool]:
        """DiT's block options: those with parameters from the keys, rms_norm and rope only from a stored config."""
        found = {"qk_norm": "blocks.0.attn.q_norm.weight" in shapes, "swiglu": "blocks.0.mlp.w12.weight" in shapes}
        check_stored(found, {k: bool(v) for k, v in (stored or {}).items() if k in found}, found, where)
        return {**found, "rms_norm": bool((stored or {}).get("rms_norm")), "rope": bool((stored or {}).get("rope"))}

    @staticmethod
    def finish_config(config: dict[str, Any]) -> dict[str, Any]:
        """DiT's model_config order, with the preset name and the options present only when on."""
        out: dict[str, Any] = {"model": preset_name(config["depth"], config["hidden_size"], config["num_heads"],
                                                    config["patch_size"])}
        out.update({k: config[k] for k in DiT.config_keys if k != "model"})
        out.update({k: True for k in BLOCK_OPTIONS if config.get(k)})
        return out


def infer_single_stream(cls: type[DiT], shapes: Shapes, stored: Mapping[str, Any] | None, where: str,
                        hints: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The config of a DiT-skeleton family (DiT, LightningDiT) from its shapes; options shown by parameters are
    read from them, the others (parameter-free: LayerNorm vs non-affine RMSNorm, our RoPE) from `stored`."""
    require(shapes, ("pos_embed", "x_embedder.proj.weight", "y_embedder.embedding_table.weight",
                     "final_layer.linear.weight"), cls.family, where)
    hidden, channels, patch, _ = shapes["x_embedder.proj.weight"]
    tokens = shapes["pos_embed"][1]
    grid = int(round(tokens ** 0.5))
    if grid * grid != tokens:
        raise WeightsError(f"{where}: pos_embed has {tokens} tokens, not a square patch grid")
    out_features = shapes["final_layer.linear.weight"][0]
    if out_features not in (patch * patch * channels, 2 * patch * patch * channels):
        raise WeightsError(f"{where}: final_layer.linear has {out_features} outputs; expected "
                           f"{patch * patch * channels} or {2 * patch * patch * channels}")
    depth = block_count(shapes)
    config: dict[str, Any] = {
        "input_size": grid * patch, "in_channels": channels, "depth": depth, "hidden_size": hidden,
        "patch_size": patch, "learn_sigma": out_features == 2 * patch * patch * channels}
    check_stored(config, stored, list(config), where)
    config["num_classes"], config["class_dropout_prob"] = classes(
        shapes["y_embedder.embedding_table.weight"][0], stored, where)
    config.update(cls.options_from_shapes(shapes, stored, where))
    matches = [arch["num_heads"] for arch in cls.presets.values()
               if (arch["depth"], arch["hidden_size"]) == (depth, hidden)]
    config["num_heads"] = heads(hidden, shapes, ("blocks.0.attn.q_norm.weight", "feat_rope.freqs_cos"),
                                (stored or {}).get("num_heads"), matches[0] if matches else None, where,
                                f"depth {depth} x width {hidden} is no {cls.family} preset",
                                (hints or {}).get("num_heads"))
    return cls.finish_config(config)


def check_dims(family: str, input_size: int, patch_size: int, in_channels: int, hidden_size: int, depth: int,
               num_heads: int, class_dropout_prob: float, num_classes: int, **more: int) -> None:
    """ValueError listing every invalid dimension of a DiT-like model (`more`: further positive integers)."""
    problems = []
    for name, value in (("input_size", input_size), ("patch_size", patch_size),
                        ("in_channels", in_channels), ("hidden_size", hidden_size), ("depth", depth),
                        ("num_heads", num_heads), ("num_classes", num_classes), *more.items()):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"{name} must be a positive integer, got {value!r}")
    if not problems:
        if input_size % patch_size:
            problems.append(f"input_size {input_size} is not divisible by patch_size {patch_size}")
        if hidden_size % num_heads:
            problems.append(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
        if hidden_size % 4:
            problems.append(f"hidden_size {hidden_size} must be divisible by 4 (2-D sin-cos table)")
    if not 0.0 <= float(class_dropout_prob) < 1.0:
        problems.append(f"class_dropout_prob must be in [0, 1), got {class_dropout_prob!r}")
    if problems:
        raise ValueError(f"invalid {family} configuration: " + "; ".join(problems))


def create_model(name: str, input_size: int = 32, num_classes: int = 1000, **overrides: Any) -> DiffusionTransformer:
    """A preset ('DiT-XL/2' ...; 'DiT-XL-2' also accepted; every family's presets: dit.family.create_model)."""
    return _create_model(name, input_size, num_classes, **overrides)


def model_from_config(config: Mapping[str, Any]) -> DiffusionTransformer:
    """Build the model of a `model_config` dict (as in checkpoints; its "family", DiT when absent)."""
    return _model_from_config(config)


# The reference scripts' `DiT_models[name](input_size=..., num_classes=...)` spelling.
DiT_models = {name: functools.partial(create_model, name) for name in MODEL_PRESETS}
