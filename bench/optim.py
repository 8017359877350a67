"""Benchmark: one optimizer step of `dit-train --optimizer adamw` vs `--optimizer muon` (train.optim), side by side.

Both optimizers are built exactly as the trainer builds them (`train.optim.build_optimizer`: AdamW over every
trainable tensor; Muon on the 2-D ones + AdamW on the rest) over the same DiT, with the same random gradients.
The two are timed in interleaved rounds (A, B, A, B, ...) in one process, so load from other jobs on a shared
machine falls on both; each round times `--steps` calls of `opt.step()` and keeps the mean, and the report gives
the best and the median round of each and the ratio muon / adamw of the medians. Also the optimizer state each
keeps (bytes), which the plan's memory estimate counts.

    python bench/optim.py --model DiT-S/2 --rounds 5 --steps 3
    python bench/optim.py --model DiT-B/2 --rounds 5 --steps 3 --threads 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_checkout  # noqa: E402

use_checkout()  # run from a checkout without installing


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="DiT-S/2", help="preset, e.g. DiT-B/2")
    p.add_argument("--input-size", type=int, default=32, help="latent side (32: 256 px on SD-VAE)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of each optimizer")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps timed per round")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="also write the result as JSON here")
    return p.parse_args(argv)


def state_bytes(opt) -> int:
    sd = opt.state_dict()
    states = [sd["muon"]["state"], sd["adamw"]["state"]] if "muon" in sd else [sd["state"]]
    return sum(v.numel() * v.element_size() for s in states for st in s.values() for v in st.values()
               if hasattr(v, "numel") and v.dim() > 0)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch

    from dit_pipeline import dit
    from dit_pipeline.train import merge_config
    from dit_pipeline.train.optim import build_optimizer, split_for_muon

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = dit.create_model(args.model, input_size=args.input_size, learn_sigma=False).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(0)
    for p in params:  # the same gradients for both; they stay set (step() does not clear them)
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(device)
    opts = {name: build_optimizer(params, merge_config({}, {"shards": "s", "run_dir": "r", "optimizer": name}), device)
            for name in ("adamw", "muon")}
    for opt in opts.values():  # first steps allocate the state: untimed
        opt.step()
    times: dict[str, list[float]] = {name: [] for name in opts}
    for _ in range(args.rounds):
        for name, opt in opts.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / args.steps)
    two_d, rest = split_for_muon(params)
    result = {"model": args.model, "input_size": args.input_size, "device": str(device), "threads": args.threads,
              "params": sum(p.numel() for p in params), "muon_params": sum(p.numel() for p in two_d),
              "muon_tensors": len(two_d), "adamw_tensors_with_muon": len(rest), "torch": torch.__version__,
              **{f"{n}_ms_best": 1e3 * min(t) for n, t in times.items()},
              **{f"{n}_ms_median": 1e3 * statistics.median(t) for n, t in times.items()},
              **{f"{n}_state_mb": state_bytes(opt) / 2**20 for n, opt in opts.items()}}
    result["ratio_muon_over_adamw"] = result["muon_ms_median"] / result["adamw_ms_median"]
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
