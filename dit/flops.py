"""Analytic forward cost of a model, counted as multiply-accumulates (MACs) per image.

Counts every matrix product the forward pass runs, as the DiT paper's "Gflops" do (118.6 G for DiT-XL/2
at 256px): patch embedding, the timestep MLP, per block the adaLN projection, qkv, the two attention
matmuls (scores and weighted values), the output projection and the MLP, then the final layer.
Elementwise work (norms, activations, softmax, modulation, RoPE) is not counted. A training step costs about
3 x forward (backward = 2 x forward), so training FLOPs per image = 2 * 3 * MACs. Each family's
`forward_macs(config)` (dit/family.py) adds up its own pieces with `block_macs`; `forward_macs` here takes any
family's model_config.
"""
from __future__ import annotations

from typing import Any, Mapping

from .embed import FREQUENCY_EMBEDDING_SIZE

MLP_RATIO = 4


def block_macs(tokens: int, d: int, *, mlp_macs_per_token: int, modulation: int = 6,
               per_token_condition: bool = False) -> int:
    """One adaLN transformer block: the modulation Linear (once per image, or per token when the condition is
    per token), qkv, q k^T and attn v over all heads, the output projection and the MLP."""
    return (modulation * d * d * (tokens if per_token_condition else 1)
            + tokens * d * 3 * d + 2 * tokens * tokens * d + tokens * d * d + tokens * mlp_macs_per_token)


def dit_forward_macs(config: Mapping[str, Any], *, mlp_macs_per_token: int | None = None,
                     modulation: int = 6) -> int:
    """DiT's (and LightningDiT's) forward: patch conv + timestep MLP, depth blocks, final layer. The MLP costs
    2 x D x 4D per token unless `mlp_macs_per_token` says otherwise."""
    d = int(config["hidden_size"])
    p = int(config["patch_size"])
    c = int(config["in_channels"])
    c_out = 2 * c if config["learn_sigma"] else c
    tokens = (int(config["input_size"]) // p) ** 2
    embed = tokens * d * c * p * p + FREQUENCY_EMBEDDING_SIZE * d + d * d  # patch conv + timestep MLP
    mlp = 2 * d * MLP_RATIO * d if mlp_macs_per_token is None else mlp_macs_per_token
    block = block_macs(tokens, d, mlp_macs_per_token=mlp, modulation=modulation)
    final = 2 * d * d + tokens * d * p * p * c_out
    return embed + int(config["depth"]) * block + final


def forward_macs(config: Mapping[str, Any]) -> int:
    """Multiply-accumulates of one forward pass for one image of a `model_config` of any family."""
    from .family import forward_macs as family_macs

    return family_macs(config)


def train_flops_per_image(config: Mapping[str, Any]) -> int:
    """FLOPs of forward + backward for one image: 2 FLOPs per MAC, backward = 2 x forward."""
    return 2 * 3 * forward_macs(config)
