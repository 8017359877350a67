"""Will the run fit? The per-GPU memory of a plan (train/memory.py's estimate from the model's real parameter
counts, built on the meta device), which --parallel mode and micro-batch fit a GPU's memory (`--gpu-memory`, else
the visible GPU's), `--micro-batch-size auto`, and the host memory the loaders' shuffle buffers need.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dit_pipeline.common import distributed as dist
from dit_pipeline.train import memory
from dit_pipeline.train.config import TrainConfig
from dit_pipeline.train.parallel import LEAST_TRAFFIC_FIRST, MODE, Parallel, parse_gib, shard_count
from dit_pipeline.train.speed import compile_enabled

if TYPE_CHECKING:
    from dit_pipeline.train.preflight import Preflight

GiB = float(2**30)


def resolve_auto_micro_batch(cfg: TrainConfig, kw: dict[str, Any], world: int,
                             parallel: Parallel | None = None) -> int | None:
    """`--micro-batch-size auto`: the largest micro-batch whose memory estimate fits the visible GPU (None,
    i.e. the whole per-rank batch, when no GPU is visible: host memory is not what limits a CPU run)."""
    if cfg.global_batch_size % world:
        return None  # batch_plan explains the problem
    if not torch.cuda.is_available():
        return None
    capacity = torch.cuda.get_device_properties(0).total_memory / GiB
    precision = resolve_precision(cfg.precision, torch.device("cuda", 0))
    total, trainable, mc = param_counts(kw)
    compiled = compile_enabled(cfg.compile, torch.device("cuda", 0))

    mode = parallel.mode.name if parallel is not None else "ddp"
    shards = shard_count(mode, parallel.shape) if parallel is not None else 1
    blocks = block_params(kw) if MODE[mode].sharded else []

    def fits(m: int) -> bool:
        return memory.estimate(mc, total, trainable, m, precision, grad_ckpt=cfg.grad_checkpointing,
                               compile=compiled, mode=mode, shards=shards,
                               block_params=blocks).total <= memory.FIT_FRACTION * capacity

    return memory.auto_micro_batch(cfg.global_batch_size // world, fits)


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def num_blocks(mc: dict[str, Any]) -> int:
    """The transformer blocks of a model_config's model (what --repa-depth and checkpointing count)."""
    from dit_pipeline.dit.family import model_from_config

    with torch.device("meta"):
        return model_from_config({**mc, "model": None}).num_blocks


def param_counts(kw: dict[str, Any]) -> tuple[int, int, dict[str, Any]]:
    """(all parameters, trainable parameters, model_config) of the model, built on the meta device."""
    total, trainable, mc, _ = param_shapes(kw)
    return total, trainable, mc


def param_shapes(kw: dict[str, Any]) -> tuple[int, int, dict[str, Any], list[tuple[int, ...]]]:
    """param_counts and the trainable tensors' shapes (what --optimizer muon splits), on the meta device."""
    from dit_pipeline.dit.family import create_model

    with torch.device("meta"):
        model = create_model(**kw)
    total = sum(p.numel() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    return total, sum(p.numel() for p in trainable), model.config, [tuple(p.shape) for p in trainable]


def block_params(kw: dict[str, Any]) -> list[int]:
    """The parameters of each of the model's blocks (the family's `blocks`: what FSDP2 shards and gathers one by
    one), on the meta device."""
    from dit_pipeline.dit.family import create_model

    with torch.device("meta"):
        model = create_model(**kw)
    return [sum(p.numel() for p in block.parameters()) for block in model.blocks]


def model_facts(prep: Preflight) -> memory.ModelFacts:
    total, trainable, mc, shapes = param_shapes(prep.model_kwargs)
    muon = sum(int(torch.Size(s).numel()) for s in shapes if len(s) == 2) if prep.cfg.optimizer == "muon" else 0
    return memory.ModelFacts(mc, total, trainable, block_params(prep.model_kwargs), muon)


def run_parallel(prep: Preflight) -> Parallel:
    return prep.parallel if prep.parallel is not None else Parallel("ddp")


def memory_estimate(prep: Preflight) -> memory.MemoryEstimate:
    """Rank 0's GPU memory for this plan, at the precision and compile setting a GPU run would use."""
    facts, par = model_facts(prep), run_parallel(prep)
    precision = resolve_precision(prep.cfg.precision, torch.device("cuda"))
    return memory.estimate(facts.model_config, facts.n_params, facts.n_trainable, prep.batch.micro_batch, precision,
                           grad_ckpt=prep.cfg.grad_checkpointing,
                           compile=compile_enabled(prep.cfg.compile, torch.device("cuda")),
                           muon_params=facts.muon_params, mode=par.mode.name, shards=shard_count(par.mode.name, par.shape),
                           block_params=facts.block_params)


def gpu_capacity(cfg: TrainConfig) -> tuple[float | None, str]:
    """(GiB per GPU to plan for, where it comes from): --gpu-memory, else the visible GPU's, else (None, "")."""
    if cfg.gpu_memory is not None:
        return parse_gib(cfg.gpu_memory), f"--gpu-memory {cfg.gpu_memory}"
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GiB, torch.cuda.get_device_name(0)
    return None, ""


def mode_shards(prep: Preflight) -> dict[str, int]:
    """Every --parallel mode at this world size -> the ranks it shards over (HSDP: its shard group; the run's own
    when it is hsdp, else the ranks of one node)."""
    par, world = run_parallel(prep), prep.world_size
    local = dist.local_world_size() if dist.launched() else world
    hsdp = par.shape[-1] if par.mode.hybrid else max(1, local if world % max(1, local) == 0 else 1)
    return {m.name: (hsdp if m.hybrid else world) if m.sharded else 1 for m in MODE.values()}


def memory_fit(prep: Preflight) -> tuple[list[str], str | None]:
    """(the plan's lines on which mode and micro-batch fit the GPU memory, why this run does not fit or None)."""
    capacity, source = gpu_capacity(prep.cfg)
    if capacity is None:
        return [], None
    cfg, par = prep.cfg, run_parallel(prep)
    facts, precision = model_facts(prep), resolve_precision(cfg.precision, torch.device("cuda"))
    compiled = compile_enabled(cfg.compile, torch.device("cuda"))
    per_rank, shards = prep.batch.per_rank, mode_shards(prep)
    best = {(m, ckpt): memory.largest_micro(facts, per_rank, precision, compiled, m, n, ckpt, capacity)
            for m, n in shards.items() for ckpt in (False, True)}
    said = "; ".join(f"{m} {'up to micro-batch ' + str(best[m, False]) if best[m, False] else 'no micro-batch'}"
                     + (f" ({best[m, True]} with --grad-checkpointing)" if best[m, True] != best[m, False]
                        and not cfg.grad_checkpointing else "") for m in shards)
    lines = [f"  fits        {capacity:.1f} GiB per GPU ({source}), per-rank batch {per_rank}: {said}"]
    mine = memory_estimate(prep)
    if mine.total <= capacity:
        return lines, None
    ok = [(m, best[m, cfg.grad_checkpointing]) for m in LEAST_TRAFFIC_FIRST if best[m, cfg.grad_checkpointing]]
    ok_ckpt = [(m, best[m, True]) for m in LEAST_TRAFFIC_FIRST if best[m, True]]
    if ok:
        fix = f"--parallel {ok[0][0]} fits at micro-batch {ok[0][1]} (--micro-batch-size {ok[0][1]})"
    elif ok_ckpt:
        fix = f"--parallel {ok_ckpt[0][0]} --grad-checkpointing fits at micro-batch {ok_ckpt[0][1]}"
    else:
        fix = "no mode fits at this world size: add ranks (the sharded modes divide the model state by them)"
    why = (f"the memory estimate of this run ({par.mode.name}, micro-batch {prep.batch.micro_batch}, grad "
           f"checkpointing {'on' if cfg.grad_checkpointing else 'off'}) is {mine.total:.1f} GiB per GPU, more than the "
           f"{capacity:.1f} GiB of {source}; {fix}. --dry-run prints the table (an analytic estimate: pass a larger "
           "--gpu-memory to run anyway)")
    return lines, why


def host_memory_available() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GiB
    except OSError:
        pass
    return None
