"""improved MeanFlow's network (iMF, Geng et al. 2025, "Improved Mean Flows", arXiv:2512.02012; github
Lyy-iiis/imeanflow models/imfDiT.py, models/embedder.py, models/torch_models.py, and the same network in PyTorch on
its `torch` branch), built from the shared blocks (dit/layers.py, dit/blocks.py) in the release's parameter names.

Facts of the release (imfDiT.py `imfDiT`, line numbers of its main branch):
- in-context conditioning, no adaLN: the sequence is [class tokens (8), omega tokens (4), t_min tokens (2), t_max
  tokens (2), time tokens (4), patch tokens] (`_build_sequence`, 280-323); each group is a learned table plus its
  embedding broadcast over the group: y_embedder(y), omega_embedder(1 - 1 / omega), cfg_t_start_embedder(t_min),
  cfg_t_end_embedder(t_max), h_embedder(h). The network sees h = t - r, never t (342: "only on h");
- embedders: DiT's sinusoid (cos, sin; 256 features, max_period 10000, h in [0, 1] unscaled) -> Linear -> SiLU ->
  Linear; a label table of num_classes + 1 rows (the null class last); patches by a strided conv with bias;
- blocks (`TransformerBlock`, 68-105): x + attn(RMSNorm x) * attn_scale, then x + mlp(RMSNorm x) * mlp_scale, the
  scales per channel, zero at start; attention: q, k, v, out projections without bias, RMSNorm (eps 1e-6, learned
  scale) per head on q and k, then a 1-D RoPE over the whole sequence (positions 0 .. L-1, prefix tokens included,
  frequencies 10000^(-2j / head_dim), consecutive feature pairs, float32: `precompute_rope_freqs`, 370-385),
  softmax(q k^T / sqrt(head_dim)) v; MLP: SwiGLU w2(silu(w1 x) * w3 x) of width int(D x 8 / 3), no biases;
- two heads: the first depth - aux_head_depth blocks are shared, then `u_heads` and `v_heads` (aux_head_depth
  blocks each, the same input) end in `u_final_layer` / `v_final_layer` (RMSNorm, Linear with bias) on the patch
  tokens only: u is the average velocity, v the instantaneous one (the auxiliary head the loss trains, imf.py
  388-390). In evaluation the release builds no v heads (`eval=True`, 256-260; its PyTorch branch is evaluation
  only): `v_head` False here is that network (the v final layer kept, as the release keeps it);
- initialisation (torch_models.py `TorchLinear`, embedder.py): every Linear normal(c / sqrt(fan_in)), c = 0.32 in
  the blocks, 1.0 in the embedders; biases 0; token tables and the label table normal(1 / sqrt(D)); the patch conv
  xavier-uniform over (p, p, C) -> D, bias 0; norms 1; the residual scales and the final layers 0 (the network
  starts at u = v = 0).

Here `depth` is the release's (shared + one head; iMF-B/2: 4 + 8) and `head_depth` its aux_head_depth. The module
names are the release's, so its PyTorch files load after dropping their `net.` prefix and the `_flax_linear` /
`_flax_embedding` wrappers of its TorchLinear / TorchEmbedding (`from_release_torch`); its flax parameter tree maps
onto them by `from_flax_params`. `blocks` is the family interface's view of every block in forward order (shared,
u, v), not a second copy in the state_dict. The time input is the "imf" conditions' [N, 5] = (t, h, omega, t_min,
t_max) (dit/conditions.py); `forward(..., heads="u" | "v" | "uv")` returns u, v, or [u; v] along the channels.
"""
from __future__ import annotations

import math
import re
from typing import Any, Mapping, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .blocks import ROPE_THETA, apply_rope
from .family import DiffusionTransformer, preset_of, register_family
from .flops import FREQUENCY_EMBEDDING_SIZE, block_macs
from .infer import WeightsError, block_count, check_stored, classes, require, shapes_of
from .layers import LabelEmbedder, LlamaFFN, PatchEmbed, RMSNorm, TimestepEmbedder, run_block
from .models import check_dims

MLP_RATIO = 8 / 3                 # imfDiT.mlp_ratio; the width is int(D x 8 / 3) as the release computes it
BLOCK_INIT, EMBED_INIT, TOKEN_INIT = 0.32, 1.0, 1.0  # weight_init_constant, embedding_ / token_init_constant
RELEASE_INPUT_SIZE = 32           # configs/default.py dataset.image_size: the release trains 32x32 latents only
TOKENS = ("num_class_tokens", "num_cfg_tokens", "num_interval_tokens", "num_time_tokens")
HEADS = ("u", "v", "uv")
# The latents the release trains on (utils/vae_util.py LatentManager, 40-60 and 119-127): sd-vae-ft-mse posterior
# samples (its flax port pcuenq/sd-vae-ft-mse-flax) normalized per channel, x = (z - mean) / std; the record of
# common/latent_norm.py ("mean_std", multiplier 1), which dit-sample inverts when decoding a release file.
RELEASE_LATENT = {
    "scaling_factor": 1.0, "shift_factor": None,
    "normalization": {"form": "mean_std", "mean": [0.86488, -0.27787343, 0.21616915, 0.3738409],
                      "std": [4.85503674, 5.31922414, 3.93725398, 3.9870003], "multiplier": 1.0,
                      "source": {"kind": "file", "path": "Lyy-iiis/imeanflow utils/vae_util.py (LatentManager)"}},
    "vae": {"source": "stabilityai/sd-vae-ft-mse", "kind": "hub"}}
_ARCH = ("depth", "hidden_size", "num_heads", "patch_size", "head_depth")
# imfDiT.py 393-427: name -> (depth, hidden, heads, patch, aux_head_depth)
_PRESETS = {"B/2": (12, 768, 12, 2, 8), "M/2": (24, 768, 12, 2, 8), "L/2": (32, 1024, 16, 2, 8),
            "XL/2": (48, 1024, 16, 2, 8)}


def mlp_width(dim: int) -> int:
    return int(dim * MLP_RATIO)


def rope_tables(tokens: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [L, head_dim / 2] float32 of the release's 1-D RoPE (module docstring)."""
    freqs = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(tokens, dtype=torch.float32), freqs)
    return angles.cos().to(device), angles.sin().to(device)


def _scaled_normal(linear: nn.Linear, c: float) -> None:
    nn.init.normal_(linear.weight, std=c / math.sqrt(linear.in_features))
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


class IMFAttention(nn.Module):
    """Self-attention with separate q, k, v, out projections (no bias), per-head RMSNorm on q and k, 1-D RoPE."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj, self.k_proj = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.v_proj, self.out_proj = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.q_norm, self.k_norm = RMSNorm(self.head_dim), RMSNorm(self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, length, dim = x.shape
        shape = (n, length, self.num_heads, self.head_dim)
        q = self.q_norm(self.q_proj(x).reshape(shape)).transpose(1, 2)  # [N, H, L, hd]
        k = self.k_norm(self.k_proj(x).reshape(shape)).transpose(1, 2)
        v = self.v_proj(x).reshape(shape).transpose(1, 2)
        q = apply_rope(q.float(), cos, sin).to(v.dtype)  # rotated in float32, as the release
        k = apply_rope(k.float(), cos, sin).to(v.dtype)
        out = F.scaled_dot_product_attention(q, k, v)  # scale head_dim^-0.5
        return self.out_proj(out.transpose(1, 2).reshape(n, length, dim))


class IMFBlock(nn.Module):
    """x + attn(norm1 x) * attn_scale, then x + mlp(norm2 x) * mlp_scale (`TransformerBlock`)."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.attn = IMFAttention(dim, num_heads)
        self.mlp = LlamaFFN(dim, mlp_width(dim))
        self.attn_scale = nn.Parameter(torch.zeros(dim))
        self.mlp_scale = nn.Parameter(torch.zeros(dim))
        self.grad_checkpointing = False

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin) * self.attn_scale
        return x + self.mlp(self.norm2(x)) * self.mlp_scale


class IMFFinalLayer(nn.Module):
    def __init__(self, dim: int, out_features: int):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.linear = nn.Linear(dim, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(x))


@register_family
class IMF(DiffusionTransformer):
    """iMF's network: (x [N, C, S, S], t [N, 5] = (t, h, omega, t_min, t_max), y [N]) -> u (or v, or [u; v])."""

    family = "iMF"
    default_objective = "imf"
    diffusers_class = None
    conditions = "imf"  # its own time input; nothing is added by dit/conditions.py
    presets = {f"iMF-{k}": dict(zip(_ARCH, v)) for k, v in _PRESETS.items()}
    aliases = {**{f"imfDiT_{k.replace('/', '_')}": f"iMF-{k}" for k in _PRESETS},
               **{f"MiT_{k.replace('/', '_')}": f"iMF-{k}" for k in _PRESETS}}
    overrides = (*_ARCH, *TOKENS, "v_head")
    config_keys = ("family", "model", "input_size", "num_classes", "learn_sigma", "in_channels", "depth",
                   "hidden_size", "num_heads", "patch_size", "class_dropout_prob", "head_depth", *TOKENS, "v_head")

    def __init__(self, input_size: int = 32, patch_size: int = 2, in_channels: int = 4, hidden_size: int = 768,
                 depth: int = 12, num_heads: int = 12, class_dropout_prob: float = 0.1, num_classes: int = 1000,
                 learn_sigma: bool = False, head_depth: int = 8, num_class_tokens: int = 8, num_cfg_tokens: int = 4,
                 num_interval_tokens: int = 2, num_time_tokens: int = 4, v_head: bool = True):
        super().__init__()
        counts = dict(num_class_tokens=num_class_tokens, num_cfg_tokens=num_cfg_tokens,
                      num_interval_tokens=num_interval_tokens, num_time_tokens=num_time_tokens)
        check_dims(self.family, input_size, patch_size, in_channels, hidden_size, depth, num_heads,
                   class_dropout_prob, num_classes, head_depth=head_depth, **counts)
        if learn_sigma:
            raise ValueError("iMF's network predicts velocities (u and v), no variance: learn_sigma must be False")
        if head_depth > depth:
            raise ValueError(f"invalid iMF configuration: head_depth {head_depth} exceeds depth {depth} (depth counts "
                             "the shared blocks and one head)")
        if (hidden_size // num_heads) % 2:
            raise ValueError(f"invalid iMF configuration: RoPE needs an even head dimension, got "
                             f"{hidden_size // num_heads}")
        self.input_size, self.patch_size, self.in_channels = input_size, patch_size, in_channels
        self.hidden_size, self.depth, self.num_heads, self.head_depth = hidden_size, depth, num_heads, head_depth
        self.num_classes, self.class_dropout_prob = num_classes, float(class_dropout_prob)
        self.learn_sigma, self.v_head = False, bool(v_head)
        self.out_channels = in_channels
        self.grid_size = input_size // patch_size
        self.tokens = dict(counts)
        self.prefix = num_class_tokens + num_cfg_tokens + 2 * num_interval_tokens + num_time_tokens

        self.x_embedder = PatchEmbed(patch_size, in_channels, hidden_size)
        self.h_embedder = TimestepEmbedder(hidden_size)
        self.omega_embedder = TimestepEmbedder(hidden_size)
        self.cfg_t_start_embedder = TimestepEmbedder(hidden_size)
        self.cfg_t_end_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        self.time_tokens = nn.Parameter(torch.zeros(num_time_tokens, hidden_size))
        self.class_tokens = nn.Parameter(torch.zeros(num_class_tokens, hidden_size))
        self.omega_tokens = nn.Parameter(torch.zeros(num_cfg_tokens, hidden_size))
        self.t_min_tokens = nn.Parameter(torch.zeros(num_interval_tokens, hidden_size))
        self.t_max_tokens = nn.Parameter(torch.zeros(num_interval_tokens, hidden_size))
        self.shared_blocks = nn.ModuleList(IMFBlock(hidden_size, num_heads) for _ in range(depth - head_depth))
        self.u_heads = nn.ModuleList(IMFBlock(hidden_size, num_heads) for _ in range(head_depth))
        self.v_heads = nn.ModuleList(IMFBlock(hidden_size, num_heads) for _ in range(head_depth if v_head else 0))
        out = patch_size * patch_size * in_channels
        self.u_final_layer = IMFFinalLayer(hidden_size, out)
        self.v_final_layer = IMFFinalLayer(hidden_size, out)
        # the interface's view of every block in forward order; not registered, so no second state_dict entry
        object.__setattr__(self, "blocks", nn.ModuleList([*self.shared_blocks, *self.u_heads, *self.v_heads]))
        self._rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.initialize_weights()

    @torch.no_grad()
    def initialize_weights(self) -> None:
        """The release's initialisation (module docstring)."""
        if self.x_embedder.proj.weight.device.type == "meta":
            return
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                _scaled_normal(module, EMBED_INIT if "embedder" in name else BLOCK_INIT)
        for table in (self.time_tokens, self.class_tokens, self.omega_tokens, self.t_min_tokens, self.t_max_tokens):
            nn.init.normal_(table, std=TOKEN_INIT / math.sqrt(self.hidden_size))
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=EMBED_INIT / math.sqrt(self.hidden_size))
        proj = self.x_embedder.proj
        nn.init.xavier_uniform_(proj.weight.view(proj.weight.shape[0], -1))  # fan_in p*p*C, fan_out D
        nn.init.zeros_(cast(torch.Tensor, proj.bias))
        for layer in (self.u_final_layer.linear, self.v_final_layer.linear):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def set_conditions(self, kind: str) -> "IMF":
        if kind != "imf":
            raise ValueError(f"iMF's network takes the 'imf' time input (t, h, omega, t_min, t_max), not {kind!r}")
        return self

    # -- forward --------------------------------------------------------------------------------------------------
    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = str(device)
        if key not in self._rope:
            self._rope[key] = rope_tables(self.prefix + self.grid_size ** 2, self.head_dim, device)
        return self._rope[key]

    def build_sequence(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor,
                       force_drop_ids: torch.Tensor | None, generator: torch.Generator | None) -> torch.Tensor:
        """[N, prefix + T, D]: the condition tokens, then the patches (`_build_sequence`)."""
        h, omega, t_min, t_max = t[:, 1], t[:, 2], t[:, 3], t[:, 4]
        groups = ((self.class_tokens, self.y_embedder(y, force_drop_ids, generator)),
                  (self.omega_tokens, self.omega_embedder(1 - 1 / omega)),
                  (self.t_min_tokens, self.cfg_t_start_embedder(t_min)),
                  (self.t_max_tokens, self.cfg_t_end_embedder(t_max)),
                  (self.time_tokens, self.h_embedder(h)))
        prefix = [table[None] + emb[:, None] for table, emb in groups]  # each [N, k, D]
        return torch.cat([*prefix, self.x_embedder(x)], dim=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, force_drop_ids: torch.Tensor | None = None,
                generator: torch.Generator | None = None, return_hidden: int | None = None,
                heads: str = "u") -> Any:
        """u [N, C, S, S] (heads "u"), v ("v") or [u; v] [N, 2C, S, S] ("uv"); `return_hidden=k` also returns the
        tokens after block k of the u path (shared blocks, then the u head)."""
        if heads not in HEADS:
            raise ValueError(f"heads must be one of {HEADS}, got {heads!r}")
        if "v" in heads and not self.v_head:
            raise ValueError("this iMF network has no v heads (the release's evaluation network): it predicts u only")
        self.check_inputs(x, t, y)
        if return_hidden is not None and not 1 <= return_hidden <= self.depth:
            raise ValueError(f"return_hidden must be a block count in 1..{self.depth} (the u path), "
                             f"got {return_hidden!r}")
        cos, sin = self._tables(x.device)
        seq = self.build_sequence(x, t, y, force_drop_ids, generator)
        hidden = []
        for block in self.shared_blocks:
            seq = run_block(block, seq, cos, sin)
            hidden.append(seq)
        outs = []
        for name, stack, final in (("u", self.u_heads, self.u_final_layer), ("v", self.v_heads, self.v_final_layer)):
            if name not in heads:
                continue
            h = seq
            for block in stack:
                h = run_block(block, h, cos, sin)
                if name == "u":
                    hidden.append(h)
            outs.append(self.unpatchify(final(h[:, self.prefix:])))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if return_hidden is None:
            return out
        return out, hidden[return_hidden - 1][:, self.prefix:]

    # -- the family interface -------------------------------------------------------------------------------------
    @property
    def config(self) -> dict[str, Any]:
        body = {"input_size": self.input_size, "num_classes": self.num_classes, "learn_sigma": False,
                "in_channels": self.in_channels, "depth": self.depth, "hidden_size": self.hidden_size,
                "num_heads": self.num_heads, "patch_size": self.patch_size,
                "class_dropout_prob": self.class_dropout_prob, "head_depth": self.head_depth, **self.tokens,
                "v_head": self.v_head}
        return {"family": self.family, "model": preset_of({"family": self.family, **body}), **body,
                **self.condition_config()}

    def compile_units(self) -> list[nn.Module]:
        return [*self.blocks, self.u_final_layer, self.v_final_layer]

    @classmethod
    def block_widths(cls, config: Mapping[str, Any]) -> list[int]:
        count = int(config["depth"]) + (int(config["head_depth"]) if config.get("v_head", True) else 0)
        return [int(config["hidden_size"])] * count

    @classmethod
    def describe(cls, config: Mapping[str, Any]) -> str:
        d, h = int(config["depth"]), int(config["head_depth"])
        v = f" + {h} v-head" if config.get("v_head", True) else ", no v head"
        prefix = sum(int(config[k]) for k in TOKENS) + int(config["num_interval_tokens"])
        return (f"depth {d} ({d - h} shared + {h} u-head{v} blocks), hidden {config['hidden_size']}, heads "
                f"{config['num_heads']}, patch {config['patch_size']}, {prefix} condition tokens")

    @staticmethod
    def forward_macs(config: Mapping[str, Any]) -> int:
        """One forward of u (what sampling runs): embeddings, the shared blocks and the u head, the u output."""
        d, p, c = int(config["hidden_size"]), int(config["patch_size"]), int(config["in_channels"])
        patches = (int(config["input_size"]) // p) ** 2
        tokens = patches + sum(int(config[k]) for k in TOKENS) + int(config["num_interval_tokens"])
        block = block_macs(tokens, d, mlp_macs_per_token=3 * d * mlp_width(d), modulation=0)
        return (patches * d * c * p * p + 4 * (FREQUENCY_EMBEDDING_SIZE * d + d * d)
                + int(config["depth"]) * block + patches * d * p * p * c)

    @classmethod
    def infer_config(cls, state_dict: Mapping[str, torch.Tensor], stored: Mapping[str, Any] | None,
                     where: str, hints: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Everything shows in the shapes but the input size (no position table: the stored config, the caller's
        hint, else the release's 32 for its presets' dimensions)."""
        shapes, stored, hints = shapes_of(state_dict), dict(stored or {}), dict(hints or {})
        require(shapes, ("x_embedder.proj.weight", "y_embedder.embedding_table.weight", "u_final_layer.linear.weight",
                         "class_tokens", "omega_tokens", "t_min_tokens", "time_tokens"), "iMF", where)
        hidden, channels, patch, _ = shapes["x_embedder.proj.weight"]
        shared, u, v = (block_count(shapes, p) for p in ("shared_blocks", "u_heads", "v_heads"))
        if v not in (0, u):
            raise WeightsError(f"{where}: {u} u-head blocks but {v} v-head blocks; iMF's heads have equal depth")
        first = "shared_blocks.0" if shared else "u_heads.0"
        head_dim = shapes.get(f"{first}.attn.q_norm.weight", (hidden,))[0]
        config: dict[str, Any] = {
            "in_channels": channels, "depth": shared + u, "hidden_size": hidden, "patch_size": patch,
            "head_depth": u, "v_head": v > 0, "num_heads": hidden // head_dim, "learn_sigma": False,
            "num_class_tokens": shapes["class_tokens"][0], "num_cfg_tokens": shapes["omega_tokens"][0],
            "num_interval_tokens": shapes["t_min_tokens"][0], "num_time_tokens": shapes["time_tokens"][0]}
        check_stored(config, stored, list(config), where)
        config["num_classes"], config["class_dropout_prob"] = classes(
            shapes["y_embedder.embedding_table.weight"][0], stored, where)
        preset = any(all(config[k] == a[k] for k in _ARCH) for a in cls.presets.values())
        size = stored.get("input_size") or hints.get("input_size") or (RELEASE_INPUT_SIZE if preset else None)
        if size is None:
            raise WeightsError(f"{where}: an iMF network holds no position table, so its latent size is unknown; pass "
                               "--input-size (latent pixels, e.g. 32 for 256 px images with an 8x VAE)")
        config["input_size"] = int(size)
        body = {k: config[k] for k in cls.config_keys if k not in ("family", "model")}
        return {"family": cls.family, "model": preset_of({"family": cls.family, **body}), **body,
                "conditions": "imf"}


# ----------------------------------------------------------------------------------------------------------------
# The release's files

def is_release_torch(state_dict: Mapping[str, Any]) -> bool:
    """A state_dict of the release's PyTorch iMeanFlow (`net.`-prefixed, TorchLinear's `_flax_linear` inside)."""
    return any(k.startswith("net.") and "._flax_linear." in k for k in state_dict)


def from_release_torch(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The release's PyTorch state_dict (its `torch` branch's iMeanFlow, e.g. iMF-B-2.pth) in this family's names:
    `net.` dropped, and the TorchLinear / TorchEmbedding wrappers (`_flax_linear`, `_flax_embedding`)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        name = key.removeprefix("net.").replace("._flax_linear.", ".").replace("._flax_embedding.", ".")
        out[name] = value
    return out


# Older spellings of the release's own converter (the torch branch's convert.py RENAME_RULES, commit a2ac5c55)
_FLAX_RENAMES = {"k_embedder": "omega_embedder", "cfg_start_cond_tokens": "t_min_tokens",
                 "cfg_end_cond_tokens": "t_max_tokens", "time_cond_tokens": "time_tokens",
                 "class_cond_tokens": "class_tokens", "kappa_cond_tokens": "omega_tokens"}
_FLAX_ROOTS = ("params", "ema_params", "net")


def is_flax_params(keys: Any) -> bool:
    """Keys of a flattened flax tree of imfDiT (`flax.traverse_util.flatten_dict(tree, sep="/")`)."""
    return any(re.search(r"(^|/)(shared_blocks|u_heads)_\d+/", k) for k in keys)


def flax_root(keys: Any, prefer: str = "ema") -> str | None:
    """Which tree of a flattened TrainState to read: "ema_params" (prefer "ema") or "params" ("model") when the file
    has both, the one it has otherwise; None for a file of the parameters alone."""
    roots = {k.split("/", 1)[0] for k in keys} & {"params", "ema_params"}
    want = "ema_params" if prefer == "ema" else "params"
    return want if want in roots else next(iter(sorted(roots)), None)


def from_flax_params(flat: Mapping[str, Any], prefer: str = "ema") -> dict[str, torch.Tensor]:
    """The release's flax parameters -> this family's state_dict. `flat`: the tree flattened with "/" (a TrainState
    flattened whole holds `params/net/...` and `ema_params/net/...`: `flax_root` picks one; a bare `net/...` or the
    net's own tree also reads). Dense kernels [in, out] are transposed, the patch conv's [p, p, C, D] becomes
    [D, C, p, p]; RMSNorm's `kernel` and the tables are taken as they are (imfDiT.py, torch_models.py)."""
    root = flax_root(flat, prefer)
    if root is not None:
        flat = {k[len(root) + 1:]: v for k, v in flat.items() if k.startswith(root + "/")}
    out: dict[str, torch.Tensor] = {}
    for key, value in flat.items():
        parts = [p for p in key.split("/") if p not in ("net", "_flax_linear", "_flax_embedding")]
        names = []
        for part in parts[:-1]:
            part = _FLAX_RENAMES.get(part, part)
            if (m := re.fullmatch(r"layers_(\d+)", part)):
                names.append(m.group(1))  # nn.Sequential's children
            elif (m := re.fullmatch(r"(.+)_(\d+)", part)) and m.group(1) in ("shared_blocks", "u_heads", "v_heads"):
                names += [m.group(1), m.group(2)]
            else:
                names.append(part)
        leaf, array = _FLAX_RENAMES.get(parts[-1], parts[-1]), np.asarray(value)
        if leaf == "kernel":
            leaf = "weight"
            array = array.T if array.ndim == 2 else array.transpose(3, 2, 0, 1) if array.ndim == 4 else array
        elif leaf == "embedding":
            leaf = "weight"
        out[".".join([*names, leaf])] = torch.from_numpy(np.ascontiguousarray(array))
    return out
