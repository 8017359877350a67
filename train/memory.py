"""GPU memory per rank for `--dry-run` and `--micro-batch-size auto`: a table of measured values where one
exists, else an analytic estimate, always labelled with which of the two it is.

Measured rows (`MEASURED`) come from `bench/gpu.py`, which runs the real training step at two micro-batch
sizes and records peak allocated memory: per-sample activations = the slope, fixed = the intercept (weights,
gradients, AdamW moments, EMA, workspaces). A row is keyed by (model, latent size, precision, gradient
checkpointing, compile) and is only used for exactly that configuration.

The analytic model: fp32 parameters + gradients + AdamW moments (+ the fp32 EMA on rank 0) + activations +
a fixed allowance for the CUDA context, cuBLAS/cuDNN workspaces and allocator fragmentation. Activations per
sample and block are the tensors a DiT block keeps for the backward pass: about 50 x T x D bytes under
bf16/fp16 autocast (fp32 residual stream and LayerNorm inputs, 16-bit linear inputs, q/k/v and outputs of
flash attention, the 4D-wide MLP hidden states) and about 84 x T x D in fp32; with activation checkpointing
only each block's fp32 input (4 x T x D) is kept, plus one block's full set while it is recomputed. The
model ignores that compile frees some intermediates (it is an upper bound there).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

GiB = float(2**30)
OVERHEAD_GIB = 2.5        # CUDA context + library workspaces + fragmentation allowance (analytic model only)
FIT_FRACTION = 0.92       # `auto` leaves this share of the card to the estimate, the rest as headroom

# (model, latent size, precision, grad checkpointing, compile) -> measured GiB; written by bench/gpu.py
# ("memory-table" rows). Empty until a GPU run records them.
MEASURED: dict[tuple[str, int, str, bool, bool], dict[str, float]] = {}


@dataclass(frozen=True)
class MemoryEstimate:
    parts: dict[str, float]   # GiB per item
    total: float              # GiB on rank 0 (the rank that also holds the EMA)
    source: str               # "measured (...)" or "analytic estimate, unmeasured"


def activation_bytes(model_config: dict[str, Any], micro_batch: int, precision: str, grad_ckpt: bool) -> int:
    from dit_pipeline.dit.family import family_of_config

    tokens = (model_config["input_size"] // model_config["patch_size"]) ** 2
    widths = family_of_config(model_config).block_widths(model_config)  # every block's width (families differ)
    per_width = (50 if precision in ("bf16", "fp16") else 84) * tokens
    blocks = (4 * tokens * sum(widths) + per_width * max(widths)) if grad_ckpt else per_width * sum(widths)
    return micro_batch * (blocks + 16 * tokens * widths[-1])  # + embeddings, final layer and loss terms


def estimate(model_config: dict[str, Any], n_params: int, n_trainable: int, micro_batch: int, precision: str,
             *, grad_ckpt: bool, compile: bool, table: dict | None = None, muon_params: int = 0) -> MemoryEstimate:
    """Peak GPU memory of rank 0 for one micro-batch size (measured row if one matches, else analytic).
    `muon_params`: trainable parameters --optimizer muon updates (one fp32 momentum each, not AdamW's two)."""
    key = (str(model_config.get("model")), int(model_config["input_size"]), precision, bool(grad_ckpt),
           bool(compile))
    row = (MEASURED if table is None else table).get(key) if not muon_params else None  # rows measure AdamW
    if row is not None:
        parts = {"fixed": row["fixed_gib"], "activations": micro_batch * row["act_gib_per_sample"]}
        return MemoryEstimate(parts, sum(parts.values()), f"measured ({row.get('gpu', 'GPU')}, {row.get('date', '?')})")
    parts = {"params": 4 * n_params / GiB, "grads": 4 * n_trainable / GiB,
             "adamw": 8 * (n_trainable - muon_params) / GiB, **({"muon": 4 * muon_params / GiB} if muon_params else {}),
             "ema_rank0": 4 * n_params / GiB,
             "activations": activation_bytes(model_config, micro_batch, precision, grad_ckpt) / GiB,
             "overhead": OVERHEAD_GIB}
    return MemoryEstimate(parts, sum(parts.values()), "analytic estimate, unmeasured")


def auto_micro_batch(per_rank: int, fits: Callable[[int], bool]) -> int:
    """The largest divisor of the per-rank batch for which `fits(micro)` holds (1 if none does)."""
    for micro in sorted((d for d in range(1, per_rank + 1) if per_rank % d == 0), reverse=True):
        if fits(micro):
            return micro
    return 1


def table_row(model: str, input_size: int, precision: str, grad_ckpt: bool, compile: bool,
              peaks: dict[int, float], *, gpu: str, date: str) -> dict[str, Any]:
    """A MEASURED row from peak GiB at two (or more) micro-batch sizes: least-squares line through them."""
    xs, ys = list(peaks), [peaks[k] for k in peaks]
    if len(xs) < 2:
        raise ValueError("a memory-table row needs peaks at two micro-batch sizes at least")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return {"key": [model, input_size, precision, grad_ckpt, compile], "act_gib_per_sample": slope,
            "fixed_gib": my - slope * mx, "gpu": gpu, "date": date}
