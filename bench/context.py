"""Benchmark: what in-context text costs NanoGen's DiT-DH (dit/incontext.py) beside its class tokens.

NanoGen conditions in context: its encoder attends over [image tokens; 4 time tokens; condition tokens]. ImageNet's
t4c8 adds 8 class tokens; its T2I model adds the text encoder's 256 tokens (Qwen3-0.6B, padded to 256 whatever the
caption), so every encoder block runs on 516 tokens instead of 268 at 256 px (256 image tokens). This script prints
the analytic cost at the release's size (tokens per sample, forward GMACs, the attention products' share) and times
the flow training step (forward + backward + AdamW) of both variants side by side in one process, at the release's
widths and a reduced depth, interleaved in rounds, each keeping its fastest call; the measured time ratio stands
beside the FLOP ratio of the same reduced model.

    python bench/context.py --threads 1 --repeat 3     # CPU: widths 1152 / 2048, encoder depth 2, head depth 1
    python bench/gpu.py --only context                   # GPU rows: the full model, bf16, per-block compile
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_checkout  # noqa: E402

use_checkout()

from dit_pipeline import dit  # noqa: E402
from dit_pipeline.dit.family import create_model  # noqa: E402
from dit_pipeline.dit.incontext import InContextDiTDH  # noqa: E402
from families import measure  # noqa: E402  (the interleaved fastest-of-N timer of bench/families.py)

PRESET = "ddt-en28d1152hd72-dn2d2048hd128"
TEXT_DIM, TEXT_TOKENS, CLASS_TOKENS, TIME_TOKENS = 1024, 256, 8, 4  # Qwen3-0.6B's width; NanoGen's t4c8 and t4
VARIANTS = {"t4c8: 8 class tokens": {"num_c_tokens": CLASS_TOKENS},
            "t4 + 256 text tokens": {"conditioning": "text", "text_dim": TEXT_DIM, "num_c_tokens": TEXT_TOKENS}}


def analytic(latent: int = 32, overrides: dict[str, Any] | None = None) -> dict[str, dict[str, float]]:
    """Per variant: encoder tokens per sample, forward GMACs, and the attention products' GMACs (q k^T and attn v
    of every block), for the preset on `latent` x `latent` SD-VAE latents."""
    out = {}
    for label, over in VARIANTS.items():
        with torch.device("meta"):
            config = create_model(PRESET, input_size=latent, **{**over, **(overrides or {})}).config
        tokens = (latent // config["patch_size"]) ** 2
        enc = tokens + TIME_TOKENS + config["num_c_tokens"]
        attn = (config["depth"] * 2 * enc * enc * config["hidden_size"]
                + config["head_depth"] * 2 * tokens * tokens * config["head_hidden_size"])
        out[label] = {"tokens": float(enc), "gmacs": InContextDiTDH.forward_macs(config) / 1e9, "attn_gmacs": attn / 1e9,
                      "train_gflop": dit.train_flops_per_image(config) / 1e9}
    return out


def build_step(label: str, *, latent: int, batch: int, device: torch.device, overrides: dict[str, Any],
               compile_backend: str | None = None) -> tuple[Callable[[], None], float]:
    """(a zero-argument flow training step of the variant, its training FLOPs per image)."""
    from dit_pipeline.train.speed import regional_compile

    torch.manual_seed(0)
    model = create_model(PRESET, input_size=latent, **{**VARIANTS[label], **overrides}).to(device).train()
    if compile_backend:
        regional_compile(model, backend=compile_backend)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0,
                            fused=device.type == "cuda")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 4, latent, latent, generator=g).to(device)
    t = torch.rand(batch, generator=g).to(device)
    if model.condition_kind == "text":  # padded to 256 as NanoGen pads; the captions' own lengths in the mask
        lengths = torch.randint(8, TEXT_TOKENS + 1, (batch,), generator=g)
        kwargs = {"text": torch.randn(batch, TEXT_TOKENS, TEXT_DIM, generator=g).to(device),
                  "text_mask": (torch.arange(TEXT_TOKENS)[None] < lengths[:, None]).to(device)}
    else:
        kwargs = {"y": torch.randint(0, 1000, (batch,), generator=g).to(device)}
    flow, amp = dit.create_flow(), torch.bfloat16 if device.type == "cuda" else None

    def step() -> None:
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            loss = flow.training_losses(model, x, t, kwargs)["loss"].mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, float(dit.train_flops_per_image(model.config))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--latent", type=int, default=32, help="latent side (SD-VAE at 256 px: 32, 256 tokens)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--depth", type=int, default=2, help="encoder blocks (the release has 28)")
    p.add_argument("--head-depth", type=int, default=1, help="head blocks (the release has 2)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="CPU intra-op threads (default: torch's)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    full = analytic(a.latent)
    print(f"# analytic, {PRESET} on 4x{a.latent}x{a.latent} latents (the release's depth)")
    print("| variant | encoder tokens / sample | forward GMAC / image | attention products GMAC | training GFLOP |")
    print("|---|---|---|---|---|")
    for label, v in full.items():
        print(f"| {label} | {v['tokens']:.0f} | {v['gmacs']:.1f} | {v['attn_gmacs']:.1f} | {v['train_gflop']:.0f} |")
    text, cls = full["t4 + 256 text tokens"], full["t4c8: 8 class tokens"]
    print(f"# text / class: tokens {text['tokens'] / cls['tokens']:.3f}, FLOPs {text['gmacs'] / cls['gmacs']:.3f}, "
          f"attention products {text['attn_gmacs'] / cls['attn_gmacs']:.3f}")
    over = {"depth": a.depth, "head_depth": a.head_depth}
    device = torch.device("cpu")
    steps, flops = {}, {}
    for label in VARIANTS:
        steps[label], flops[label] = build_step(label, latent=a.latent, batch=a.batch, device=device, overrides=over)
    sec = measure(steps, device, warmup=a.warmup, iters=a.iters, repeat=a.repeat)
    print(f"# flow training step, widths 1152 / 2048, encoder depth {a.depth}, head depth {a.head_depth}, batch "
          f"{a.batch}, CPU {torch.get_num_threads()} thread(s), torch {torch.__version__}; best of {a.repeat} "
          f"interleaved rounds x {a.iters} calls")
    print("| variant | s/step | vs t4c8 | training GFLOP / image | FLOP ratio |")
    print("|---|---|---|---|---|")
    base = next(iter(VARIANTS))
    for label in VARIANTS:
        print(f"| {label} | {sec[label]:.3f} | {sec[label] / sec[base]:.3f} | {flops[label] / 1e9:.1f} | "
              f"{flops[label] / flops[base]:.3f} |")


# ---- bench/gpu.py's section ------------------------------------------------------------------------------------

def context_section(res: Any, s: dict, device: torch.device) -> None:
    """Rows "<variant> flow step" (the full model on 4x32x32 latents, bf16, per-block compile, fused AdamW, at
    bench/gpu.py's batch halved until it fits), then "text / class": the time ratio beside the FLOP ratio."""
    from dit_pipeline.train.metrics import peak_tflops

    smoke = s["vae"] == "tiny"
    over = {"depth": 1, "hidden_size": 32, "num_heads": 2, "head_depth": 1, "head_hidden_size": 32,
            "head_num_heads": 2} if smoke else {}
    latent = 8 if smoke else 32
    peak = peak_tflops(device)
    rates, flops = {}, {}
    for label in VARIANTS:
        step = None
        for batch in [s["batch"]] + [b for b in (128, 64, 32) if b < s["batch"] and device.type == "cuda"]:
            try:
                step, flops[label] = build_step(label, latent=latent, batch=batch, device=device, overrides=over,
                                                compile_backend=s["compile_backend"])
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                step()
                break
            except torch.cuda.OutOfMemoryError:
                step = None
                torch.cuda.empty_cache()
        if step is None:
            raise RuntimeError(f"{label}'s step does not fit even at batch 32")
        sec = measure({label: step}, device, warmup=max(0, s["warmup"] - 1), iters=s["steps"], repeat=1)[label]
        rates[label] = batch / sec
        res.add("context", f"{label} flow step", batch=batch, img_s=rates[label], step_ms=sec * 1e3,
                mfu=flops[label] * rates[label] / (peak * 1e12) if peak else None,
                peak_mem_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None)
        del step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    cls, text = VARIANTS  # in VARIANTS' order
    res.add("context", "text step / class step", time_ratio=rates[cls] / rates[text], flops_ratio=flops[text] / flops[cls])


if __name__ == "__main__":
    main()
