"""The batch arithmetic of a run: global batch = world size x micro-batch x accumulation steps, exactly
(`batch_plan` -> `BatchPlan`, or a `ConfigError` that states the arithmetic and suggests valid values).
"""
from __future__ import annotations

from dataclasses import dataclass

from dit_pipeline.common.errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    world_size: int
    global_batch: int
    micro_batch: int
    accum: int

    @property
    def per_rank(self) -> int:
        return self.micro_batch * self.accum


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def batch_plan(global_batch: int, micro_batch: int | None, world_size: int) -> BatchPlan:
    """Split the global batch over ranks and accumulation steps, or explain why it cannot be split.

    The message states the arithmetic and suggests valid values (the classic DiT confusion between the
    global and the per-GPU batch).
    """
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if global_batch % world_size:
        lo = global_batch // world_size * world_size
        hi = lo + world_size
        near = " or ".join(str(v) for v in (lo, hi) if v > 0)
        raise ConfigError([f"--global-batch-size {global_batch} is not divisible by the world size "
                           f"{world_size} ({global_batch} / {world_size} = {global_batch / world_size:g}); "
                           f"use a multiple of {world_size}, e.g. {near}"], "batch configuration")
    per_rank = global_batch // world_size
    micro = per_rank if micro_batch is None else micro_batch
    if micro > per_rank or per_rank % micro:
        divs = _divisors(per_rank)
        shown = [str(d) for d in divs] if len(divs) <= 12 else [*map(str, divs[:6]), "...", *map(str, divs[-5:])]
        why = ("is larger than" if micro > per_rank else "does not divide")
        raise ConfigError([f"--micro-batch-size {micro} {why} the per-rank batch {per_rank} "
                           f"(= global batch {global_batch} / {world_size} ranks); valid micro-batch sizes: "
                           f"{', '.join(map(str, shown))} (accumulation steps = {per_rank} / micro-batch)"],
                          "batch configuration")
    return BatchPlan(world_size=world_size, global_batch=global_batch, micro_batch=micro,
                     accum=per_rank // micro)

