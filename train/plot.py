"""Loss curves from `RUN/metrics.jsonl` as a PNG (`dit-train --plot RUN`), with matplotlib (the `plot` extra).

Top panel: loss, mse and vb against the optimizer step (log scale when the values span more than a decade);
bottom panel: throughput (images/s) when the records have it.
"""
from __future__ import annotations

import math
from pathlib import Path

from dit_pipeline.common.errors import UserError
from dit_pipeline.train.metrics import read_metrics


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


def plot_metrics(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the loss curve of a run folder (or a metrics .jsonl file) to `out` (default RUN/loss.png)."""
    src = Path(run_dir).expanduser()
    records = [r for r in read_metrics(src) if isinstance(r.get("step"), int)]
    if not records:
        where = src / "metrics.jsonl" if src.is_dir() else src
        raise UserError(f"no metrics in {where}: pass a run folder written by dit-train (it logs every "
                        "--log-every steps)")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("plotting needs matplotlib: pip install 'dit-pipeline[plot]'") from None
    out = Path(out) if out is not None else (src if src.is_dir() else src.parent) / "loss.png"
    has_speed = bool(_series(records, "images_per_s")[0])
    fig, axes = plt.subplots(2 if has_speed else 1, 1, figsize=(8, 6 if has_speed else 4), sharex=True,
                             squeeze=False)
    ax = axes[0][0]
    lows, highs = [], []
    for key in ("loss", "mse", "vb"):
        xs, ys = _series(records, key)
        if xs:
            ax.plot(xs, ys, label=key, linewidth=1.2 if key == "loss" else 0.8)
            lows.append(min(ys))
            highs.append(max(ys))
    if lows and min(lows) > 0 and max(highs) / min(lows) > 10:
        ax.set_yscale("log")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.grid(alpha=0.3)
    ax.legend()
    last = records[-1].get("loss")
    shown = f"{last:.4f}" if isinstance(last, (int, float)) else str(last)
    ax.set_title(f"{src.name}: step {records[-1]['step']}, loss {shown}")
    if has_speed:
        xs, ys = _series(records, "images_per_s")
        axes[1][0].plot(xs, ys, color="tab:green", linewidth=0.8)
        axes[1][0].set_ylabel("images/s")
        axes[1][0].grid(alpha=0.3)
    axes[-1][0].set_xlabel("optimizer step")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
