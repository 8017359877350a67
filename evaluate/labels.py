"""Names that carry what produced a number, so a proxy cannot pass for the paper metric.

- The sample count: FID of 10,000 samples is "FID-10K", of 50,000 "FID-50K" (the number DiT, SiT, REPA,
  LightningDiT and EDM2 report); MDT #18 and LightningDiT #38 are users comparing a training-time FID-10K with a
  paper's FID-50K.
- The network: with random Inception weights (`--random-inception`, `--fid-random-inception`: a smoke test) the
  numbers are not FID at all. They are stored under their own keys (`fd_rand`, `sfd_rand`, `is_rand`,
  `precision_rand`, `recall_rand`, never `fid`) and named "FD-rand0-8" (the Frechet distance of a random network
  of seed 0 over 8 samples), so no log line, JSON key, metrics.jsonl row, TensorBoard/W&B tag or report calls them
  FID or draws them beside a paper's FID.

dit-eval's JSON and printout, and FID during training (metrics.jsonl `fid_name`, TensorBoard and W&B
`eval/FID-5K`) use them.
"""
from __future__ import annotations

from typing import Any

PAPER_SAMPLES = 50_000
_SHORT = {"fid": "FID", "sfid": "sFID", "fd_dinov2": "FD_DINOv2"}
LABELLED = tuple(_SHORT)
# a random Inception's numbers: their keys and the short names of the distances
RANDOM_KEYS = {"fid": "fd_rand", "sfid": "sfd_rand", "inception_score": "is_rand", "precision": "precision_rand",
               "recall": "recall_rand"}
_RANDOM_SHORT = {"fid": "FD", "sfid": "sFD"}
FID_KEYS = ("fid", "fd_rand")  # where a record holds its FID-like number
# the numbers that are not distances, as tables and printouts name them: a random Inception's under names of
# their own (dit-eval's printout, dit-report's table)
SCORE_LABELS = {"inception_score": "Inception Score", "precision": "Precision", "recall": "Recall",
                "is_rand": "IS-rand (not IS)", "precision_rand": "Precision-rand", "recall_rand": "Recall-rand"}


def count_label(n: int) -> str:
    """50000 -> "50K", 12500 -> "12.5K", 999 -> "999"."""
    if n >= 1000 and n % 100 == 0:
        return f"{n / 1000:g}K"
    return str(n)


def record_key(key: str, random_seed: int | None = None) -> str:
    """The key a number is stored under: "fid", or "fd_rand" when a random Inception computed it."""
    return RANDOM_KEYS.get(key, key) if random_seed is not None else key


def metric_name(key: str, n: int, random_seed: int | None = None) -> str:
    """"FID-10K" for key "fid" over n = 10000 samples (likewise sFID, FD_DINOv2); "FD-rand0-10K" from a random
    Inception of seed 0 (FD_DINOv2 does not use Inception)."""
    if random_seed is not None and key in _RANDOM_SHORT:
        return f"{_RANDOM_SHORT[key]}-rand{random_seed}-{count_label(n)}"
    return f"{_SHORT[key]}-{count_label(n)}"


def metric_names(n: int, random_seed: int | None = None) -> dict[str, str]:
    """{stored key: name} of the named distances over n samples."""
    return {record_key(k, random_seed): metric_name(k, n, random_seed) for k in LABELLED}


def fid_key(record: dict[str, Any]) -> str | None:
    """The key of the FID-like number a record holds ("fid", or "fd_rand" for a random Inception's), None if none."""
    return next((k for k in FID_KEYS if record.get(k) is not None), None)


def short_names(random_seed: int | None = None) -> dict[str, str]:
    """The short names of a log line's other numbers: sFID, IS, precision, recall, or a random Inception's
    sFD-rand0, IS-rand, precision-rand, recall-rand (issue 47: its log line said "(sFID ..., IS ...)")."""
    if random_seed is None:
        return {"sfid": "sFID", "inception_score": "IS", "precision": "precision", "recall": "recall"}
    return {"sfid": f"sFD-rand{random_seed}", "inception_score": "IS-rand", "precision": "precision-rand",
            "recall": "recall-rand"}


def random_note(seed: int) -> str:
    return (f"the Frechet distance of an Inception network with random weights (seed {seed}): a smoke test, not "
            "FID, comparable with nothing published")


def t2i_metric_name(short: str, n: int) -> str:
    """A text-to-image score named the same way: "CLIPScore-30K" for "CLIPScore" over 30000 samples,
    "GenEval-2212" for GenEval's 553 prompts x 4 images (evaluate/t2i.py)."""
    return f"{short}-{count_label(n)}"


def sampled_by(sampling: dict[str, Any]) -> str:
    """A sampling protocol record (Protocol.record) in words: "ddpm in 250 steps" or "the ddt protocol
    (MCG-NJU/DDT): euler in 6 steps, changed: steps 6"."""
    how = f"{sampling.get('solver')} in {sampling.get('count')} steps"
    shift = (sampling.get("grid") or {}).get("resolved_shift")
    if isinstance(shift, (int, float)) and shift != 1.0:
        how += f", time shift {shift:g}"
    if sampling.get("name") in (None, "custom"):
        return how
    changed = f", changed: {', '.join(sampling['overrides'])}" if sampling.get("overrides") else ""
    return f"the {sampling['name']} protocol ({sampling.get('release')}): {how}{changed}"
