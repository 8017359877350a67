"""Speed settings the trainer applies from outside the model (dit/ stays pure nn): regional compile, the
SDPA attention backend, the one-pass EMA update.

Regional compile (`torch.compile` per DiT block, the "regional compilation" recipe of the PyTorch tutorials)
compiles one block graph that all 28 blocks of DiT-XL/2 reuse, so it takes seconds instead of the minutes of a
whole-model compile; `nn.Module.compile()` compiles in place, so parameter names and state_dicts never get an
`_orig_mod.` prefix. Inside a block inductor fuses LayerNorm + adaLN modulate + gate + residual add and the
tanh-GELU into the neighbouring matmul epilogues. Where compile cannot run (no triton, an old torch, an
error while tracing) the blocks fall back to eager with one warning (`torch._dynamo.config.suppress_errors`).

Residual stream dtype: under autocast the residual stream stays float32 (the fp32 `pos_embed` and LayerNorm
keep it so). That is deliberate: 28 residual additions in bf16 would round away the small block updates of
adaLN-Zero; with regional compile the fp32 add, norm and modulation are fused into one kernel per site, so
the fp32 stream costs memory traffic of ~4 bytes x tokens x hidden per site, not extra kernels.

Attention: DiT-XL/2 has head dim 72, which the SDPA backends (cuDNN, flash, memory-efficient) support with
different speed on each GPU generation. `choose_attention` times a forward + backward of the model's own
attention shape with each available backend on the GPU at start-up (a few milliseconds) and keeps the
fastest enabled (with the math kernel as the fallback for shapes it rejects); the choice is logged.
"""
from __future__ import annotations

import time
from typing import Any, Iterable

import torch
import torch.nn.functional as F

_FLAGS = {"cudnn": "enable_cudnn_sdp", "flash": "enable_flash_sdp", "efficient": "enable_mem_efficient_sdp",
          "math": "enable_math_sdp"}
ATTENTION_BACKENDS = ("auto", "cudnn", "flash", "efficient", "math")  # --attention: auto, or one of _FLAGS


def compile_enabled(setting: bool | None, device: torch.device) -> bool:
    """`--compile` resolved: None (the default) means on for CUDA and off on the CPU."""
    return device.type == "cuda" if setting is None else bool(setting)


def compile_problem() -> str | None:
    """Why torch.compile cannot run here (None when it can)."""
    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    try:
        from torch.utils._triton import has_triton
    except ImportError:  # pragma: no cover - very old torch
        return None
    if torch.cuda.is_available() and not has_triton():
        return "triton is not installed (pip install triton)"
    return None


def regional_compile(model: torch.nn.Module, *, backend: str = "inductor", **options: Any) -> int:
    """Compile every block and the final layer in place (names unchanged); returns how many modules were compiled.

    A tracing error falls back to eager execution of that frame instead of stopping the run.
    """
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True
    # the model's blocks and final layer (every family's `compile_units`; a bare module: its blocks and final layer)
    units: list[torch.nn.Module] = (
        getattr(model, "compile_units")() if hasattr(model, "compile_units") else
        [*getattr(model, "blocks", []), *([getattr(model, "final_layer")] if hasattr(model, "final_layer") else [])])
    # Every block has the same graph: let dynamo keep one cache entry per block object without hitting
    # its recompile limit (it counts per code object, which all blocks share).
    limit = max(int(getattr(torch._dynamo.config, "cache_size_limit", 8)), 2 * len(units) + 8)
    torch._dynamo.config.cache_size_limit = limit
    if hasattr(torch._dynamo.config, "accumulated_cache_size_limit"):
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, 4 * limit)
    for unit in units:
        unit.compile(backend=backend, **options)
    return len(units)


def available_attention() -> list[str]:
    """SDPA backends this torch build has switches for (cuDNN attention needs torch >= 2.5)."""
    return [name for name, flag in _FLAGS.items() if hasattr(torch.backends.cuda, flag)]


def set_attention(name: str) -> None:
    """Enable only `name` (plus math as the fallback) for every SDPA call in this process."""
    for backend, flag in _FLAGS.items():
        if hasattr(torch.backends.cuda, flag):
            getattr(torch.backends.cuda, flag)(backend in (name, "math"))


def _time_backend(name: str, q: torch.Tensor, reps: int) -> float:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kind = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]
    with sdpa_kernel([kind]):
        q = q.detach().requires_grad_(True)
        F.scaled_dot_product_attention(q, q, q).sum().backward()  # warm-up (and: supported at all?)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            F.scaled_dot_product_attention(q, q, q).sum().backward()
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def choose_attention(requested: str, device: torch.device, *, batch: int, heads: int, tokens: int,
                     head_dim: int, dtype: torch.dtype | None, reps: int = 3) -> tuple[str, dict[str, float]]:
    """The SDPA backend to use: (name, {backend: seconds per forward+backward} of the probe).

    On the CPU nothing is changed ("default"). On CUDA "auto" times every available backend on the model's
    attention shape (batch capped at 64) and enables the fastest; a named backend is enabled as asked.
    """
    if device.type != "cuda":
        return "default", {}
    if requested != "auto":
        set_attention(requested)
        return requested, {}
    q = torch.randn(min(batch, 64), heads, tokens, head_dim, device=device, dtype=dtype or torch.float32)
    times: dict[str, float] = {}
    for name in [b for b in ("cudnn", "flash", "efficient") if b in available_attention()]:
        try:
            times[name] = _time_backend(name, q, reps)
        except RuntimeError:  # not supported for this shape/dtype/GPU
            continue
    best = min(times, key=lambda name: times[name]) if times else "math"
    set_attention(best)
    return best, times


@torch.no_grad()
def ema_update(ema_params: Iterable[torch.Tensor], params: Iterable[torch.Tensor], decay: float) -> None:
    """ema <- decay * ema + (1 - decay) * param, as one fused pass: ema + (1 - decay) * (param - ema)."""
    ema_params, params = list(ema_params), list(params)
    if ema_params:
        torch._foreach_lerp_(ema_params, params, 1.0 - decay)
