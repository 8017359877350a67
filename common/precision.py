"""Precision settings shared by extraction, training and sampling: the autocast dtype of each
`--precision` value and TF32 for the float32 work that stays outside autocast."""
from __future__ import annotations

import torch

AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISIONS: tuple[str, ...] = tuple(AUTOCAST_DTYPES)   # the --precision values of dit-sample
AUTO = "auto"                                          # dit-extract / dit-train: resolved per device
PRECISIONS_AUTO: tuple[str, ...] = (AUTO, *PRECISIONS)  # the --precision values of dit-extract / dit-train


def set_tf32(enabled: bool) -> None:
    """TF32 on or off for float32 matmuls and convolutions (no effect on GPUs without it, or on CPU).

    Recent torch has a per-backend `fp32_precision` API and refuses to mix it with the legacy `allow_tf32`
    flags in one process; older torch (the pyproject admits >= 2.4) has only the legacy flags.
    """
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        mode = "tf32" if enabled else "ieee"
        torch.backends.cuda.matmul.fp32_precision = mode
        torch.backends.cudnn.conv.fp32_precision = mode
    else:
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled
