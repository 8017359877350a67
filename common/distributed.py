"""The wrapper around torch.distributed's process group: how this process was launched, `init` / `destroy`, and
the collectives.

Works unchanged as a single process: without a launcher `rank()` is 0, `world_size()` is 1, collectives
return their input and `barrier()` does nothing. Two launchers are recognised (`detect_launch`):
- torchrun (its RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR variables): these always win, so
  `srun ... torchrun ...` (one task per node) uses torchrun's ranks;
- srun with one task per GPU (SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID of a job step): the rendezvous
  is the first host of the step's node list (SLURM_LAUNCH_NODE_IPADDR on one node without a node list),
  on a port derived from the job and step ids; MASTER_ADDR / MASTER_PORT override both.
An environment that could make two processes both believe they are rank 0 (a multi-task Slurm allocation
that srun did not start, or an srun step with no reachable rank 0) is refused with one line before any
work. The process group uses NCCL when CUDA is available, gloo on CPU.

The sharded modes' calls (FSDP2, DeviceMesh, DTensor, DCP) are common/sharding.py's; no module other than these
two calls torch.distributed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import re
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


def _env_int(name: str, default: int, env: Mapping[str, str] | None = None) -> int:
    value = (os.environ if env is None else env).get(name)
    return int(value) if value not in (None, "") else default


@dataclasses.dataclass(frozen=True)
class Launch:
    """How this process was started: which launcher, its place in the job, and where rank 0 listens."""

    launcher: str = "none"  # "none" (one process), "torchrun" (or another launcher setting WORLD_SIZE), "srun"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None

    def describe(self) -> str:
        """One line for the start-up summary."""
        if self.launcher == "none":
            return "launcher: none (one process)"
        where = f", rendezvous {self.master_addr}:{self.master_port}" if self.launcher == "srun" else ""
        return f"launcher: {self.launcher}, {self.world_size} rank(s), {self.local_world_size} on this node{where}"


_HOW = ("launch one task per GPU with `srun dit-... ARGS` (e.g. sbatch --ntasks-per-node=GPUS), or one task per "
        "node running `torchrun --nproc-per-node GPUS $(which dit-...) ARGS`")


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: 'gpu[003-005,9],cpu1' -> 'gpu003', 'r[1-2]n[07-08]' -> 'r1n07'."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            end = i
            break
    first = nodelist[:end].strip()
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], first)


def tasks_on_node(tasks_per_node: str, node: int) -> int:
    """Tasks on node `node` from Slurm's compressed count list: '2(x3),1' means 2, 2, 2, 1."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ValueError(f"unreadable Slurm tasks-per-node list {tasks_per_node!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node] if 0 <= node < len(counts) else counts[-1]


def srun_port(job_id: int, step_id: int) -> int:
    """Rendezvous port for a Slurm step: same on every task of the step, different for concurrent steps of a
    job and (mostly) for jobs sharing a node; 15000-31999, below Linux's ephemeral port range."""
    return 15000 + (job_id * 8 + step_id % 8) % 17000


def detect_launch(env: Mapping[str, str] | None = None) -> Launch:
    """This process's launch from its environment (see the module docstring); UserError when ambiguous."""
    env = os.environ if env is None else env
    if "WORLD_SIZE" in env or "TORCHELASTIC_RUN_ID" in env:
        ws = _env_int("WORLD_SIZE", 1, env)
        if ws <= 1:
            return Launch()
        return Launch("torchrun", _env_int("RANK", 0, env), ws, _env_int("LOCAL_RANK", 0, env),
                      _env_int("LOCAL_WORLD_SIZE", 1, env), env.get("MASTER_ADDR"),
                      _env_int("MASTER_PORT", 0, env) or None)
    ntasks = _env_int("SLURM_STEP_NUM_TASKS", _env_int("SLURM_NTASKS", 1, env), env)
    if "SLURM_JOB_ID" not in env or ntasks <= 1:
        return Launch()
    if "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env:
        raise UserError(f"this process runs in a Slurm allocation of {ntasks} tasks (SLURM_NTASKS) but srun did not "
                        f"start it, so it cannot know its rank: {_HOW}; for one process, set SLURM_NTASKS=1")
    nodes = _env_int("SLURM_STEP_NUM_NODES", _env_int("SLURM_NNODES", 0, env), env)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    addr = env.get("MASTER_ADDR") or (first_host(nodelist) if nodelist else None)
    if addr is None and nodes == 1:
        addr = env.get("SLURM_LAUNCH_NODE_IPADDR")
    if addr is None or "SLURM_PROCID" not in env:
        raise UserError(f"srun started {ntasks} tasks but this one cannot tell how to reach rank 0 (no SLURM_PROCID, "
                        f"SLURM_STEP_NODELIST or MASTER_ADDR): {_HOW}")
    node = _env_int("SLURM_NODEID", 0, env)
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    local_ws = tasks_on_node(per_node, node) if per_node else (ntasks if nodes == 1 else 1)
    port = _env_int("MASTER_PORT", 0, env) or srun_port(_env_int("SLURM_JOB_ID", 0, env),
                                                        _env_int("SLURM_STEP_ID", _env_int("SLURM_STEPID", 0, env), env))
    return Launch("srun", _env_int("SLURM_PROCID", 0, env), ntasks, _env_int("SLURM_LOCALID", 0, env), local_ws,
                  addr, port)


_launch_cache: tuple[tuple, Launch] | None = None
_LAUNCH_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_ADDR",
                "MASTER_PORT", "SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_ID", "SLURM_PROCID")


def launch_info() -> Launch:
    """`detect_launch()` of the current environment (cached while the launch variables stay the same)."""
    global _launch_cache
    key = tuple(os.environ.get(k) for k in _LAUNCH_VARS)
    if _launch_cache is None or _launch_cache[0] != key:
        _launch_cache = (key, detect_launch())
    return _launch_cache[1]


def launched() -> bool:
    """True when started by a launcher (torchrun, srun) with more than one rank."""
    return launch_info().world_size > 1


def is_initialized() -> bool:
    return _dist.is_available() and _dist.is_initialized()


def init(backend: str | None = None, timeout_s: float | None = None, *, single: bool = False) -> None:
    """Join the process group of the detected launch (no-op for one process, unless `single`).

    The collective timeout bounds how long surviving ranks wait for a dead one
    (env DIT_DIST_TIMEOUT overrides, seconds). `single`: one process forms a group of its own (an in-memory
    store), which a DeviceMesh needs (a sharded run on one GPU: the FSDP code path with its overhead).
    """
    info = launch_info()
    if is_initialized() or (info.world_size <= 1 and not single):
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if timeout_s is None:
        timeout_s = float(os.environ.get("DIT_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
        kwargs["device_id"] = torch.device("cuda", local_rank())
    if info.world_size <= 1:
        kwargs.update(store=_dist.HashStore(), rank=0, world_size=1)
    elif info.launcher == "srun":
        host = f"[{info.master_addr}]" if ":" in str(info.master_addr) else info.master_addr
        kwargs.update(init_method=f"tcp://{host}:{info.master_port}", rank=info.rank, world_size=info.world_size)
    _dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    global _CPU_GROUP
    if backend == "nccl" and world_size() > 1:
        # Host-side control values (the trainer's pre-step stop/exhausted/error flags) reduce over gloo, so
        # agreeing on them never queues work on, or waits for, the GPU stream.
        _CPU_GROUP = _dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


_CPU_GROUP: Any = None  # a gloo group beside NCCL for CPU tensors (see init)


def destroy(*, in_step: bool = False) -> None:
    """Leave the process group (a no-op without one).

    in_step: every rank calls this at the same point of a normal finish, so first wait until all have
    arrived (a gloo barrier: the default group, or the gloo group beside NCCL) and only then tear the group
    down. With torch 2.6, a rank whose gloo group was destroyed after a peer had left hung in
    destroy_process_group in 3 of 6 two-rank runs (found by `make test-min-deps`; none in 34 runs with the
    barrier). Not on error paths, where a peer may never arrive.
    """
    global _CPU_GROUP
    if not is_initialized():
        _CPU_GROUP = None
        return
    if in_step and _dist.get_world_size() > 1 and (_CPU_GROUP is not None or _dist.get_backend() == "gloo"):
        try:
            _dist.monitored_barrier(group=_CPU_GROUP)  # bounded by the group's timeout; names a missing rank
        except RuntimeError:
            pass  # a peer is gone: leave anyway, as on an error path
    _CPU_GROUP = None
    _dist.destroy_process_group()


@contextlib.contextmanager
def leaving_group() -> Iterator[None]:
    """Run the body, then leave the process group: in step with the other ranks after a normal finish
    (destroy(in_step=True)), at once after an exception."""
    try:
        yield
    except BaseException:
        destroy()
        raise
    destroy(in_step=True)


def rank() -> int:
    return _dist.get_rank() if is_initialized() else launch_info().rank


def world_size() -> int:
    return _dist.get_world_size() if is_initialized() else launch_info().world_size


def local_rank() -> int:
    return launch_info().local_rank


def local_world_size() -> int:
    return launch_info().local_world_size


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
    """Sum a tensor over all ranks (returns a new tensor on t's device; a CPU tensor never touches a GPU)."""
    if not is_initialized():
        return t.clone()
    if t.device.type == "cpu" and _CPU_GROUP is not None:
        buf = t.detach().clone()
        _dist.all_reduce(buf, op=_dist.ReduceOp.SUM, group=_CPU_GROUP)
        return buf
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
