"""The sharded modes' calls into torch.distributed: PyTorch's own engine for sharded data parallelism (FSDP2's
`fully_shard` on a DeviceMesh, with its mixed precision; DTensor's parts; torch.distributed.checkpoint writing and
reading one safetensors file per rank, no pickle: `tensor_shapes` reads the files' headers).

With common/distributed.py (the process group and the collectives) the only modules that call torch.distributed.
What is sharded how, and when, is train/parallel.py's; the process group comes from `distributed.init`.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Mapping, Sequence

import torch

from dit_pipeline.common.distributed import device

SHARDED_FROM = "2.9"  # the first torch whose DCP writes one safetensors file per rank (HuggingFaceStorageWriter)


def sharding_problem() -> str | None:
    """Why FSDP2 with sharded safetensors checkpoints cannot run with this torch (None when it can)."""
    import inspect

    try:
        from torch.distributed.checkpoint import HuggingFaceStorageWriter
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: F401
    except ImportError:
        HuggingFaceStorageWriter = None  # type: ignore[assignment,misc]
    if HuggingFaceStorageWriter is None or "save_distributed" not in inspect.signature(
            HuggingFaceStorageWriter.__init__).parameters:
        return (f"the sharded modes need torch {SHARDED_FROM} or later (FSDP2 and per-rank safetensors checkpoints), "
                f"torch {torch.__version__} is installed")
    return None


def device_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """A DeviceMesh of this process group's ranks on this process's device type (row-major: the last
    dimension varies fastest, so with (replicate, shard) the ranks of one shard group are adjacent)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device().type, tuple(shape), mesh_dim_names=tuple(names))


def fully_shard(module: torch.nn.Module, mesh: Any, *, reshard_after_forward: bool,
                param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None) -> None:
    """FSDP2's `fully_shard` of `module` on `mesh` (1-D: FSDP; 2-D (replicate, shard): HSDP), in place.
    Floating inputs are never cast (cast_forward_inputs=False): the caller's autocast decides their dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as _fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    _fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)


@contextlib.contextmanager
def resharded_after(roots: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Every FSDP module under `roots` resharded when the block ends, as after a training step's backward: a forward
    without gradient leaves the units that keep their parameters after a forward (the roots, ZeRO-2's blocks)
    gathered."""
    from torch.distributed.fsdp import FSDPModule

    try:
        yield
    finally:
        for root in roots:
            for m in root.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()


def register_forward_method(module: torch.nn.Module, name: str) -> None:
    """FSDP2's `register_fsdp_forward_method`: calling `module.<name>` runs the unit's pre- and post-forward (its
    parameters gathered, and the root's lazy initialisation) as `forward` does."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    register_fsdp_forward_method(module, name)


def is_sharded(t: Any) -> bool:
    """True for a DTensor (a sharded or replicated tensor of a DeviceMesh)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return isinstance(t, DTensor)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (the tensor itself otherwise), sharing its storage."""
    return t.to_local() if is_sharded(t) else t  # type: ignore[attr-defined]


def full_value(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a DTensor on every rank (a collective); a plain tensor as it is."""
    return t.full_tensor() if is_sharded(t) else t  # type: ignore[attr-defined]


def save_tensors(tensors: Mapping[str, torch.Tensor], folder: str | os.PathLike) -> None:
    """Collective: every rank writes its parts of `tensors` (DTensor shards; a plain tensor by one rank) into
    `folder` as one safetensors file per rank (DCP's HuggingFaceStorageWriter: no pickle anywhere)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    with _quiet_dcp():
        dcp.save(dict(tensors), storage_writer=HuggingFaceStorageWriter(str(folder), save_distributed=True))


def load_tensors(targets: dict[str, torch.Tensor], folder: str | os.PathLike, *, collective: bool) -> None:
    """Fill `targets` (DTensors: this rank's shards of any sharding; plain tensors: whole) in place from a
    folder written by `save_tensors` at any world size. `collective`: every rank calls it together."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    with _quiet_dcp():
        dcp.load(targets, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=not collective)


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    """DCP's UserWarnings say what these calls mean to do ("assuming the intent is to load in a single process",
    "overwriting"): silenced around them only."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def tensor_shapes(folder: str | os.PathLike) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """{key: (whole shape, dtype)} of a `save_tensors` folder, from its files' safetensors headers (no tensor is
    read, no process group needed)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    meta = HuggingFaceStorageReader(str(folder)).read_metadata()
    return {k: (v.size, v.properties.dtype) for k, v in meta.state_dict_metadata.items()}  # type: ignore[union-attr]


def optimizer_state(module: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter names (DTensors for a sharded module), its state initialized
    first if it has none yet (one step at lr 0: torch's own `get_optimizer_state_dict`)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return dict(get_optimizer_state_dict(module, opt))


def load_optimizer_state(module: torch.nn.Module, opt: torch.optim.Optimizer, state: Mapping[str, Any], *,
                         full: bool) -> None:
    """Load an optimizer state keyed by parameter names; `full`: whole tensors on every rank (resharded here)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(module, opt, dict(state), options=StateDictOptions(full_state_dict=full))  # type: ignore[arg-type]


def load_module_state(module: torch.nn.Module, state: Mapping[str, torch.Tensor], *, full: bool) -> None:
    """Load a state_dict into a (sharded) module, strictly; `full`: whole tensors on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, dict(state), options=StateDictOptions(full_state_dict=full, strict=True))
