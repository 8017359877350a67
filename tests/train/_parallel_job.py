"""The 2-rank job of tests/train/test_parallel.py, run under torchrun (gloo, CPU): `python -m torch.distributed.run
--nproc-per-node 2 tests/train/_parallel_job.py SPEC.json`.

In one process group, so the ranks start once for every case:
1. every family (DiT, LightningDiT, DDT, DiT-DH, DiT-DH-IC, PixArt, JiT, iMF) sharded per block by train.parallel:
   each block of the family's `blocks` is its own FSDP2 unit holding DTensors split over both ranks, and (every
   family but iMF, whose time input is its own) the sharded forward and backward equal the unsharded model's on
   the same global batch;
2. the real trainer (train.run's `_train`: pre-flight, model, loop, checkpoints, the periodic hooks) for each run of the spec, in order,
   each a TrainConfig mapping (a run may start from a checkpoint copied into its folder: "copy_from");
3. after the run named in the spec's "gather", every rank all-gathers its model and EMA (DTensor.full_tensor, a
   path independent of the checkpoint) and rank 0 saves them, for the comparison with the consolidated file.
Rank 0 writes RESULT.json: the families' checks. Every process ends with os._exit (cli_kit: an exit-time abort
of torch's threads would otherwise fail a finished job).
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # `tests` importable as under pytest


def families() -> dict[str, tuple[dict, dict]]:
    """family -> (create_model kwargs, forward kwargs beyond x, t); forward None: structure only."""
    from tests.dit.test_families import TINY

    ic = {"input_size": 8, "in_channels": 4, "depth": 2, "hidden_size": 32, "num_heads": 2, "head_depth": 1,
          "head_hidden_size": 48, "head_num_heads": 4}
    small = {"input_size": 8, "in_channels": 4, "depth": 2, "hidden_size": 32, "num_heads": 2}
    return {"DiT": ({"name": "DiT-S/2", **small}, {}), **{f: (dict(TINY[f]), {}) for f in TINY},
            "DiT-DH-IC": ({"name": "ddt-en28d1152hd72-dn2d2048hd128", **ic}, {}),
            "PixArt": ({"name": "PixArt-XL/2", **small, "conditioning": "text", "text_dim": 16}, {"text": True}),
            "iMF": ({"name": "iMF-B/2", **small, "head_depth": 1}, {"skip": True})}


def check_families(world: int, rank: int) -> dict[str, dict]:
    from torch.distributed.fsdp import FSDPModule

    from dit_pipeline.common import sharding
    from dit_pipeline.dit.family import create_model
    from dit_pipeline.train.parallel import Parallel

    out = {}
    for family, (kw, how) in families().items():
        torch.manual_seed(0)
        model = create_model(**{**kw, "num_classes": 5})
        with torch.no_grad():  # every trained tensor away from its zero init, so every path carries a gradient
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(0.1 * torch.randn(p.shape))
        model.eval()  # no label dropout: its random draws would differ between the batch and its halves
        ref = copy.deepcopy(model)
        Parallel("fsdp", (world,)).wrap(model, model, None, torch.device("cpu"), None, 25)
        units = [isinstance(b, FSDPModule) and all(sharding.is_sharded(p) and p.to_local().shape[0] < p.shape[0]
                                                     for p in b.parameters() if p.ndim and p.shape[0] >= world)
                 for b in model.blocks]
        row = {"blocks": len(units), "sharded_blocks": sum(units), "root": isinstance(model, FSDPModule)}
        if not how.get("skip"):
            g = torch.Generator().manual_seed(1)
            n = 2 * world
            x = torch.randn(n, model.in_channels, model.input_size, model.input_size, generator=g)
            t = torch.rand(n, generator=g) * 0.9 + 0.05
            kwargs = ({"text": torch.randn(n, 3, 16, generator=g), "text_mask": torch.ones(n, 3, dtype=torch.bool)}
                      if how.get("text") else {"y": torch.randint(0, 5, (n,), generator=g)})
            mine = slice(2 * rank, 2 * rank + 2)
            model(x[mine], t[mine], **{k: v[mine] for k, v in kwargs.items()}).square().mean().backward()
            ref(x, t, **kwargs).square().mean().backward()
            grads = {name: p.grad for name, p in ref.named_parameters() if p.grad is not None}
            worst = 0.0
            for name, p in model.named_parameters():
                if p.grad is None:
                    continue
                full = sharding.full_value(p.grad)
                scale = grads[name].abs().max().item() or 1.0
                worst = max(worst, (full - grads[name]).abs().max().item() / scale)
            row.update(grads=len(grads), worst_relative_grad_difference=worst)
        out[family] = row
    out["DiT compiled"] = compiled_blocks(world, rank)
    out["bf16"] = mixed_precision(world)
    return out


def compiled_blocks(world: int, rank: int) -> dict:
    """Per-block compile (train.speed.regional_compile; aot_eager: no C++ compiler on the test machine) under FSDP2:
    the gradients of the unsharded eager model."""
    from dit_pipeline.common import sharding
    from dit_pipeline.dit.family import create_model
    from dit_pipeline.train.parallel import Parallel
    from dit_pipeline.train.speed import regional_compile

    torch.manual_seed(0)
    model = create_model(**{**families()["DiT"][0], "num_classes": 5}).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    ref = copy.deepcopy(model)
    units = regional_compile(model, backend="aot_eager")
    Parallel("zero2", (world,)).wrap(model, model, None, torch.device("cpu"), None, 25)
    g = torch.Generator().manual_seed(1)
    x, t, y = torch.randn(2 * world, 4, 8, 8, generator=g), torch.rand(2 * world, generator=g), torch.arange(2 * world) % 5
    mine = slice(2 * rank, 2 * rank + 2)
    model(x[mine], t[mine], y[mine]).square().mean().backward()
    ref(x, t, y).square().mean().backward()
    worst = max(((sharding.full_value(p.grad) - q.grad).abs().max() / (q.grad.abs().max() or 1)).item()
                for p, q in zip(model.parameters(), ref.parameters()) if q.grad is not None)
    graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])  # compiled, not fallen back to eager
    return {"compiled_units": units, "graphs": graphs, "worst_relative_grad_difference": worst}


def mixed_precision(world: int) -> dict:
    """With bf16: what dtype a block's and the root's weights have inside the forward, and the sharded gradients'."""
    from dit_pipeline.dit.family import create_model
    from dit_pipeline.train.parallel import Parallel

    torch.manual_seed(0)
    model = create_model(**{**families()["DiT"][0], "num_classes": 5})
    Parallel("fsdp", (world,)).wrap(model, model, None, torch.device("cpu"), torch.bfloat16, 25)
    seen: dict[str, str] = {}

    def dtype_of(name: str, weight: Callable[[Any], torch.Tensor]) -> Callable[..., None]:
        def hook(module: Any, args: Any) -> None:  # a forward pre-hook returning nothing: the inputs unchanged
            seen.setdefault(name, str(weight(module).dtype))
        return hook

    model.blocks[0].register_forward_pre_hook(dtype_of("block", lambda m: m.attn.qkv.weight))
    model.final_layer.register_forward_pre_hook(dtype_of("root", lambda m: m.linear.weight))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(2, 4, 8, 8), torch.rand(2), torch.arange(2))
    out.float().square().mean().backward()
    seen["grad"] = str(model.blocks[0].attn.qkv.weight.grad.dtype)
    seen["master"] = str(model.blocks[0].attn.qkv.weight.dtype)
    return seen


def train(cfg: dict) -> None:
    from dit_pipeline.train import merge_config
    from dit_pipeline.train.hooks import build_hooks
    from dit_pipeline.train.preflight import prepare
    from dit_pipeline.train.resume import check_resume
    from dit_pipeline.train.run import _train
    from dit_pipeline.train.signals import StopRequest

    config = merge_config({}, cfg)
    prep = prepare(config)
    with StopRequest() as stop:
        assert _train(prep, build_hooks(config), stop, check_resume(prep)) == "done"


def gather(trainer, out: Path) -> None:
    """Every rank: the whole model and EMA by all-gather; rank 0 saves them."""
    from dit_pipeline.common import distributed as dist
    from dit_pipeline.common import sharding

    state = {"model": {k: sharding.full_value(v).clone() for k, v in trainer.p.model.state_dict().items()},
             "ema": {k: sharding.full_value(v).clone() for k, v in trainer.p.ema.state_dict().items()}}
    if dist.is_main():
        torch.save(state, out)


def main() -> None:
    from dit_pipeline.common import distributed as dist
    from dit_pipeline.train import loop

    spec = json.loads(Path(sys.argv[1]).read_text())
    dist.init()
    world, rank = dist.world_size(), dist.rank()
    result = {"families": check_families(world, rank)}
    seen: list = []
    original = loop.Trainer.__init__

    def keep(self, *a, **k):  # the live trainer of each run, for the all-gather after it
        original(self, *a, **k)
        seen.append(self)

    loop.Trainer.__init__ = keep  # type: ignore[method-assign]
    for run in spec["runs"]:
        cfg = dict(run["config"])
        if run.get("copy_from") and rank == 0:
            target = Path(cfg["run_dir"]) / "checkpoints"
            target.mkdir(parents=True, exist_ok=True)
            src = Path(run["copy_from"])
            (shutil.copytree if src.is_dir() else shutil.copy)(src, target / src.name)
        dist.barrier()
        train(cfg)
        if run.get("gather"):
            gather(seen[-1], Path(run["gather"]))
        dist.barrier()
    if rank == 0:
        Path(spec["result"]).write_text(json.dumps(result, indent=1))
    dist.destroy(in_step=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
