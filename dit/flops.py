"""Analytic forward cost of a DiT, counted as multiply-accumulates (MACs) per image.

Counts every matrix product the forward pass runs, as the DiT paper's "Gflops" do (118.6 G for DiT-XL/2
at 256px): patch embedding, the timestep MLP, per block the adaLN projection, qkv, the two attention
matmuls (scores and weighted values), the output projection and the MLP, then the final layer.
Elementwise work (norms, activations, softmax, modulation) is not counted. A training step costs about
3 x forward (backward = 2 x forward), so training FLOPs per image = 2 * 3 * MACs.
"""
from __future__ import annotations

from typing import Any

from .models import FREQUENCY_EMBEDDING_SIZE, MLP_RATIO


def forward_macs(config: dict[str, Any]) -> int:
    """Multiply-accumulates of one forward pass for one image of a DiT `model_config` (see DiT.config)."""
    d = int(config["hidden_size"])
    p = int(config["patch_size"])
    c = int(config["in_channels"])
    c_out = 2 * c if config["learn_sigma"] else c
    tokens = (int(config["input_size"]) // p) ** 2
    embed = tokens * d * c * p * p + FREQUENCY_EMBEDDING_SIZE * d + d * d  # patch conv + timestep MLP
    block = (6 * d * d  # adaLN modulation (once per image, not per token)
             + tokens * d * 3 * d  # qkv
             + 2 * tokens * tokens * d  # q @ k^T and attn @ v over all heads
             + tokens * d * d  # attention output projection
             + 2 * tokens * d * MLP_RATIO * d)  # fc1 and fc2
    final = 2 * d * d + tokens * d * p * p * c_out
    return embed + int(config["depth"]) * block + final


def train_flops_per_image(config: dict[str, Any]) -> int:
    """FLOPs of forward + backward for one image: 2 FLOPs per MAC, backward = 2 x forward."""
    return 2 * 3 * forward_macs(config)
