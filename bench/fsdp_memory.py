"""Benchmark: the model state each rank holds under --parallel ddp / zero2 / fsdp (/ hsdp) at 1, 2 and 4 ranks (CPU,
gloo), against the 1/N law and the dry run's estimate (train/memory.py `model_state`), and the step time of each mode
against DDP's, side by side in one run.

Each world size is one torchrun job (`--worker`) running every mode in turn on the real wrapper (train/parallel.py:
FSDP2 per family block, the sharded EMA, the norm over the shards) with AdamW, on a DiT of depth 4, width 256 (3.5M
parameters, 64 tokens), the same seeded batches. "Measured" is the bytes of the tensors a rank holds, read from the
live objects (storage sizes, each storage once): its parameters, gradients, AdamW moments and EMA after the optimizer
step (the state at rest), and `gathered`, the most FSDP2 holds whole at once beyond the shards: parameters and their
whole gradients, read at the end of the forward and at every block's backward hooks (ZeRO-2: every block; FSDP: a
block or two and the root). On a CPU there is no allocator peak to read; on a GPU bench/gpu_train.py reads
torch.cuda.max_memory_allocated. Step time: seconds per optimizer step (forward, backward, reduction, AdamW, EMA)
over `--steps` steps after one warm-up step, each rank's own, the slowest rank's reported. Over gloo on one loaded
CPU the collectives cost what memory copies cost; a GPU's interconnect (NVLink, InfiniBand) decides the real ratio.

    python bench/fsdp_memory.py --worlds 1,2,4 --steps 5
    python bench/fsdp_memory.py --smoke            # the script runs (1 and 2 ranks, 1 step)
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_checkout  # noqa: E402

use_checkout()

from dit_pipeline.common import distributed as dist  # noqa: E402
from dit_pipeline.common import sharding  # noqa: E402
from dit_pipeline.train import memory  # noqa: E402
from dit_pipeline.train.parallel import Parallel, mesh_shape  # noqa: E402
from dit_pipeline.train.speed import ema_update  # noqa: E402

MODEL = {"name": "DiT-S/2", "input_size": 16, "in_channels": 4, "depth": 4, "hidden_size": 256, "num_heads": 4,
         "num_classes": 10}
MiB = 2**20


def held(tensors) -> int:
    """Bytes of the storages behind `tensors` (this rank's parts), each storage once."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        st = sharding.local_part(t).untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def run_mode(mode: str, world: int, rank: int, steps: int) -> dict:
    from dit_pipeline.dit.family import create_model

    torch.manual_seed(0)
    model = create_model(**MODEL)
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    par = Parallel(mode, mesh_shape(mode, world, 2 if mode == "hsdp" else None, world))
    ema = copy.deepcopy(model).requires_grad_(False) if par.holds_ema() else None
    forward = par.wrap(model, model, ema, torch.device("cpu"), None, 25)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    gathered = [0]

    def probe(*_: object) -> None:  # the parameters FSDP2 holds whole now, and their whole gradients
        if par.sharded:
            whole = [p for p in model.parameters() if not sharding.is_sharded(p)]
            gathered.append(held(whole) + held(p.grad for p in whole))

    model.register_forward_hook(probe)
    for block in model.blocks:  # inside the backward: a block's gathered weights and its whole gradients
        block.register_full_backward_hook(probe)
        block.register_full_backward_pre_hook(probe)
    g = torch.Generator().manual_seed(1 + rank)
    times, at_rest = [], {}
    for step in range(steps + 1):
        x = torch.randn(4, 4, 16, 16, generator=g)
        t = torch.randint(0, 1000, (4,), generator=g)
        y = torch.randint(0, 10, (4,), generator=g)
        t0 = time.perf_counter()
        forward(x, t, y).square().mean().backward()
        par.grad_norm(params, 1.0)
        opt.step()
        if ema is not None:
            ema_update(*par.ema_pairs(ema, model), 0.999)
        if step:
            times.append(time.perf_counter() - t0)
        at_rest = {"params": held(model.parameters()), "grads": held(p.grad for p in params),
                   "optimizer": held(v for st in opt.state.values() for v in st.values()
                                     if isinstance(v, torch.Tensor) and v.ndim),
                   "ema": held(ema.parameters()) if ema is not None else 0}
        opt.zero_grad(set_to_none=True)
    shards = par.shape[-1] if par.sharded else 1
    est = memory.model_state(mode, n_params, n_trainable, shards, blocks, precision="fp32")
    return {"mode": mode, "world": world, "rank": rank, "shards": shards, "params": n_params,
            "measured": {**at_rest, "gathered": max(gathered)}, "estimate_gib": est,
            "step_s": sum(times) / len(times)}


def worker(out: str, steps: int) -> None:
    dist.init(single=True)
    world, rank = dist.world_size(), dist.rank()
    rows = [run_mode(m, world, rank, steps) for m in ("ddp", "zero2", "fsdp") + (("hsdp",) if world >= 4 else ())]
    every = dist.all_gather_object(rows)
    if rank == 0:
        Path(out).write_text(json.dumps([r for part in every for r in part]))
    dist.destroy(in_step=True)
    sys.stdout.flush()
    os._exit(0)  # see cli_kit.exit_after_distributed_run: an exit-time abort of torch's threads


def launch(world: int, steps: int, tmp: Path) -> list[dict]:
    out = tmp / f"world{world}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", "--master-addr=127.0.0.1",
           f"--master-port={29400 + world}", __file__, "--worker", str(out), "--steps", str(steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"the {world}-rank job failed:\n{r.stderr[-3000:]}")
    return json.loads(out.read_text())


def report(rows: list[dict], steps: int) -> list[str]:
    state = lambda r: sum(r["measured"][k] for k in ("params", "grads", "optimizer", "ema"))  # noqa: E731
    base = {r["world"]: max(state(x) for x in rows if x["world"] == r["world"] and x["mode"] == "ddp" and x["rank"] == 0)
            for r in rows}
    ddp1 = base[min(base)]
    ddp_time = {w: max(x["step_s"] for x in rows if x["world"] == w and x["mode"] == "ddp") for w in base}
    lines = [f"model state per rank (MiB; the most any rank holds), DiT depth {MODEL['depth']} width "
             f"{MODEL['hidden_size']}, {rows[0]['params'] / 1e6:.2f}M parameters, fp32, AdamW; {steps} steps",
             "ranks  mode   shards  params  grads   adamw   EMA   | state  x N / DDP-1 | gathered (est) | "
             "state est | step s  / DDP"]
    for world in sorted(base):
        for mode in ("ddp", "zero2", "fsdp", "hsdp"):
            mine = [r for r in rows if r["world"] == world and r["mode"] == mode]
            if not mine:
                continue
            top = max(mine, key=state)
            m, e = top["measured"], top["estimate_gib"]
            est_state = sum(v for k, v in e.items() if k != "gathered") * 2**30
            law = state(top) * top["shards"] / ddp1 if mode != "ddp" else state(top) / ddp1
            step = max(r["step_s"] for r in mine)
            lines.append(f"{world:>5}  {mode:<6} {top['shards']:>6}  {m['params'] / MiB:6.1f}  {m['grads'] / MiB:6.1f} "
                         f" {m['optimizer'] / MiB:6.1f}  {m['ema'] / MiB:5.1f} | {state(top) / MiB:6.1f}  {law:6.3f}"
                         f"         | {m['gathered'] / MiB:5.1f} ({e.get('gathered', 0.0) * 1024:5.1f}) | "
                         f"{est_state / MiB:7.1f}   | {step:.4f} {step / ddp_time[world]:5.2f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    ap.add_argument("--smoke", action="store_true", help="1 and 2 ranks, 1 step: the script runs")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.steps)
        return
    problem = sharding.sharding_problem()
    if problem:
        raise SystemExit(problem)
    worlds, steps = ([1, 2], 1) if args.smoke else ([int(w) for w in args.worlds.split(",")], args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [r for w in worlds for r in launch(w, steps, Path(tmp))]
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"{datetime.date.today()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
          f"{torch.__version__}, gloo; the machine is shared, so the step times are rough")
    print("\n".join(report(rows, steps)))


if __name__ == "__main__":
    main()
