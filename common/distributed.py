"""The one wrapper around torch.distributed. No other module calls torch.distributed directly.

Works unchanged as a single process: without `torchrun` (no WORLD_SIZE in the environment) `rank()` is 0,
`world_size()` is 1, collectives return their input and `barrier()` does nothing. Under `torchrun` it joins
the process group (NCCL when CUDA is available, gloo on CPU) from the environment torchrun sets, so the same
code runs on one process, one node with 8 GPUs, or many nodes through torchrun's c10d rendezvous.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as _dist

from dit_pipeline.common.errors import UserError

DEFAULT_TIMEOUT_S = 600
# What gloo and NCCL say when a peer is gone: "Connection closed by peer", "Connection reset by peer",
# "Broken pipe", a timed-out wait.
_PEER_MARKERS = ("connection", "gloo", "nccl", "closed", "reset by peer", "timed out", "timeout", "broken pipe")


class PeerLost(UserError):
    """A collective failed because another rank died or hung (torchrun's summary names the first failure)."""


def is_peer_failure(e: BaseException) -> bool:
    """True for the error a collective raises when another rank died or hung (several ranks only)."""
    if world_size() < 2 or not isinstance(e, (RuntimeError, OSError)):
        return False
    return isinstance(e, getattr(_dist, "DistError", ())) or any(m in str(e).lower() for m in _PEER_MARKERS)


@contextlib.contextmanager
def peer_guard(what: str, logs: str = "the per-rank logs") -> Iterator[None]:
    """Around collectives: a failure because another rank died becomes one clear PeerLost line on the
    survivors instead of a backend traceback; anything else passes unchanged."""
    try:
        yield
    except (RuntimeError, OSError) as e:
        if not is_peer_failure(e):
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise PeerLost(f"rank {rank()}: {what} failed, most likely because another rank died or hung "
                       f"(torchrun's summary names the first failed rank; see {logs}): {first}") from None


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def launched() -> bool:
    """True when started by torchrun (or another launcher that sets WORLD_SIZE > 1)."""
    return _env_int("WORLD_SIZE", 1) > 1


def is_initialized() -> bool:
    return _dist.is_available() and _dist.is_initialized()


def init(backend: str | None = None, timeout_s: float | None = None) -> None:
    """Join the process group described by torchrun's environment (no-op for one process).

    The collective timeout bounds how long surviving ranks wait for a dead one
    (env DIT_DIST_TIMEOUT overrides, seconds).
    """
    if is_initialized() or not launched():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if timeout_s is None:
        timeout_s = float(os.environ.get("DIT_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = torch.device("cuda", local_rank())
    _dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


def destroy() -> None:
    if is_initialized():
        _dist.destroy_process_group()


def rank() -> int:
    return _dist.get_rank() if is_initialized() else _env_int("RANK", 0) if launched() else 0


def world_size() -> int:
    return _dist.get_world_size() if is_initialized() else _env_int("WORLD_SIZE", 1)


def local_rank() -> int:
    return _env_int("LOCAL_RANK", 0)


def local_world_size() -> int:
    return _env_int("LOCAL_WORLD_SIZE", 1)


def is_main() -> bool:
    return rank() == 0


def backend() -> str | None:
    return _dist.get_backend() if is_initialized() else None


def device() -> torch.device:
    """This process's compute device: its local GPU when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def barrier() -> None:
    if is_initialized():
        if backend() == "nccl":
            _dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            _dist.barrier()


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend() == "nccl" else torch.device("cpu")


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all ranks (returns a new tensor on t's device)."""
    if not is_initialized():
        return t.clone()
    buf = t.detach().to(_comm_device(), copy=True)
    _dist.all_reduce(buf, op=_dist.ReduceOp.SUM)
    return buf.to(t.device)


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    return all_reduce_sum(t) / world_size()


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    if not is_initialized():
        return t.clone()
    buf = t.detach().to(_comm_device(), copy=True)
    _dist.all_reduce(buf, op=_dist.ReduceOp.MAX)
    return buf.to(t.device)


class NamedSums:
    """What `all_reduce_named` returns: `sums[name]`, the total over ranks, and `ranks_with(name)`."""

    def __init__(self, sums: dict[str, float], per_rank: dict[str, list[float]]):
        self.sums, self.per_rank = sums, per_rank

    def __getitem__(self, name: str) -> float:
        return self.sums[name]

    def ranks_with(self, name: str) -> list[int]:
        """The ranks whose `per_rank` value `name` was non-zero, in rank order."""
        return [r for r, v in enumerate(self.per_rank[name]) if v != 0]


def all_reduce_named(values: Mapping[str, float | torch.Tensor], *,
                     per_rank: Mapping[str, float | torch.Tensor] | None = None,
                     device: torch.device | None = None) -> NamedSums:
    """Named scalars summed over all ranks in ONE float64 all-reduce (edm2's training_stats idea).

    `values` are summed; each `per_rank` value stays in its own rank's slot, so every rank learns every
    rank's value (e.g. which ranks saw a NaN). Every rank passes the same names; the order of the dicts does
    not matter. `device`: where the buffer is built (where 0-d tensor values live, to avoid a copy each).
    """
    names, own = sorted(values), sorted(per_rank or {})
    world, me = world_size(), rank()
    buf = torch.zeros(len(names) + len(own) * world, dtype=torch.float64, device=device)
    for i, name in enumerate(names):
        buf[i] = values[name]
    for j, name in enumerate(own):
        buf[len(names) + j * world + me] = per_rank[name]  # type: ignore[index]
    out = all_reduce_sum(buf).tolist()
    sums = dict(zip(names, out))
    ranks = {name: out[len(names) + j * world:len(names) + (j + 1) * world] for j, name in enumerate(own)}
    return NamedSums(sums, ranks)


def any_true(flag: bool) -> bool:
    """True on every rank if `flag` is true on any rank."""
    return bool(all_reduce_max(torch.tensor([1.0 if flag else 0.0])).item() > 0)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s object, on every rank (picklable objects between our own processes only)."""
    if not is_initialized():
        return obj
    box = [obj]
    _dist.broadcast_object_list(box, src=src, device=_comm_device())
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's object, in rank order, on every rank."""
    if not is_initialized():
        return [obj]
    out: list[Any] = [None] * world_size()
    _dist.all_gather_object(out, obj)
    return out


def broadcast_tensor_(t: torch.Tensor, src: int = 0) -> torch.Tensor:
    """In-place broadcast of a tensor from `src` (no-op for one process)."""
    if is_initialized():
        if t.device == _comm_device():
            _dist.broadcast(t, src=src)
        else:
            buf = t.to(_comm_device())
            _dist.broadcast(buf, src=src)
            t.copy_(buf)
    return t


def on_rank0(fn: Callable[[], Any], logs: str = "the per-rank logs") -> Any:
    """Run fn on rank 0 only; its result, or its UserError, reaches every rank (no rank left waiting).

    Used for work that must happen once (checking or creating an output folder, writing a manifest).
    """
    result, error = None, None
    if is_main():
        try:
            result = fn()
        except UserError as e:
            error = str(e)
    with peer_guard("waiting for rank 0", logs):
        result, error = broadcast_object((result, error))
    if error is not None:
        raise UserError(error if is_main() else f"(reported by rank 0) {error}")
    return result
