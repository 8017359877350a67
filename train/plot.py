"""Loss curves from `RUN/metrics.jsonl` as a PNG (`dit-train --plot RUN`), with matplotlib (the `plot` extra).

Top panel: the loss and the terms the run logged (train.metrics.LOSS_TERMS: mse, ddpm's vb, --repa's proj)
against the optimizer step (log scale when the values span more than a decade); a MeanFlow/iMF run's loss is
adaptively weighted (about 1 by design), so its unweighted mse gets an axis of its own beside it; divergence-guard
rollbacks are marked at the step where they happened ("rollback 23 -> 20");
then FID against the step when the run logged it (`--fid-every`, evaluate/hook.py), with the best value and the
protocol, sample count and reference in its label; a random Inception's numbers are labelled as such
(evaluate/labels.py) and never drawn against a paper's FID; then the validation loss at fixed timesteps of the EMA
and raw weights (`--val-shards`, train/validation.py); then a data mix's realised share of each source against the
share it asked for (dashed; train/mixdata.py);
bottom panel: throughput (images/s) when the records have it.
"""
from __future__ import annotations

import math
from pathlib import Path

from dit_pipeline.common.errors import UserError
from dit_pipeline.evaluate.labels import fid_key
from dit_pipeline.train.metrics import LOSS_TERMS, read_metrics

ADAPTIVE_OBJECTIVES = ("meanflow", "imf")  # their "loss" is adaptively weighted (dit/meanflow.py)


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


def plot_metrics(run_dir: str | Path, out: str | Path | None = None, *,
                 paper: tuple[str, float] | None = None, objective: str | None = None) -> Path:
    """Write the loss curve of a run folder (or a metrics .jsonl file) to `out` (default RUN/loss.png).
    `paper`: (label, FID) drawn as a line on the FID panel (dit-report: the recipe's published number, only when
    the run's number is comparable with it); `objective`: the run's (default: its config.json's)."""
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
    objective = objective or _objective_of(src)
    key = next((fid_key(r) for r in reversed(records) if fid_key(r)), None)
    has_speed = bool(_series(records, "images_per_s")[0])
    has_fid = key is not None
    has_val = any(_series(records, f"val_loss_{w}")[0] for w in ("ema", "raw"))
    shares = sorted({k[len("share_"):] for r in records for k in r if k.startswith("share_")})
    rows = 1 + has_fid + has_speed + has_val + bool(shares)
    fig, axes = plt.subplots(rows, 1, figsize=(8, 4 if rows == 1 else 3 * rows), sharex=True, squeeze=False)
    _loss_panel(axes[0][0], records, src, objective)
    row = 1
    if key is not None:
        _fid_panel(axes[row][0], records, key, paper)
        row += 1
    if has_val:
        _val_panel(axes[row][0], records)
        row += 1
    if shares:
        _mix_panel(axes[row][0], records, shares)
    if has_speed:
        xs, ys = _series(records, "images_per_s")
        axes[-1][0].plot(xs, ys, color="tab:green", linewidth=0.8)
        axes[-1][0].set_ylabel("images/s")
        axes[-1][0].grid(alpha=0.3)
    axes[-1][0].set_xlabel("optimizer step")
    fig.tight_layout()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=120)
    except OSError as e:
        raise UserError(f"cannot write {out} ({e.strerror or e}): {out.parent} is not writable; write the curves "
                        f"elsewhere with dit-report {src} --out DIR") from None
    finally:
        plt.close(fig)
    return out


def _objective_of(src: Path) -> str | None:
    import json

    cfg = (src if src.is_dir() else src.parent) / "config.json"
    try:
        return json.loads(cfg.read_text(encoding="utf-8")).get("objective")
    except (OSError, ValueError, AttributeError):
        return None


def _loss_panel(ax, records: list[dict], src: Path, objective: str | None) -> None:
    lows, highs = [], []
    adaptive = objective in ADAPTIVE_OBJECTIVES
    terms = [k for k in LOSS_TERMS if not (adaptive and k == "mse")]
    for key in terms:  # the loss and the terms the run logged (flow: no vb; --repa: proj)
        xs, ys = _series(records, key)
        if xs:
            label = "loss (adaptively weighted: ~1 by design)" if adaptive and key == "loss" else key
            ax.plot(xs, ys, label=label, linewidth=1.2 if key == "loss" else 0.8)
            lows.append(min(ys))
            highs.append(max(ys))
    if lows and min(lows) > 0 and max(highs) / min(lows) > 10:
        ax.set_yscale("log")
    ax.set_ylabel("training loss (mean over ranks)")
    handles, labels = ax.get_legend_handles_labels()
    xs, ys = _series(records, "mse")
    if adaptive and xs:  # the unweighted error, on its own axis: the weighted loss hides it
        twin = ax.twinx()
        line = twin.plot(xs, ys, color="tab:orange", linewidth=0.9, label="mse (unweighted)")
        twin.set_ylabel("unweighted mse")
        if min(ys) > 0 and max(ys) / min(ys) > 10:
            twin.set_yscale("log")
        handles, labels = handles + line, labels + ["mse (unweighted)"]
    for i, (at, to) in enumerate(_rollbacks(records)):  # where each rollback happened, and where it went back to
        ax.axvline(at, color="tab:purple", linestyle=":", linewidth=1)
        ax.annotate(f"rollback {at} -> {to}", (at, 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                    color="tab:purple", ha="right", va="top", rotation=90)
    ax.grid(alpha=0.3)
    ax.legend(handles, labels, fontsize=8)
    last = [r for r in records if "loss" in r] or records
    loss = last[-1].get("loss")
    shown = f"{loss:.4f}" if isinstance(loss, (int, float)) else str(loss)
    ax.set_title(f"{src.name}: step {last[-1]['step']}, loss {shown}")


def _rollbacks(records: list[dict]) -> list[tuple[int, int]]:
    """(step of the rollback, step returned to) of each rollback: the guard's own list in the newest training
    record (`rollback_steps`); older runs: the first logged step after the count went up, returned to unknown."""
    newest = next((r["rollback_steps"] for r in reversed(records) if isinstance(r.get("rollback_steps"), list)), None)
    if newest is not None:
        return [(int(a), int(b)) for a, b in newest]
    counts = [r for r in records if isinstance(r.get("rollbacks"), int)]
    return [(r["step"], r["step"]) for prev, r in zip(counts, counts[1:]) if r["rollbacks"] > prev["rollbacks"]]


def _fid_panel(ax, records: list[dict], key: str, paper: tuple[str, float] | None) -> None:
    from matplotlib.ticker import FormatStrFormatter

    xs, ys = _series(records, key)
    ax.plot(xs, ys, "o-", color="tab:red", linewidth=1.0, markersize=3)
    last = next(r for r in reversed(records) if key in r)
    n, name = last.get("fid_num_samples"), last.get(f"{key}_name")  # "FID-5K" (evaluate/labels.py)
    run = last.get("fid_run") or {}
    protocol = run.get("protocol")
    label = name or (f"FID ({n} samples)" if n else "FID")
    ax.set_ylabel(label + ("\n(not FID)" if key != "fid" else ""))
    where = f"; protocol {protocol}, {n} samples vs {last.get('fid_ref')}" if protocol else ""
    sampling = (run.get("sampling") or {}).get("name")
    if sampling not in (None, "custom"):
        where += f", sampled by the {sampling} protocol"
    ax.set_title(f"best {label} {min(ys):.4g} at step {xs[ys.index(min(ys))]}{where}", fontsize=8)
    lo, hi = min(ys), max(ys)
    if hi - lo < 1e-3 * max(abs(hi), 1e-12):  # a flat curve: a readable range, not 7 digits of rounding noise
        pad = max(abs(hi) * 0.01, 1e-6)
        ax.set_ylim(lo - pad, hi + pad)
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.4g"))
    if paper is not None and key == "fid":
        ax.axhline(paper[1], color="black", linestyle="--", linewidth=1, label=paper[0])
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _val_panel(ax, records: list[dict]) -> None:
    """The validation loss at fixed timesteps of each weights the run evaluated, with what it was measured on."""
    for w, style in (("ema", "o-"), ("raw", "s--")):
        xs, ys = _series(records, f"val_loss_{w}")
        if xs:
            ax.plot(xs, ys, style, linewidth=1.0, markersize=3, label=f"{w} weights")
    run: dict = next((r["val_run"] for r in reversed(records) if isinstance(r.get("val_run"), dict)), {})
    ax.set_ylabel("validation loss")
    ax.set_title(f"validation loss at {len(run.get('noise_levels') or [])} fixed noise levels, {run.get('samples')} "
                 f"samples of {run.get('set')}", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _mix_panel(ax, records: list[dict], names: list[str]) -> None:
    """Each source's realised share of the samples seen (solid) against its asked share (dashed)."""
    for i, name in enumerate(names):
        color = f"C{i % 10}"
        xs, ys = _series(records, f"share_{name}")
        ax.plot(xs, ys, color=color, linewidth=1.0, label=name)
        xa, ya = _series(records, f"asked_{name}")
        if xa:
            ax.plot(xa, ya, color=color, linewidth=0.8, linestyle="--")
    ax.set_ylabel("share of samples")
    ax.set_title("data mix: realised share of each source (solid) and asked share (dashed)", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
