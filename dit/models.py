"""The DiT network (Peebles & Xie 2023, "Scalable Diffusion Models with Transformers").

Written from the facts in docs/REFERENCE.md: adaLN-Zero blocks, 2-D sin-cos position table,
sinusoidal timestep embedding, label embedding with a "null" row for classifier-free guidance. Parameter
names and shapes equal the official checkpoints', so `load_state_dict(strict=True)` takes
`DiT-XL-2-256x256.pt` as is. Pure nn: wrapping (DDP, autocast, compile) is applied from outside; activation
checkpointing is switched per block with `set_grad_checkpointing` without renaming any parameter.
Optional block features (QK-norm, RMSNorm, SwiGLU, 2-D RoPE; dit/blocks.py) are off by default.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Iterable, cast, overload

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .blocks import BLOCK_OPTIONS, RMSNorm32, SwiGLU, apply_rope, make_norm, rope_2d_tables, swiglu_hidden
from .embed import FREQUENCY_EMBEDDING_SIZE, pos_embed_2d, timestep_embedding  # noqa: F401 (also dit.models')

_SIZES = {"S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16)}
# name -> (depth, hidden_size, num_heads, patch_size): the paper's twelve, then patch 1 for the latents of
# f16 / f32 encoders (LightningDiT's XL/1 on VA-VAE's 32x16x16: 256 tokens, as DiT-XL/2 on SD-VAE's 4x32x32)
MODEL_PRESETS: dict[str, tuple[int, int, int, int]] = {
    f"DiT-{size}/{patch}": (depth, hidden, heads, patch)
    for patches in ((2, 4, 8), (1,))
    for size, (depth, hidden, heads) in _SIZES.items()
    for patch in patches
}

MLP_RATIO = 4
LN_EPS = 1e-6


def canonical_model_name(name: str) -> str:
    """'DiT-XL/2' for 'DiT-XL/2', 'DiT-XL-2' or 'dit-xl/2' (and SiT's 'SiT-XL/2': the same network);
    ValueError naming the presets otherwise."""
    key = name.strip().replace("\\", "/")
    if key.lower().startswith("sit-"):
        key = "DiT-" + key[4:]
    for preset in MODEL_PRESETS:
        if key.lower() in (preset.lower(), preset.replace("/", "-").lower()):
            return preset
    raise ValueError(f"unknown DiT model {name!r}; choose one of: {', '.join(MODEL_PRESETS)}")


def preset_name(depth: int, hidden_size: int, num_heads: int, patch_size: int) -> str | None:
    """The preset with exactly these dimensions, or None for a custom architecture."""
    for name, dims in MODEL_PRESETS.items():
        if dims == (depth, hidden_size, num_heads, patch_size):
            return name
    return None


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: x [N, T, D] * (1 + scale [N, D]) + shift [N, D]."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class PatchEmbed(nn.Module):
    """[N, C, H, W] -> [N, T, D] tokens (row-major over the patch grid); names match the official `proj`."""

    def __init__(self, patch_size: int, in_channels: int, hidden_size: int):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, hidden_size, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class TimestepEmbedder(nn.Module):
    """Sinusoidal features -> Linear -> SiLU -> Linear."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(FREQUENCY_EMBEDDING_SIZE, hidden_size), nn.SiLU(),
                                 nn.Linear(hidden_size, hidden_size))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        # Cast to the weights' dtype so a model converted with .to(bfloat16) runs without autocast.
        return self.mlp(timestep_embedding(t).to(cast(nn.Linear, self.mlp[0]).weight.dtype))


class LabelEmbedder(nn.Module):
    """Class table with a last "null" row (id = num_classes) when class dropout is enabled."""

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float):
        super().__init__()
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob
        self.embedding_table = nn.Embedding(num_classes + int(dropout_prob > 0), hidden_size)

    def forward(self, labels: torch.Tensor, force_drop_ids: torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
        if force_drop_ids is not None:
            if self.dropout_prob <= 0:
                raise ValueError("force_drop_ids needs the null class row: build the model with "
                                 "class_dropout_prob > 0")
            labels = torch.where(force_drop_ids.to(labels.device) == 1, self.num_classes, labels)
        elif self.training and self.dropout_prob > 0:
            u = torch.rand(labels.shape[0], generator=generator,
                           device=labels.device if generator is None else generator.device)
            labels = torch.where(u.to(labels.device) < self.dropout_prob, self.num_classes, labels)
        return self.embedding_table(labels)


class Attention(nn.Module):
    """Multi-head self-attention; qkv features laid out [3, heads, head_dim]; SDPA (flash on GPU).
    Options: RMSNorm on q and k per head (`qk_norm`), 2-D rotary embedding of q and k (`rope`)."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool = False, rope: bool = False):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"hidden size {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.qk_norm, self.rope = qk_norm, rope
        if qk_norm:
            self.q_norm = RMSNorm32(dim // num_heads, eps=1e-6)  # float32 whatever the autocast (dit/blocks.py)
            self.k_norm = RMSNorm32(dim // num_heads, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, tokens, dim = x.shape
        qkv = self.qkv(x).reshape(n, tokens, 3, self.num_heads, dim // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [N, heads, T, head_dim]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            cos, sin = rope_2d_tables(math.isqrt(tokens), dim // self.num_heads, q.device, q.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v)  # default scale head_dim^-0.5
        return self.proj(out.transpose(1, 2).reshape(n, tokens, dim))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DiTBlock(nn.Module):
    """adaLN-Zero transformer block. `grad_checkpointing` recomputes it in the backward pass."""

    def __init__(self, hidden_size: int, num_heads: int, qk_norm: bool = False, rms_norm: bool = False,
                 swiglu: bool = False, rope: bool = False):
        super().__init__()
        self.norm1 = make_norm(hidden_size, rms_norm)
        self.attn = Attention(hidden_size, num_heads, qk_norm=qk_norm, rope=rope)
        self.norm2 = make_norm(hidden_size, rms_norm)
        self.mlp = (SwiGLU(hidden_size, swiglu_hidden(hidden_size, MLP_RATIO)) if swiglu
                    else Mlp(hidden_size, hidden_size * MLP_RATIO))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))
        self.grad_checkpointing = False

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = \
            self.adaLN_modulation(c).chunk(6, dim=1)  # each [N, D]
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class FinalLayer(nn.Module):
    def __init__(self, hidden_size: int, patch_size: int, out_channels: int, rms_norm: bool = False):
        super().__init__()
        self.norm_final = make_norm(hidden_size, rms_norm)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    """Diffusion Transformer: (x [N, C, S, S], t [N], y [N]) -> [N, C or 2C, S, S]."""

    def __init__(self, input_size: int = 32, patch_size: int = 2, in_channels: int = 4,
                 hidden_size: int = 1152, depth: int = 28, num_heads: int = 16,
                 class_dropout_prob: float = 0.1, num_classes: int = 1000, learn_sigma: bool = True,
                 qk_norm: bool = False, rms_norm: bool = False, swiglu: bool = False, rope: bool = False):
        super().__init__()
        _check_dims(input_size, patch_size, in_channels, hidden_size, depth, num_heads,
                    class_dropout_prob, num_classes)
        if rope and (hidden_size // num_heads) % 4:
            raise ValueError(f"invalid DiT configuration: rope needs a head dimension divisible by 4, got "
                             f"{hidden_size // num_heads}")
        self.options = {"qk_norm": bool(qk_norm), "rms_norm": bool(rms_norm), "swiglu": bool(swiglu),
                        "rope": bool(rope)}
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
        self.blocks = nn.ModuleList(DiTBlock(hidden_size, num_heads, **self.options) for _ in range(depth))
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels, rms_norm=bool(rms_norm))
        self.initialize_weights()

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
            **{k: True for k, on in self.options.items() if on},
        }

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
    def dit_blocks(self) -> list[DiTBlock]:
        """The blocks, typed (self.blocks is the nn.ModuleList that names them blocks.i in the state_dict)."""
        return cast("list[DiTBlock]", list(self.blocks))

    def set_grad_checkpointing(self, enable: bool | int | Iterable[int] = True) -> None:
        """Recompute blocks in the backward pass: True = all, False/0 = none, an int n = the first n
        blocks, or an iterable of block indices. Parameter names do not change."""
        if isinstance(enable, bool):
            chosen = set(range(self.depth)) if enable else set()
        elif isinstance(enable, int):
            if not 0 <= enable <= self.depth:
                raise ValueError(f"grad checkpointing block count must be in 0..{self.depth}, got {enable}")
            chosen = set(range(enable))
        else:
            chosen = {int(i) for i in enable}
            if not chosen <= set(range(self.depth)):
                raise ValueError(f"block indices must be in 0..{self.depth - 1}, got {sorted(chosen)}")
        for i, block in enumerate(self.dit_blocks):
            block.grad_checkpointing = i in chosen

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        """[N, T, p*p*Cout] -> [N, Cout, g*p, g*p]; out[n, c, i*p+a, j*p+b] = x[n, i*g+j, (a*p+b)*Cout+c]."""
        n, p, g, c = x.shape[0], self.patch_size, self.grid_size, self.out_channels
        x = x.reshape(n, g, g, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(n, c, g * p, g * p)

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
        """x [N, C, S, S] latents, t [N] timesteps (0..999), y [N] labels (num_classes = null).

        Class dropout: in train mode each label becomes null with probability class_dropout_prob,
        drawn from `generator` (or the global RNG). `force_drop_ids` [N] (1 = drop) overrides the draw
        in any mode, so a trainer can make dropout a function of its own seeds.
        `return_hidden=k` (1..depth) also returns the token hidden state after block k, [N, T, D], from the
        same pass: (out, hidden). REPA's `encoder_depth` is this k (REPA aligns it with a teacher).
        """
        self._check_inputs(x, t, y)
        if return_hidden is not None and (isinstance(return_hidden, bool) or not isinstance(return_hidden, int)
                                          or not 1 <= return_hidden <= self.depth):
            raise ValueError(f"return_hidden must be a block count in 1..{self.depth}, got {return_hidden!r}")
        h = self.x_embedder(x) + self.pos_embed  # [N, T, D]
        c = self.t_embedder(t) + self.y_embedder(y, force_drop_ids, generator)  # [N, D]
        hidden = None
        for i, block in enumerate(self.blocks):
            if block.grad_checkpointing and torch.is_grad_enabled():
                h = checkpoint(block, h, c, use_reentrant=False)
            else:
                h = block(h, c)
            if i + 1 == return_hidden:
                hidden = h  # [N, T, D]
        out = self.unpatchify(self.final_layer(h, c))  # [N, Cout, S, S]
        if return_hidden is None:
            return out
        assert hidden is not None  # return_hidden is a block index, checked above
        return out, hidden

    def forward_with_cfg(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor,
                         cfg_scale: float | torch.Tensor,
                         guide_channels: int | str | None = 3) -> torch.Tensor:
        """Classifier-free guidance for a batch [cond half; uncond half (y = null)].

        The first half of x is run twice (with the cond and the null labels); guided eps =
        uncond + cfg_scale * (cond - uncond) is written into both halves. `guide_channels=3` guides the
        first 3 latent channels only, as the reference sampler does for its published FIDs; None or
        "all" guides every eps channel. Variance channels always pass through unguided.
        """
        if x.shape[0] % 2:
            raise ValueError(f"forward_with_cfg needs an even batch [cond; uncond], got {x.shape[0]}")
        if self.class_dropout_prob <= 0:
            raise ValueError("classifier-free guidance needs the null class: class_dropout_prob > 0")
        if guide_channels is None or guide_channels == "all":
            guide_channels = self.in_channels
        if not isinstance(guide_channels, int) or not 1 <= guide_channels <= self.in_channels:
            raise ValueError(f"guide_channels must be 1..{self.in_channels}, None or 'all', "
                             f"got {guide_channels!r}")
        half = x[: x.shape[0] // 2]
        out = self.forward(torch.cat([half, half], dim=0), t, y)
        eps, rest = out[:, :guide_channels], out[:, guide_channels:]
        cond, uncond = eps.chunk(2, dim=0)
        guided = uncond + cfg_scale * (cond - uncond)
        return torch.cat([torch.cat([guided, guided], dim=0), rest], dim=1)

    def _check_inputs(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> None:
        want = (self.in_channels, self.input_size, self.input_size)
        if x.dim() != 4 or tuple(x.shape[1:]) != want:
            raise ValueError(f"DiT expects x of shape [N, {want[0]}, {want[1]}, {want[2]}], "
                             f"got {list(x.shape)}")
        if t.shape != x.shape[:1] or y.shape != x.shape[:1]:
            raise ValueError(f"t and y must have shape [{x.shape[0]}], got {list(t.shape)} and "
                             f"{list(y.shape)}")


def _check_dims(input_size: int, patch_size: int, in_channels: int, hidden_size: int, depth: int,
                num_heads: int, class_dropout_prob: float, num_classes: int) -> None:
    problems = []
    for name, value in (("input_size", input_size), ("patch_size", patch_size),
                        ("in_channels", in_channels), ("hidden_size", hidden_size), ("depth", depth),
                        ("num_heads", num_heads), ("num_classes", num_classes)):
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
        raise ValueError("invalid DiT configuration: " + "; ".join(problems))


_CONFIG_KEYS = ("input_size", "num_classes", "learn_sigma", "in_channels", "depth", "hidden_size",
                "num_heads", "patch_size", "class_dropout_prob")


def create_model(name: str, input_size: int = 32, num_classes: int = 1000, **overrides: Any) -> DiT:
    """A preset DiT ('DiT-XL/2' ...; 'DiT-XL-2' also accepted) for `input_size` latents.

    `overrides` are DiT keyword arguments (learn_sigma, class_dropout_prob, in_channels, or architecture
    fields such as depth/hidden_size/num_heads for small custom models).
    """
    depth, hidden, heads, patch = MODEL_PRESETS[canonical_model_name(name)]
    unknown = set(overrides) - set(_CONFIG_KEYS) - set(BLOCK_OPTIONS)
    if unknown:
        raise ValueError(f"unknown DiT options {sorted(unknown)}; allowed: "
                         f"{', '.join(_CONFIG_KEYS + BLOCK_OPTIONS)}")
    kwargs: dict[str, Any] = dict(depth=depth, hidden_size=hidden, num_heads=heads, patch_size=patch,
                                  input_size=input_size, num_classes=num_classes)
    kwargs.update(overrides)
    return DiT(**kwargs)


# The reference scripts' `DiT_models[name](input_size=..., num_classes=...)` spelling.
DiT_models = {name: functools.partial(create_model, name) for name in MODEL_PRESETS}


def model_from_config(config: dict[str, Any]) -> DiT:
    """Build a DiT from a `model_config` dict (as in checkpoints; see DiT.config)."""
    missing = [k for k in _CONFIG_KEYS if k not in config]
    if missing:
        raise ValueError(f"model_config lacks {missing}; it needs {', '.join(_CONFIG_KEYS)}")
    name = config.get("model")
    dims = (config["depth"], config["hidden_size"], config["num_heads"], config["patch_size"])
    if name is not None and MODEL_PRESETS.get(canonical_model_name(name)) != dims:
        raise ValueError(f"model_config names {name!r} but has depth/hidden/heads/patch {dims}")
    return DiT(**{k: config[k] for k in _CONFIG_KEYS}, **{k: bool(config.get(k, False)) for k in BLOCK_OPTIONS})
