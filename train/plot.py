"""Loss curves from `RUN/metrics.jsonl` as a PNG (`dit-train --plot RUN`), with matplotlib (the `plot` extra).

Top panel: the loss and the terms the run logged (train.metrics.LOSS_TERMS: mse, ddpm's vb, --repa's proj)
against the optimizer step (log scale when the values span more than a decade);
then FID against the step when the run logged it (`--fid-every`, evaluate/hook.py), with the best value;
bottom panel: throughput (images/s) when the records have it.
"""
from __future__ import annotations

import math
from pathlib import Path

from dit_pipeline.common.errors import UserError
from dit_pipeline.train.metrics import LOSS_TERMS, read_metrics


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


def plot_metrics(run_dir: str | Path, out: str | Path | None = None, *,
                 paper: tuple[str, float] | None = None) -> Path:
    """Write the loss curve of a run folder (or a metrics .jsonl file) to `out` (default RUN/loss.png).
    `paper`: (label, FID) drawn as a line on the FID panel (dit-report: the recipe's published number);
    divergence-guard rollbacks are marked on the loss panel."""
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
    has_fid = bool(_series(records, "fid")[0])
    rows = 1 + has_fid + has_speed
    fig, axes = plt.subplots(rows, 1, figsize=(8, 4 if rows == 1 else 3 * rows), sharex=True, squeeze=False)
    ax = axes[0][0]
    lows, highs = [], []
    for key in LOSS_TERMS:  # the loss and the terms the run logged (flow: no vb; --repa: proj)
        xs, ys = _series(records, key)
        if xs:
            ax.plot(xs, ys, label=key, linewidth=1.2 if key == "loss" else 0.8)
            lows.append(min(ys))
            highs.append(max(ys))
    if lows and min(lows) > 0 and max(highs) / min(lows) > 10:
        ax.set_yscale("log")
    ax.set_ylabel("training loss (mean over ranks)")
    counts = [r for r in records if isinstance(r.get("rollbacks"), int)]  # training records (not FID ones)
    rolled = [r["step"] for prev, r in zip(counts, counts[1:]) if r["rollbacks"] > prev["rollbacks"]]
    for i, step in enumerate(rolled):  # the first step after a rollback (train/guard.py)
        ax.axvline(step, color="tab:purple", linestyle=":", linewidth=1, label="rollback" if i == 0 else None)
    ax.grid(alpha=0.3)
    ax.legend()
    last = [r for r in records if "loss" in r] or records
    loss = last[-1].get("loss")
    shown = f"{loss:.4f}" if isinstance(loss, (int, float)) else str(loss)
    ax.set_title(f"{src.name}: step {last[-1]['step']}, loss {shown}")
    if has_fid:
        xs, ys = _series(records, "fid")
        fid_ax = axes[1][0]
        fid_ax.plot(xs, ys, "o-", color="tab:red", linewidth=1.0, markersize=3)
        last_fid = next(r for r in reversed(records) if "fid" in r)
        n, name = last_fid.get("fid_num_samples"), last_fid.get("fid_name")  # "FID-5K" (evaluate/labels.py)
        fid_ax.set_ylabel(name or (f"FID ({n} samples)" if n else "FID"))
        fid_ax.set_title(f"best {name or 'FID'} {min(ys):.3g} at step {xs[ys.index(min(ys))]}", fontsize=9)
        if paper is not None:
            fid_ax.axhline(paper[1], color="black", linestyle="--", linewidth=1, label=paper[0])
            fid_ax.legend(fontsize=8)
        fid_ax.grid(alpha=0.3)
    if has_speed:
        xs, ys = _series(records, "images_per_s")
        axes[-1][0].plot(xs, ys, color="tab:green", linewidth=0.8)
        axes[-1][0].set_ylabel("images/s")
        axes[-1][0].grid(alpha=0.3)
    axes[-1][0].set_xlabel("optimizer step")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
