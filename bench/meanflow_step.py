"""Benchmark: the MeanFlow training step vs the flow step, side by side in one process (dit/meanflow.py).

Each variant runs one training step (forward + backward of its loss, AdamW) of the same model size on the same
random latents and labels; the variants are interleaved in rounds and each keeps its fastest call (slower calls
measure other processes on a shared machine):
  flow                      dit.create_flow()'s velocity loss (the baseline)
  meanflow                  --objective meanflow without training guidance: the JVP pass (math attention, no
                            autograd) + the ordinary forward and backward
  meanflow guided           with training guidance (omega 0.6, kappa 0.2): + one guiding forward of 2N samples
and the JVP pass alone with the math kernel, and the ordinary forward alone with the default and the math kernel.
FLOPs per image of a step, counted in forwards F: flow 3F (forward + backward), meanflow 5F (+ the JVP pass: the
primal and the tangent, 2F), guided 7F (+ the guiding forward of two copies, 2F).

    python bench/meanflow_step.py --threads 1 --repeat 3     # CPU: DiT-B/2 blocks x 4, latents 4x16x16, batch 4
    python bench/gpu.py --only meanflow                      # GPU rows: DiT-XL/2 meanflow step (bench/gpu.py)
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_checkout  # noqa: E402

use_checkout()

from dit_pipeline import dit  # noqa: E402
from families import measure  # noqa: E402 (the same timing rule as the families bench)
from dit_pipeline.dit.meanflow import MeanFlow, time_input  # noqa: E402

FORWARDS = {"flow": 3, "meanflow": 5, "meanflow guided": 7}  # FLOPs per image of a step, in forwards


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(name: str, *, latent: int, channels: int, batch: int, device: torch.device,
          overrides: dict[str, Any] | None = None, compile_backend: str | None = None
          ) -> tuple[dict[str, Callable[[], None]], float, torch.nn.Module]:
    """({variant: a zero-argument step}, one forward's FLOPs per image, the model)."""
    from dit_pipeline.train.speed import regional_compile

    torch.manual_seed(0)
    model = dit.create_model(name, input_size=latent, in_channels=channels, num_classes=1000, learn_sigma=False,
                             conditions="meanflow", **(overrides or {})).to(device).train()
    if compile_backend:
        regional_compile(model, backend=compile_backend)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0,
                            fused=device.type == "cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(batch, channels, latent, latent, generator=g).to(device)
    e = torch.randn(batch, channels, latent, latent, generator=g).to(device)
    y = torch.randint(0, 1000, (batch,), generator=g).to(device)
    keep = torch.zeros_like(y)
    amp = torch.bfloat16 if device.type == "cuda" else None
    flow = dit.create_flow()
    plain, guided = MeanFlow(kappa=0.0), MeanFlow(omega=0.6, kappa=0.2)  # plain: no training guidance
    for mf in (plain, guided):
        mf.attach(model)
    tr = plain.draw_timesteps(batch, generator=torch.Generator(device="cpu").manual_seed(1)).to(device)
    t = tr[:, 0]

    def fn(*a: Any, **k: Any) -> torch.Tensor:
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            return model(*a, **k)

    def flow_fn(z: torch.Tensor, tt: torch.Tensor, **k: Any) -> torch.Tensor:  # the same model, h = 0
        return fn(z, time_input("meanflow", tt, tt), **k)

    def step(loss_of: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            loss_of().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return run

    kw = {"y": y, "force_drop_ids": keep}
    steps = {
        "flow": step(lambda: flow.training_losses(flow_fn, x, t, kw, noise=e)["loss"]),
        "meanflow": step(lambda: plain.training_losses(fn, x, tr, kw, noise=e)["loss"]),
        "meanflow guided": step(lambda: guided.training_losses(fn, x, tr, kw, noise=e)["loss"]),
    }
    tin = time_input("meanflow", tr[:, 0], tr[:, 1])

    def jvp_pass() -> None:
        plain.jvp(x, tr, y, keep, e)

    def forward(kernel: str) -> Callable[[], None]:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def run() -> None:
            with torch.no_grad(), (sdpa_kernel([SDPBackend.MATH]) if kernel == "math" else contextlib.nullcontext()):
                fn(x, tin, y, force_drop_ids=keep)
        return run

    steps.update({"JVP pass (math kernel)": jvp_pass, "forward, default kernel": forward("default"),
                  "forward, math kernel": forward("math")})
    return steps, float(dit.forward_macs(model.config)) * 2, model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--latent", type=int, default=16, help="latent side (tokens = (latent / 2)^2)")
    p.add_argument("--channels", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--depth", type=int, default=4, help="DiT-B/2 blocks (B has 12)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="CPU intra-op threads (default: torch's)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device("cpu")
    steps, _, _ = build("DiT-B/2", latent=a.latent, channels=a.channels, batch=a.batch, device=device,
                        overrides={"depth": a.depth})
    sec = measure(steps, device, warmup=a.warmup, iters=a.iters, repeat=a.repeat)
    print(f"# DiT-B/2 blocks x {a.depth}, latents {a.channels}x{a.latent}x{a.latent} ({(a.latent // 2) ** 2} tokens), "
          f"batch {a.batch}, CPU {torch.get_num_threads()} thread(s), torch {torch.__version__}; best of {a.repeat} "
          f"interleaved rounds x {a.iters} calls")
    print("| variant | s/call | vs flow step | FLOPs vs flow step |")
    print("|---|---|---|---|")
    for label, s in sec.items():
        flops = f"{FORWARDS[label] / 3:.2f}" if label in FORWARDS else ""
        print(f"| {label} | {s:.4f} | {s / sec['flow']:.2f} | {flops} |")
    print(f"# JVP pass / forward (default kernel): {sec['JVP pass (math kernel)'] / sec['forward, default kernel']:.2f}; "
          f"math / default kernel forward: {sec['forward, math kernel'] / sec['forward, default kernel']:.2f}")


# ---- bench/gpu.py's section ------------------------------------------------------------------------------------

def meanflow_section(res: Any, s: dict, device: torch.device) -> None:
    """Rows "DiT-XL/2 <variant>": the flow and meanflow steps (plain and guided), the JVP pass and the forwards of
    DiT-XL/2 on 4x32x32 latents at bench/gpu.py's batch (halved until it fits), bf16 autocast for the ordinary
    passes (the JVP pass: float32, math attention, eager), per-block compile, fused AdamW: images/s, MFU (FLOPs
    counted in forwards: FORWARDS), peak memory."""
    from dit_pipeline.train.metrics import peak_tflops

    smoke = s["vae"] == "tiny"
    peak = peak_tflops(device)
    steps = None
    for batch in [s["batch"]] + [b for b in (128, 64, 32) if b < s["batch"] and device.type == "cuda"]:
        try:
            steps, fwd_flops, _ = build(s["model"], latent=s["latent"], channels=4, batch=batch, device=device,
                                        overrides=s["overrides"] or None, compile_backend=s["compile_backend"])
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            steps["meanflow guided"]()
            _sync(device)
            break
        except torch.cuda.OutOfMemoryError:
            steps = None
            torch.cuda.empty_cache()
    if steps is None:
        raise RuntimeError("the meanflow step of DiT-XL/2 does not fit even at batch 32")
    sec = measure(steps, device, warmup=max(0, s["warmup"] - 1), iters=s["steps"] if not smoke else 1, repeat=1)
    peak_mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    for label, t in sec.items():
        img_s = batch / t
        flops = fwd_flops * FORWARDS.get(label, 1)
        res.add("meanflow", f"{s['model']} {label}", batch=batch, img_s=img_s, step_ms=t * 1e3,
                vs_flow=t / sec["flow"], mfu=flops * img_s / (peak * 1e12) if peak else None,
                jvp_kernel="math", peak_mem_gib=peak_mem)
    res.add("meanflow", "meanflow step / flow step", time_ratio=sec["meanflow"] / sec["flow"],
            guided_time_ratio=sec["meanflow guided"] / sec["flow"], flops_ratio=FORWARDS["meanflow"] / 3)


if __name__ == "__main__":
    main()
