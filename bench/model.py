"""Benchmark: DiT training-step throughput (forward + backward of the hybrid diffusion loss).

Reports images/s, achieved TFLOP/s counted as 2 x 3 x the analytic forward multiply-accumulates
(dit.forward_macs; the DiT paper's convention), MFU when the device's peak is known, and peak memory.
Every combination of the list options runs in its own fresh process (clean peak memory, no compile
cache sharing), side by side, with throughput as a ratio to the first row. Throughput is taken from the
fastest timed step and the best of --repeat interleaved rounds, so other load on a shared machine
inflates nothing.

    python bench/model.py --model DiT-S/2 --batch 8 --precision fp32 bf16 --grad-checkpointing off on
    python bench/model.py --model DiT-XL/2 --batch 256 --precision bf16 --compile off on   # on a GPU
    python bench/model.py --model DiT-S/2 --batch 8 --objective ddpm flow --block-option plain qk_norm rms_norm \
        swiglu rope all --optimizer --repeat 3      # step cost of the objectives and block options
"""
from __future__ import annotations

import argparse
import itertools
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_checkout  # noqa: E402

use_checkout()  # run from a checkout without installing

# Dense bf16/fp16 tensor-core peaks (TFLOP/s) for MFU; fp32 and CPUs have no entry.
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="DiT-S/2", help="preset, e.g. DiT-XL/2")
    p.add_argument("--image-size", type=int, default=256, help="pixels; latents are image-size / 8")
    p.add_argument("--batch", type=int, nargs="+", default=[8])
    p.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "tf32", "bf16", "fp16"],
                   help="bf16/fp16 = autocast with fp32 weights (as in AMP training)")
    p.add_argument("--compile", nargs="+", default=["off"], choices=["off", "on"])
    p.add_argument("--grad-checkpointing", nargs="+", default=["off"],
                   help="off, on (all blocks) or a number of blocks")
    p.add_argument("--objective", nargs="+", default=["ddpm"], choices=["ddpm", "flow"])
    p.add_argument("--block-option", nargs="+", default=["plain"],
                   choices=["plain", "qk_norm", "rms_norm", "swiglu", "rope", "all"],
                   help="DiT block features (dit/blocks.py); 'all' = the four together")
    p.add_argument("--optimizer", action="store_true", help="include an AdamW step in each iteration")
    p.add_argument("--steps", type=int, default=5, help="timed iterations")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations first (compile happens here)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the whole set of variants this many times, interleaved; report the best")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (overrides table)")
    p.add_argument("--numerics", action="store_true",
                   help="instead: compare the model output under bf16 autocast with fp32")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_variant(v: dict) -> dict:
    """Build the model, run warmup + timed training iterations, return the measurements."""
    import torch

    from dit_pipeline import dit

    baseline_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # after imports, before the model
    device = torch.device(v["device"])
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = v["precision"] == "tf32"
    names = ("qk_norm", "rms_norm", "swiglu", "rope")
    options = {k: True for k in names if v.get("block_option", "plain") in (k, "all")}
    flow = v.get("objective", "ddpm") == "flow"
    model = dit.create_model(v["model"], input_size=v["image_size"] // 8, learn_sigma=not flow,
                             **options).to(device).train()
    ckpt = {"off": False, "on": True}.get(v["grad_checkpointing"])
    model.set_grad_checkpointing(int(v["grad_checkpointing"]) if ckpt is None else ckpt)
    net = torch.compile(model) if v["compile"] == "on" else model
    diffusion = dit.create_flow() if flow else dit.create_diffusion("")
    opt = None
    if v["optimizer"]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    n, size = v["batch"], v["image_size"] // 8
    x = torch.randn(n, 4, size, size, device=device)
    y = torch.randint(0, 1000, (n,), device=device)
    t = diffusion.draw_timesteps(n, device=device)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(v["precision"])

    def step() -> float:
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            loss = diffusion.training_losses(net, x, t, model_kwargs={"y": y})["loss"].mean()
        loss.backward()
        if opt is not None:
            opt.step()
        model.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(v["warmup"]):
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(v["steps"]):
        start = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - start)
    # The fastest step: slower ones measure other processes on a shared machine (as timeit advises).
    seconds = min(times)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**30
    else:  # ru_maxrss is KiB on Linux; growth over the freshly started process
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline_rss) / 2**20
    flops = dit.train_flops_per_image(model.config) * n
    return {**v, "img_s": n / seconds, "tflops": flops / seconds / 1e12, "peak_gib": peak,
            "loss": float(loss), "device_name": _device_name(device)}


def _device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads"


def _spawn(v: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(v)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        return {**v, "error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_variant(json.loads(args.worker))))
        return
    import torch

    from dit_pipeline import dit

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = dit.canonical_model_name(args.model)
    if args.numerics:
        compare_bf16(name, args.image_size, args.batch[0], device)
        return
    macs = _macs(name, args.image_size)
    print(f"# {name} at {args.image_size}px ({args.image_size // 8}x{args.image_size // 8} latents): "
          f"{macs / 1e9:.2f} G MACs forward/image; device {device}; steps {args.steps}, warmup {args.warmup}")
    variants = [dict(model=name, image_size=args.image_size, batch=batch, precision=precision,
                     compile=comp, grad_checkpointing=ckpt, optimizer=args.optimizer, steps=args.steps,
                     warmup=args.warmup, device=device, objective=objective, block_option=option)
                for batch, precision, comp, ckpt, objective, option in itertools.product(
                    args.batch, args.precision, args.compile, args.grad_checkpointing, args.objective,
                    args.block_option)]
    runs = [[_spawn(v) for v in variants] for _ in range(args.repeat)]  # interleaved rounds
    _print_table([_best(list(results)) for results in zip(*runs)], args.peak_tflops)


def _best(results: list[dict]) -> dict:
    """The run with the highest throughput; peak memory is the largest seen."""
    ok = [r for r in results if "error" not in r]
    if not ok:
        return results[0]
    return {**max(ok, key=lambda r: r["img_s"]), "peak_gib": max(r["peak_gib"] for r in ok)}


def compare_bf16(name: str, image_size: int, batch: int, device: str) -> None:
    """bf16-autocast vs fp32 forward on the same inputs. The zero-initialised layers (adaLN, final
    linear) get N(0, 0.02) weights so the output is not trivially zero."""
    import torch

    from dit_pipeline import dit

    torch.manual_seed(0)
    model = dit.create_model(name, input_size=image_size // 8).to(device).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "adaLN" in key or "final_layer.linear" in key:
                p.normal_(0, 0.02)
    x = torch.randn(batch, 4, image_size // 8, image_size // 8, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    print(f"# {name}, {image_size}px, batch {batch}, {device}: bf16 autocast vs fp32 output")
    print("| t | rel. L2 error | max abs error | max abs fp32 output | finite |")
    print("|---|---|---|---|---|")
    for step in (0, 250, 500, 999):
        t = torch.full((batch,), step, device=device)
        with torch.no_grad():
            ref = model(x, t, y)
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
                low = model(x, t, y).float()
        rel = ((low - ref).norm() / ref.norm()).item()
        print(f"| {step} | {rel:.2e} | {(low - ref).abs().max().item():.2e} | "
              f"{ref.abs().max().item():.2f} | {bool(torch.isfinite(low).all())} |")


def _macs(name: str, image_size: int) -> int:
    import torch

    from dit_pipeline import dit

    with torch.device("meta"):
        return dit.forward_macs(dit.create_model(name, input_size=image_size // 8).config)


def _print_table(rows: list[dict], peak_override: float | None) -> None:
    ok = [r for r in rows if "error" not in r]
    if ok:
        print(f"# device: {ok[0]['device_name']}")
    print("| batch | precision | compile | grad ckpt | objective | block option | img/s | ratio | TFLOP/s | MFU "
          "| peak mem GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    base = ok[0]["img_s"] if ok else None
    for r in rows:
        head = (f"| {r['batch']} | {r['precision']} | {r['compile']} | {r['grad_checkpointing']} | "
                f"{r.get('objective', 'ddpm')} | {r.get('block_option', 'plain')} |")
        if "error" in r:
            print(f"{head} failed: {r['error']} | | | | |")
            continue
        # the table's peaks are tensor-core bf16/fp16 figures: MFU of an fp32 run would mislead
        peak = peak_override or (next((p for k, p in PEAK_TFLOPS.items() if k in r["device_name"]), None)
                                 if r["precision"] in ("bf16", "fp16") else None)
        mfu = f"{100 * r['tflops'] / peak:.1f}%" if peak else "-"
        print(f"{head} {r['img_s']:.2f} | {r['img_s'] / base:.2f} | {r['tflops']:.3f} | {mfu} | "
              f"{r['peak_gib']:.2f} |")


if __name__ == "__main__":
    main()
