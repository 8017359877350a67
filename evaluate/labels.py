"""Names that carry an evaluation's sample count, so a proxy cannot pass for the paper metric: FID of 10,000
samples is "FID-10K", of 50,000 "FID-50K" (the number DiT, SiT, REPA, LightningDiT and EDM2 report); MDT #18 and
LightningDiT #38 are users comparing a training-time FID-10K with a paper's FID-50K. dit-eval's JSON and
printout, and FID during training (metrics.jsonl `fid_name`, TensorBoard and W&B `eval/FID-5K`) use them."""
from __future__ import annotations

PAPER_SAMPLES = 50_000
_SHORT = {"fid": "FID", "sfid": "sFID", "fd_dinov2": "FD_DINOv2"}
LABELLED = tuple(_SHORT)


def count_label(n: int) -> str:
    """50000 -> "50K", 12500 -> "12.5K", 999 -> "999"."""
    if n >= 1000 and n % 100 == 0:
        return f"{n / 1000:g}K"
    return str(n)


def metric_name(key: str, n: int) -> str:
    """"FID-10K" for key "fid" over n = 10000 samples (likewise sFID, FD_DINOv2)."""
    return f"{_SHORT[key]}-{count_label(n)}"


def metric_names(n: int) -> dict[str, str]:
    return {k: metric_name(k, n) for k in LABELLED}


def t2i_metric_name(short: str, n: int) -> str:
    """A text-to-image score named the same way: "CLIPScore-30K" for "CLIPScore" over 30000 samples,
    "GenEval-2212" for GenEval's 553 prompts x 4 images (evaluate/t2i.py)."""
    return f"{short}-{count_label(n)}"
