"""`dit-report RUN`: one Markdown page and one PNG for a run folder (`RUN/report.md`, `RUN/report.png`).

The page reads only what the run wrote: `config.json` (the settings; `recipe` = {name, paper, fid, ...} when the
run follows a published recipe), `metrics.jsonl` (loss, throughput, the divergence guard's counters, FID during
training with its sample count and reference) and `config-history.jsonl` (each start of the run). It shows the
config, the loss and FID-vs-step curves (train/plot.py, with the paper's FID as a line when the recipe has one),
the last evaluation with its sample count, reference and sampler settings, the throughput and device-hours
(the logged intervals' durations x the world size: time in checkpoints, hooks and start-up is not counted), what
the divergence guard did, and the paper's number beside ours. An FID of fewer than 50,000 samples is named
with its count ("FID-5K", evaluate/labels.py) and called a proxy, so it is not read as the paper metric.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import atomic_write_bytes
from dit_pipeline.train.metrics import read_metrics
from dit_pipeline.train.plot import plot_metrics

KEY_SETTINGS = ("model", "objective", "global_batch_size", "lr", "warmup_steps", "grad_clip", "ema_decay",
                "max_steps", "epochs", "precision", "class_dropout_prob", "repa", "on_divergence", "seed", "shards")


def _num(v: Any, fmt: str = ".4g") -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else "n/a"


def throughput(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Training seconds (the logged intervals: steps / steps_per_s), device-hours (x world size), mean images/s."""
    seconds = device_s = images = 0.0
    prev = 0
    last = None
    for r in records:
        if not isinstance(r.get("steps_per_s"), (int, float)) or r["steps_per_s"] <= 0:
            continue
        steps = max(0, int(r["step"]) - prev)
        prev = int(r["step"])
        dt = steps / r["steps_per_s"]
        seconds += dt
        device_s += dt * int(r.get("world_size") or 1)
        images += dt * float(r.get("images_per_s") or 0.0)
        last = r
    gpu = last is not None and last.get("peak_mem_gb") is not None
    return {"seconds": seconds, "device_hours": device_s / 3600, "device": "GPU" if gpu else "CPU",
            "images_per_s": images / seconds if seconds else None, "world_size": (last or {}).get("world_size"),
            "last_images_per_s": (last or {}).get("images_per_s"), "mfu": (last or {}).get("mfu")}


def _evaluation(cfg: dict[str, Any], ev: dict[str, Any] | None) -> list[str]:
    if ev is None:
        return ["No evaluation was logged (`--fid-every N --fid-ref REF` evaluates during training; `dit-eval` "
                "evaluates a sample file)."]
    from dit_pipeline.sample.config import FID_SAMPLER

    n = ev.get("fid_num_samples")
    names = {k: ev.get(f"{k}_name", k) for k in ("fid", "sfid", "fd_dinov2")}
    rows = [f"| {names[k]} | {_num(ev.get(k))} |" for k in ("fid", "sfid", "fd_dinov2") if ev.get(k) is not None]
    rows += [f"| {label} | {_num(ev.get(k))} |" for k, label in (("inception_score", "Inception Score"),
                                                                 ("precision", "Precision"), ("recall", "Recall"))]
    sampler = ev.get("fid_sampler") or FID_SAMPLER.get(cfg.get("objective", "ddpm"), "?")
    if ev.get("fid_protocol"):
        sampler = f"{sampler} (--protocol {ev['fid_protocol']})"
    steps = ev.get("fid_steps", cfg.get("fid_steps"))
    scale = ev.get("fid_cfg_scale", cfg.get("fid_cfg_scale"))
    return [f"Step {ev['step']}: {n} samples against `{ev.get('fid_ref') or cfg.get('fid_ref')}`, sampled with the "
            f"EMA weights by {sampler} in {steps} steps, guidance {scale}, classes "
            f"{ev.get('fid_labels', cfg.get('fid_labels'))}, seed {cfg.get('seed')}; the evaluation took "
            f"{_num(ev.get('fid_seconds'), '.1f')} s.", "", "| metric | value |", "|---|---|", *rows]


def build_report(run_dir: Path, png: str) -> str:
    """The Markdown page of a run folder (see the module docstring)."""
    cfg_path = run_dir / "config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    records = [r for r in read_metrics(run_dir) if isinstance(r.get("step"), int)]
    train = [r for r in records if "loss" in r or "steps_per_s" in r]
    evals = [r for r in records if r.get("fid") is not None]
    ev = evals[-1] if evals else None
    last = train[-1] if train else {}
    t = throughput(train)
    recipe: dict[str, Any] | None = cfg["recipe"] if isinstance(cfg.get("recipe"), dict) else None
    ours = f"{ev.get('fid_name', 'FID')} {_num(ev['fid'])} at step {ev['step']}" if ev is not None else "not evaluated"
    proxy = ev is not None and ev.get("fid_num_samples") != 50_000
    of = f" of {cfg['max_steps']}" if cfg.get("max_steps") else ""
    lines = [f"# Run report: {run_dir.name}", "",
             f"`{run_dir}`, step {last.get('step', 0)}{of}, epoch {last.get('epoch', 0)}, last loss "
             f"{_num(last.get('loss'))}.", "",
             "## Result against the paper", "", "| | FID | samples |", "|---|---|---|",
             f"| this run | {ours} | {ev.get('fid_num_samples') if ev is not None else 'n/a'} |"]
    if recipe is not None:
        lines.append(f"| {recipe.get('paper', 'paper')} ({recipe.get('name', 'recipe')}) | FID-50K "
                     f"{_num(recipe.get('fid'))} | 50000 |")
    if proxy and ev is not None:
        lines += ["", f"This run's number is a proxy ({ev.get('fid_name')}): the paper metric is FID-50K (50,000 "
                  "samples); run `dit-sample --num-samples 50000` and `dit-eval` for it."]
    lines += ["", "## Curves", "", f"![loss, FID and throughput against the step]({png})", "",
              "## Last evaluation", "", *_evaluation(cfg, ev), "",
              "## Throughput", "", "| | |", "|---|---|",
              f"| images/s (mean over the logged intervals; the last) | {_num(t['images_per_s'], '.1f')}; "
              f"{_num(t['last_images_per_s'], '.1f')} |",
              f"| devices | {t['world_size'] or 'n/a'} x {t['device']} |",
              f"| training time (logged intervals) | {t['seconds'] / 3600:.3g} h |",
              f"| {t['device']}-hours | {t['device_hours']:.3g} |"]
    if t["mfu"] is not None:
        lines.append(f"| MFU (last interval) | {t['mfu']:.1%} |")
    lines += ["", "## Divergence guard", "",
              f"Policy `{cfg.get('on_divergence', 'stop')}`: {last.get('skipped_steps', 0)} step(s) skipped, "
              f"{last.get('rollbacks', 0)} rollback(s) (RUN/log.txt names each).", "",
              "## Config", "", "| setting | value |", "|---|---|",
              *[f"| {k} | `{cfg[k]}` |" for k in KEY_SETTINGS if cfg.get(k) not in (None, False)],
              "", "<details><summary>config.json</summary>", "", "```json",
              json.dumps(cfg, indent=1, sort_keys=True), "```", "</details>", ""]
    return "\n".join(lines)


def write_report(run_dir: str | Path, out: str | Path | None = None) -> tuple[Path, Path]:
    """Write RUN/report.md and RUN/report.png (or into `out`); returns both paths."""
    run = Path(run_dir).expanduser()
    if not (run / "metrics.jsonl").is_file():
        raise UserError(f"{run} has no metrics.jsonl: pass a run folder written by dit-train")
    folder = Path(out).expanduser() if out is not None else run
    folder.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((run / "config.json").read_text(encoding="utf-8")) if (run / "config.json").is_file() else {}
    recipe: dict[str, Any] = cfg["recipe"] if isinstance(cfg.get("recipe"), dict) else {}
    paper = (f"{recipe.get('paper', 'paper')}: FID-50K {recipe['fid']}", float(recipe["fid"])) \
        if isinstance(recipe.get("fid"), (int, float)) else None
    png = plot_metrics(run, folder / "report.png", paper=paper)
    md = folder / "report.md"
    atomic_write_bytes(md, build_report(run, png.name if folder == run else str(png)).encode("utf-8"))
    return md, png
