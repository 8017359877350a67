"""GPU memory per rank for `--dry-run` and `--micro-batch-size auto`: a table of measured values where one
exists, else an analytic estimate, always labelled with which of the two it is.

Measured rows (`MEASURED`) come from `bench/gpu.py`, which runs the real training step at two micro-batch
sizes and records peak allocated memory: per-sample activations = the slope, fixed = the intercept (weights,
gradients, AdamW moments, EMA, workspaces). A row is keyed by (model, latent size, precision, gradient
checkpointing, compile) and is only used for exactly that configuration.

The analytic model: fp32 parameters + gradients + AdamW moments (+ the fp32 EMA on rank 0) + activations +
a fixed allowance for the CUDA context, cuBLAS/cuDNN workspaces and allocator fragmentation; under a sharded
--parallel mode the model state divided over the shard group plus what FSDP2 gathers (`model_state`; the 1/N law
and the estimate against measured bytes: bench/fsdp_memory.py). Activations per
sample and block are the tensors a DiT block keeps for the backward pass: about 50 x T x D bytes under
bf16/fp16 autocast (fp32 residual stream and LayerNorm inputs, 16-bit linear inputs, q/k/v and outputs of
flash attention, the 4D-wide MLP hidden states) and about 84 x T x D in fp32; with activation checkpointing
only each block's fp32 input (4 x T x D) is kept, plus one block's full set while it is recomputed. The
model ignores that compile frees some intermediates (it is an upper bound there).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from dit_pipeline.train.parallel import MODE

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
             *, grad_ckpt: bool, compile: bool, table: dict | None = None, muon_params: int = 0,
             mode: str = "ddp", shards: int = 1, block_params: list[int] | None = None) -> MemoryEstimate:
    """Peak GPU memory of rank 0 for one micro-batch size (measured row if one matches, else analytic).
    `muon_params`: trainable parameters --optimizer muon updates (one fp32 momentum each, not AdamW's two).
    `mode`, `shards`, `block_params`: a sharded --parallel mode over `shards` ranks and the parameters of each of
    the family's blocks (`model_state`); measured rows are DDP's."""
    key = (str(model_config.get("model")), int(model_config["input_size"]), precision, bool(grad_ckpt),
           bool(compile))
    row = (MEASURED if table is None else table).get(key) if not muon_params and not MODE[mode].sharded else None
    if row is not None:
        parts = {"fixed": row["fixed_gib"], "activations": micro_batch * row["act_gib_per_sample"]}
        return MemoryEstimate(parts, sum(parts.values()), f"measured ({row.get('gpu', 'GPU')}, {row.get('date', '?')})")
    state = model_state(mode, n_params, n_trainable, shards, block_params or [], precision=precision,
                        muon_params=muon_params)
    parts = {**state, "activations": activation_bytes(model_config, micro_batch, precision, grad_ckpt) / GiB,
             "overhead": OVERHEAD_GIB}
    return MemoryEstimate(parts, sum(parts.values()), "analytic estimate, unmeasured")


def model_state(mode: str, n_params: int, n_trainable: int, shards: int, block_params: list[int], *,
                precision: str, muon_params: int = 0) -> dict[str, float]:
    """GiB of model state on one rank under a --parallel mode (train/parallel.py), `shards` the ranks it is divided
    over (the world size; HSDP's shard group):
    - ddp: fp32 parameters, gradients and AdamW's two moments whole on every rank (16 bytes per parameter) and the
      fp32 EMA on rank 0 (4 more); `ema_rank0` names it;
    - zero2 / fsdp / hsdp: all of that divided by `shards`, every rank its EMA shard, plus `gathered`: the
      parameters FSDP2 holds whole for the compute (the blocks' in the compute dtype, 2 bytes under bf16/fp16, the
      root's in fp32) and one block's whole gradients before their reduce-scatter. zero2 keeps every block gathered
      from its forward to its backward; fsdp and hsdp two blocks at a time (the one computing, the one prefetched).
    """
    if not MODE[mode].sharded:
        return {"params": 4 * n_params / GiB, "grads": 4 * n_trainable / GiB,
                "adamw": 8 * (n_trainable - muon_params) / GiB, **({"muon": 4 * muon_params / GiB} if muon_params else {}),
                "ema_rank0": 4 * n_params / GiB}
    compute = 2 if precision in ("bf16", "fp16") else 4
    blocks = sum(block_params)
    largest = max(block_params, default=0)
    kept = 2 * largest if MODE[mode].reshard_after_forward else blocks
    gathered = compute * kept + 4 * (n_params - blocks) + compute * largest
    return {"params": 4 * n_params / shards / GiB, "grads": 4 * n_trainable / shards / GiB,
            "adamw": 8 * n_trainable / shards / GiB, "ema": 4 * n_params / shards / GiB, "gathered": gathered / GiB}


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


@dataclass(frozen=True)
class ModelFacts:
    """What the estimates need of a model: its model_config, parameter counts, each block's parameters (the
    family's `blocks`: what FSDP2 gathers at once) and the parameters --optimizer muon would update."""

    model_config: dict[str, Any]
    n_params: int
    n_trainable: int
    block_params: list[int]
    muon_params: int = 0


@dataclass(frozen=True)
class Fit:
    """One row of the plan's memory table: a --parallel mode over `shards` ranks at a micro-batch, with and without
    activation checkpointing."""

    mode: str
    shards: int
    off: MemoryEstimate        # --grad-checkpointing off
    on: MemoryEstimate         # on

    def pick(self, grad_ckpt: bool) -> MemoryEstimate:
        return self.on if grad_ckpt else self.off


def fits(facts: ModelFacts, micro: int, precision: str, compile: bool, modes: dict[str, int]) -> list[Fit]:
    """The estimate of every mode in `modes` (mode -> the ranks it shards over) at micro-batch `micro`."""
    def one(mode: str, shards: int, ckpt: bool) -> MemoryEstimate:
        return estimate(facts.model_config, facts.n_params, facts.n_trainable, micro, precision, grad_ckpt=ckpt,
                        compile=compile, muon_params=0 if MODE[mode].sharded else facts.muon_params, mode=mode,
                        shards=shards, block_params=facts.block_params)
    return [Fit(m, n, one(m, n, False), one(m, n, True)) for m, n in modes.items()]


def largest_micro(facts: ModelFacts, per_rank: int, precision: str, compile: bool, mode: str, shards: int,
                  grad_ckpt: bool, capacity: float) -> int | None:
    """The largest micro-batch (a divisor of the per-rank batch) whose estimate fits `capacity` GiB; None if
    none does."""
    for micro in sorted((d for d in range(1, per_rank + 1) if per_rank % d == 0), reverse=True):
        if fits(facts, micro, precision, compile, {mode: shards})[0].pick(grad_ckpt).total <= capacity:
            return micro
    return None


def table_lines(rows: list[Fit], micro: int, world: int, chosen: str) -> list[str]:
    """The plan's table: GiB per GPU of every mode's model state and activations, without / with checkpointing."""
    out = [f"  per GPU     GiB at {world} rank(s), micro-batch {micro}: params + grads + optimizer + EMA + gathered | "
           "activations | total, activation checkpointing off / on"]
    for r in rows:
        p = r.off.parts
        state = [p.get("params", 0.0), p.get("grads", 0.0), p.get("adamw", 0.0) + p.get("muon", 0.0),
                 p.get("ema", p.get("ema_rank0", 0.0)), p.get("gathered", 0.0)]
        name = f"{r.mode} (shard groups of {r.shards})" if MODE[r.mode].hybrid else r.mode
        mark = "*" if r.mode == chosen else " "
        out.append(f"            {mark} {name:<26}" + " + ".join(f"{v:.2f}" for v in state)
                   + f" | {r.off.parts['activations']:.2f} / {r.on.parts['activations']:.2f}"
                   + f" | {r.off.total:.2f} / {r.on.total:.2f}")
    return out
