"""The data-parallel mode of a run (`--parallel`): the one place that wraps the model for its ranks and saves and
loads its state. The trainer asks a `Parallel` for what differs between the modes and never names one.

- `ddp` (the default): torch's DistributedDataParallel; every rank holds the whole model state (fp32 weights,
  gradients, AdamW's two moments: 16 bytes per parameter, and rank 0 the fp32 EMA: 4 more); gradients are
  all-reduced in buckets; checkpoints are one file written by rank 0 (train/checkpoint.py).
- `zero2`: FSDP2 (`torch.distributed.fsdp.fully_shard`) with `reshard_after_forward=False`: gradients, AdamW's
  moments, the fp32 master weights and the EMA are sharded over the ranks; each block's parameters are gathered
  once per micro-batch and kept through its backward (DDP-like traffic: one all-gather and one reduce-scatter
  per block). ZeRO stage 2 (Rajbhandari et al. 2020) as FSDP2 spells it (MosaicML's SHARD_GRAD_OP).
- `fsdp`: FSDP2 resharding after the forward: each block's parameters are gathered for its forward and again
  for its backward, so only about two blocks are ever whole on a rank (ZeRO-3).
- `hsdp`: FSDP inside shard groups of `--hsdp-shard-size` ranks (default: the ranks of one node) and replicas
  across groups, on a 2-D DeviceMesh (replicate, shard): gradients are reduce-scattered in a group and then
  all-reduced across groups.

How the model is sharded (torchtitan's `parallelize` recipe): `fully_shard` on every block the family lists
(`DiffusionTransformer.blocks`, the family seam; never class names), then on the trained root (the DiT, or
with --repa the DiT and its projector), whose own parameters (embeddings, final layer, projector) form the last
group, kept gathered from the forward to the backward. Activation checkpointing (`--grad-checkpointing`, inside
each block's call) and per-block compile (`train.speed.regional_compile`) are applied before, so both work in
every mode. Mixed precision as torchtitan does it: with bf16 the blocks' parameters are gathered and computed
in bf16 (MixedPrecisionPolicy param_dtype) and their gradients reduced in fp32 (reduce_dtype); the root's stay
fp32, and autocast stays on as under DDP, so the residual stream and the position table stay fp32 as the
trainer keeps them (train/speed.py). fp16 (a GradScaler on sharded gradients) is refused: use bf16.

The EMA is a copy of the model sharded the same way, updated shard by shard beside the parameters (never
gathered in a step). Clipping and the divergence guard use the total gradient norm over every shard (DTensor's
norm: each rank's partial sum of squares reduced), in fp32. Under the sharded modes every micro-batch's
gradients are reduce-scattered (accumulating whole gradients locally would hold the memory sharding saves).

A sharded run's checkpoints are written by all ranks at once with torch.distributed.checkpoint
(`CheckpointManager.save_sharded`) and resume at any world size and in any mode; a DDP file resumes under
FSDP and back. Refused with the reason (`ParallelSettings.parallel_problems`): Muon (it orthogonalises whole
matrices, a rank holds a slice) and fp16.

The periodic hooks (the validation loss, the sample grids, FID) run the sharded model or EMA as training does:
every rank enters `Parallel.evaluation` together and each block is gathered for its pass only. The network's
other entry points (`dit.family.NETWORK_METHODS`, a sampler's guided pass) are registered as FSDP2 forward
methods, so the root's parameters are gathered for them as for `forward`.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Mapping, Sequence

import torch

from dit_pipeline.common import distributed as dist
from dit_pipeline.common import sharding
from dit_pipeline.common.errors import UserError
from dit_pipeline.common.settings import choice, positive, setting
from dit_pipeline.dit.family import NETWORK_METHODS

if TYPE_CHECKING:
    from dit_pipeline.train.checkpoint import CheckpointManager
    from dit_pipeline.train.part_types import Part

SPEED = "Speed and memory"  # the --help section (train.config.SPEED)
MODES = ("ddp", "zero2", "fsdp", "hsdp")
# A trained module around the model (REPAModel) runs the model alone through its methods named with this prefix:
# dit_forward, dit_forward_with_cfg (train.parallel.ThroughRoot)
INNER_PREFIX = "dit_"


@dataclass(frozen=True)
class Mode:
    """What a `--parallel` value does (module docstring)."""

    name: str
    sharded: bool                  # FSDP2: parameters, gradients, optimizer state and EMA sharded
    reshard_after_forward: bool    # the blocks' parameters freed after the forward (gathered again for the backward)
    hybrid: bool                   # a 2-D mesh: shard groups, replicated across
    summary: str


MODE = {m.name: m for m in (
    Mode("ddp", False, False, False, "DDP: the whole model state on every rank, gradients all-reduced"),
    Mode("zero2", True, False, False, "ZeRO-2 (FSDP2, reshard_after_forward=False): gradients, optimizer state, "
         "fp32 weights and EMA sharded; each block's weights gathered once per micro-batch"),
    Mode("fsdp", True, True, False, "FSDP (FSDP2): weights, gradients, optimizer state and EMA sharded; each "
         "block's weights gathered for its forward and again for its backward"),
    Mode("hsdp", True, True, True, "HSDP: FSDP inside shard groups, replicated across them (2-D DeviceMesh)"))}
# The order a refusal suggests modes in, least communication first: nothing sharded, then weights kept gathered
# through the backward, then gathering only inside a shard group, then everywhere (ddp, zero2, hsdp, fsdp).
LEAST_TRAFFIC_FIRST = tuple(m.name for m in sorted(MODE.values(),
                                                   key=lambda m: (m.sharded, m.reshard_after_forward, not m.hybrid)))

_BYTES = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(GiB|GB|MiB|MB|TiB|TB|G|M|T)?\s*$", re.IGNORECASE)
_UNIT = {"gib": 1.0, "g": 1.0, "gb": 1e9 / 2**30, "mib": 2**-10, "m": 2**-10, "mb": 1e6 / 2**30,
         "tib": 2**10, "t": 2**10, "tb": 1e12 / 2**30}


def parse_gib(text: str) -> float:
    """'80GiB', '80G', '141GB', '80' (GiB) -> GiB; ValueError otherwise."""
    m = _BYTES.match(str(text))
    if m is None:
        raise ValueError(f"{text!r} is not a memory size such as 80GiB, 141GB or 24576MiB")
    return float(m.group(1)) * _UNIT[(m.group(2) or "GiB").lower()]


@dataclass(kw_only=True)
class ParallelSettings:
    """The data-parallel settings (TrainConfig inherits them)."""

    parallel: str = setting(
        "ddp", "Data parallelism: ddp (the whole model state on every GPU), zero2 (FSDP2 with gradients, optimizer "
        "state and EMA sharded, weights gathered once per micro-batch), fsdp (everything sharded, each block gathered "
        "for its forward and backward), hsdp (fsdp inside groups of --hsdp-shard-size ranks, replicated across); "
        "docs/big-models.md", group=SPEED, choices=MODES)
    hsdp_shard_size: int | None = setting(None, "--parallel hsdp: ranks per shard group (must divide the world size)",
                                          group=SPEED, shown="the ranks of one node")
    gpu_memory: str | None = setting(
        None, "GPU memory per rank to plan for (80GiB, 141GB): --dry-run says which --parallel mode and micro-batch "
        "fit it, and a run whose estimate exceeds it is refused before it starts", group=SPEED,
        shown="the visible GPU's; no check on a CPU")

    def parallel_problems(self) -> list[str]:
        """Problems of the parallel settings, alone and with the rest of the run's (refusals with the reason)."""
        p = choice(self, "parallel", MODES) + positive(self, "hsdp_shard_size")
        if self.gpu_memory is not None:
            try:
                if not parse_gib(self.gpu_memory) > 0:
                    p.append(f"--gpu-memory must be > 0, got {self.gpu_memory!r}")
            except ValueError as e:
                p.append(f"--gpu-memory: {e}")
        if self.hsdp_shard_size is not None and self.parallel != "hsdp":
            p.append("--hsdp-shard-size sets HSDP's shard groups: add --parallel hsdp (or drop it)")
        mode = MODE.get(self.parallel)
        if mode is None or not mode.sharded:
            return p
        problem = sharding.sharding_problem()
        if problem:
            p.append(f"--parallel {self.parallel}: {problem}; use --parallel ddp or upgrade torch")
        get = lambda name: getattr(self, name, None)  # noqa: E731 (fields of the TrainConfig inheriting this)
        if get("optimizer") == "muon":
            p.append(f"--parallel {self.parallel} with --optimizer muon: Muon orthogonalises each whole weight matrix "
                     "and a rank holds a slice of it; use --optimizer adamw, or --parallel ddp")
        if get("precision") == "fp16":
            p.append(f"--parallel {self.parallel} with --precision fp16: fp16's GradScaler is not used on sharded "
                     "gradients here; use --precision bf16 (or --parallel ddp)")
        return p


def mesh_shape(mode: str, world: int, shard_size: int | None, local: int) -> tuple[int, ...]:
    """The DeviceMesh of a mode: (world,) for zero2 / fsdp, (world / shard, shard) for hsdp (shard: --hsdp-shard-size,
    else the ranks of one node), () for ddp. UserError when the shape does not divide the world size."""
    if not MODE[mode].sharded:
        return ()
    if not MODE[mode].hybrid:
        return (world,)
    shard = shard_size or local
    if shard < 1 or world % shard:
        given = f"--hsdp-shard-size {shard}" if shard_size else f"HSDP's shard group of {shard} rank(s) per node"
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise UserError(f"--parallel hsdp: {given} does not divide the world size {world} into equal shard groups; "
                        f"pass --hsdp-shard-size one of {divisors}")
    return (world // shard, shard)


def shard_count(mode: str, shape: tuple[int, ...]) -> int:
    """Over how many ranks a mode divides the model state (1: DDP's full copy)."""
    return shape[-1] if MODE[mode].sharded and shape else 1


class Parallel:
    """A run's data parallelism: wraps its model, runs its micro-batches, norms its gradients, updates its EMA and
    writes its checkpoints as its mode does (module docstring)."""

    def __init__(self, mode: str, shape: tuple[int, ...] = ()):
        self.mode = MODE[mode]
        self.shape = shape
        self.mesh: Any = None
        self.ddp: Any = None            # torch's DistributedDataParallel wrapper (ddp with several ranks)
        self.roots: list[torch.nn.Module] = []  # the sharded modes' FSDP2 roots: the trained module, the EMA

    @classmethod
    def for_run(cls, cfg: Any, world: int) -> "Parallel":
        return cls(cfg.parallel, mesh_shape(cfg.parallel, world, cfg.hsdp_shard_size, dist.local_world_size()))

    @property
    def sharded(self) -> bool:
        return self.mode.sharded

    def describe(self) -> str:
        where = {(): "", (1,): " on 1 rank"}.get(self.shape, f" on a {' x '.join(map(str, self.shape))} mesh" +
                                               (" (replicas x shard group)" if self.mode.hybrid else ""))
        return f"{self.mode.name}{where}: {self.mode.summary}"

    def needs_group(self) -> bool:
        """Whether one process must form a process group of its own (a DeviceMesh needs one)."""
        return self.sharded

    def holds_ema(self) -> bool:
        """Whether this rank keeps an EMA (DDP: rank 0's whole copy; sharded: every rank its shard)."""
        return self.sharded or dist.is_main()

    # -- wrapping -----------------------------------------------------------------------------------------------
    def wrap(self, trained: torch.nn.Module, model: Any, ema: Any, device: torch.device,
             amp_dtype: torch.dtype | None, bucket_mb: int) -> Callable[..., Any]:
        """Wrap the run's modules (in place where FSDP2 shards them); returns what runs the forward. `model` is the
        DiT (its `blocks` are the family's), `trained` the module the optimizer updates (the DiT, or the DiT and
        its projector), `ema` the DiT's EMA copy on this rank (None where it holds none)."""
        if not self.sharded:
            if dist.world_size() <= 1:
                return trained
            from torch.nn.parallel import DistributedDataParallel

            self.ddp = DistributedDataParallel(trained, device_ids=[device.index] if device.type == "cuda" else None,
                                               gradient_as_bucket_view=True, bucket_cap_mb=bucket_mb)
            return self.ddp
        names = ("replicate", "shard") if self.mode.hybrid else ("shard",)
        self.mesh = sharding.device_mesh(self.shape, names)
        compute = amp_dtype if amp_dtype == torch.bfloat16 else None  # fp16 is refused (ParallelSettings)
        for block in model.blocks:
            sharding.fully_shard(block, self.mesh, reshard_after_forward=self.mode.reshard_after_forward,
                                 param_dtype=compute, reduce_dtype=torch.float32 if compute is not None else None)
        sharding.fully_shard(trained, self.mesh, reshard_after_forward=False)
        if ema is not None:  # the same sharding, so each EMA shard sits beside its parameters' shard
            for block in ema.blocks:
                sharding.fully_shard(block, self.mesh, reshard_after_forward=True)
            sharding.fully_shard(ema, self.mesh, reshard_after_forward=True)
        self.roots = [trained] + ([ema] if ema is not None else [])
        # A sampler's passes (NETWORK_METHODS) gather a root's parameters as forward does. A module around the model
        # (REPA's projector) runs the model's passes through its INNER_PREFIX methods, forward's included.
        around = trained is not model
        for name in NETWORK_METHODS:
            sharding.register_forward_method(trained, INNER_PREFIX + name if around else name)
            if ema is not None:
                sharding.register_forward_method(ema, name)
        if around:
            sharding.register_forward_method(trained, INNER_PREFIX + "forward")
        return trained

    def evaluation(self, module: torch.nn.Module) -> ContextManager[torch.nn.Module]:
        """A pass of `module` (the model or its EMA) outside the training step, a periodic hook's: yields what to
        call. Under DDP the module itself; under the sharded modes every rank enters it together (each pass is a
        collective), the model inside a wider trained unit is called through that unit's root (`dit_forward`), and
        every unit is resharded after."""
        if not self.sharded:
            return contextlib.nullcontext(module)
        return self._sharded_evaluation(module)

    @contextlib.contextmanager
    def _sharded_evaluation(self, module: torch.nn.Module) -> Iterator[torch.nn.Module]:
        with sharding.resharded_after(self.roots):
            yield module if any(module is r for r in self.roots) else ThroughRoot(self.roots[0], module)

    def micro_batch(self, i: int, accum: int) -> ContextManager[None]:
        """The context of micro-batch i of `accum`: DDP reduces only the last one's (no_sync before); the sharded
        modes reduce-scatter every micro-batch, so gradients never accumulate whole."""
        if self.ddp is not None and i < accum - 1:
            return self.ddp.no_sync()
        return contextlib.nullcontext()

    # -- a step -------------------------------------------------------------------------------------------------
    @staticmethod
    def grad_norm(params: Sequence[torch.Tensor], clip: float | None) -> torch.Tensor:
        """The total gradient norm over every rank's shards, in fp32 (clipped to `clip` when given): a plain
        tensor, the same on every rank."""
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(list(params), clip, foreach=True)
        else:
            norm = torch.nn.utils.get_total_norm([q.grad for q in params if q.grad is not None], foreach=True)
        return sharding.full_value(norm)

    @staticmethod
    def ema_pairs(ema: torch.nn.Module, model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(EMA tensors, the trained tensors they average): this rank's parts, in place (sharded: its shards)."""
        pairs = [(sharding.local_part(e), sharding.local_part(p)) for e, p in zip(ema.parameters(), model.parameters())
                 if p.requires_grad]
        return [e for e, _ in pairs], [p for _, p in pairs]

    def replica_groups(self, world: int) -> list[list[int]]:
        """Groups of ranks that must hold identical weights (what the checkpoint's fingerprint check compares):
        DDP all ranks; HSDP the ranks at one position of the shard groups; FSDP none."""
        if not self.sharded:
            return [list(range(world))]
        if not self.mode.hybrid:
            return []
        replicas, shard = self.shape
        return [[r * shard + s for r in range(replicas)] for s in range(shard)]

    # -- checkpoints --------------------------------------------------------------------------------------------
    def save(self, ckpts: "CheckpointManager", parts: Sequence["Part"]) -> Path | None:
        """Collective: write a checkpoint of `parts` (DDP: rank 0 writes one file; sharded: every rank its shards)."""
        if self.sharded:
            return ckpts.save_sharded(parts, {"parallel": self.mode.name, "mesh": list(self.shape),
                                              "world_size": dist.world_size()})
        return ckpts.save_parts(parts) if dist.is_main() else None

    def load_targets(self, composed: Callable[[], Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        """The live tensors a sharded checkpoint's tensors load into, by checkpoint path (`tensor_leaves` of the
        run's composed checkpoint, `composed()`): the sharded ones this rank holds; every other one is read whole."""
        if not self.sharded:
            return {}
        return {path: t for path, t in tensor_leaves(composed()) if sharding.is_sharded(t)}


class ThroughRoot(torch.nn.Module):
    """The model seen through the sharded root unit around it (REPA's projector unit): its forward and its network
    methods (NETWORK_METHODS) run as the root's INNER_PREFIX methods, FSDP2 forward methods; every other attribute
    (config, learn_sigma, conditioning(), ...) is the model's own, so a sampler takes it for the model."""

    def __init__(self, root: torch.nn.Module, model: torch.nn.Module):
        super().__init__()
        self.root = root
        object.__setattr__(self, "_model", model)  # not a submodule: its parameters are the root's
        self.train(root.training)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.root, INNER_PREFIX + "forward")(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in NETWORK_METHODS:
            return getattr(self._modules["root"], INNER_PREFIX + name)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_model"], name)


def tensor_leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) of every tensor in nested dicts, the path its keys joined by '/' (parameter names hold dots,
    never slashes): 'model/blocks.0.attn.qkv.weight', 'opt/state/blocks.0.attn.qkv.weight/exp_avg' (the keys of a
    sharded checkpoint's tensors, train/checkpoint.py)."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from tensor_leaves(v, f"{prefix}/{k}" if prefix else str(k))


# -- the parts' tensors, in any mode (train/model_parts.py calls these) -----------------------------------------

def _sharded_module(module: torch.nn.Module) -> bool:
    return any(sharding.is_sharded(p) for p in module.parameters())


def load_module(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a state_dict strictly: whole tensors into a DDP module as always; into a sharded module either its
    own shards (a sharded checkpoint) or whole tensors (a DDP file), which torch reshards."""
    if not _sharded_module(module):
        module.load_state_dict(state, strict=True)
        return
    sharding.load_module_state(module, state, full=not any(sharding.is_sharded(v) for v in state.values()))


def trainable_names(module: torch.nn.Module) -> list[str]:
    """The names of the trainable tensors in the optimizer's order (train.net builds it from this order)."""
    return [name for name, p in module.named_parameters() if p.requires_grad]


def optimizer_state(module: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state for a checkpoint: torch's own layout (tensors by index) under DDP, as every DDP file
    holds it; keyed by parameter name with sharded tensors under the sharded modes."""
    return sharding.optimizer_state(module, opt) if _sharded_module(module) else opt.state_dict()


def by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer state_dict keyed by index (torch's) -> keyed by parameter name (a DDP file under FSDP)."""
    return {"state": {names[int(i)]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]]}


def by_index(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name -> torch's index layout (a sharded checkpoint under DDP)."""
    index = {n: i for i, n in enumerate(names)}
    return {"state": {index[n]: v for n, v in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}


def load_optimizer(module: torch.nn.Module, opt: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Continue the optimizer from a checkpoint's state in either layout, in either mode."""
    names = trainable_names(module)
    keyed_by_name = any(isinstance(p, str) for g in saved.get("param_groups", []) for p in g.get("params", []))
    if not _sharded_module(module):
        opt.load_state_dict(by_index(saved, names) if keyed_by_name else saved)
        return
    state = saved if keyed_by_name else by_name(saved, names)
    full = not any(sharding.is_sharded(v) for st in state["state"].values() for v in st.values())
    sharding.load_optimizer_state(module, opt, state, full=full)
