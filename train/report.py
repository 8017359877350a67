"""`dit-report RUN`: one Markdown page and one PNG for a run folder (`RUN/report.md`, `RUN/report.png`).

The page reads only what the run wrote: `config.json` (the settings; `recipe` = {name, paper, fid, departures,
...} when the run follows a published recipe), `metrics.jsonl` (loss, throughput, the divergence guard's counters,
FID during training with what the hook ran: `fid_run`, evaluate/hook.py) and `config-history.jsonl` (each start of
the run). It shows the config (the model as built: its preset and every override), the loss and FID-vs-step curves
(train/plot.py), the last evaluation described from the hook's own record (protocol, network, reference, sample
count, sampler, steps, the guidance applied; never from config.json, which says what was asked), the throughput
and device-hours (the logged intervals' durations x the world size: time in checkpoints, hooks and start-up is not
counted), what the divergence guard did, a data mix's sources with the samples each gave against its asked share
(`seen_<source>`, `share_<source>`, `asked_<source>`: train/mixdata.py), the last validation loss at fixed timesteps
per noise level with what produced it (`val_run`: train/validation.py), and the paper's number beside ours only
when the two can be compared: the
number is FID (not a random Inception's distance) and the run departs from its recipe in nothing (train/recipes.py).
An FID of fewer than 50,000 samples is named with its count ("FID-5K", evaluate/labels.py) and called a proxy, so
it is not read as the paper metric.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import atomic_write_bytes, check_writable_dir
from dit_pipeline.evaluate import labels as L
from dit_pipeline.train.model_options import ARCH_OVERRIDES, MODEL_OPTIONS
from dit_pipeline.train.metrics import read_metrics
from dit_pipeline.train.plot import plot_metrics

KEY_SETTINGS = ("model", "objective", "global_batch_size", "lr", "warmup_steps", "grad_clip", "ema_decay",
                "max_steps", "epochs", "precision", "class_dropout_prob", "repa", "on_divergence", "seed", "shards",
                "mix", "val_shards")


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
    key = L.fid_key(ev) or "fid"
    names = {k: ev.get(f"{k}_name", k) for k in (key, L.record_key("sfid", 0) if key != "fid" else "sfid",
                                                   "fd_dinov2")}
    rows = [f"| {names[k]} | {_num(ev.get(k))} |" for k in names if ev.get(k) is not None]
    score = ("inception_score", "precision", "recall") if key == "fid" else ("is_rand", "precision_rand",
                                                                            "recall_rand")
    rows += [f"| {L.SCORE_LABELS[k]} | {_num(ev.get(k))} |" for k in score]  # a random Inception's: IS-rand ...
    run = ev.get("fid_run")
    if not isinstance(run, dict):
        head = (f"Step {ev['step']}: {ev.get('fid_num_samples')} samples against `{ev.get('fid_ref')}`. This run "
                "predates the hook's record of what it ran (sampler, steps, guidance, network): those are unknown "
                "here; config.json says only what was asked.")
        return [head, "", "| metric | value |", "|---|---|", *rows]
    ref, model = run.get("reference") or {}, run.get("model") or {}
    sampling = run.get("sampling") or {}  # the sampling protocol's record (dit/protocols.py), resolved
    note = f" ({run['guidance_note']})" if run.get("guidance_note") else ""
    made = "" if ref.get("provenance") in (None, "images") else f"; {ref.get('provenance')}"
    prompts = run.get("prompts")  # a text run's samples drew prompts (evaluate/hook.py), not classes
    drawn = f"classes {sampling.get('labels')}" if not isinstance(prompts, dict) else \
        (f"the {prompts.get('count')} prompts of `{Path(str(prompts.get('file'))).name}` encoded by "
         f"{(prompts.get('text_encoder') or {}).get('name')}")
    lines = [f"Step {ev['step']}, protocol {run.get('protocol')} ({run.get('protocol_source')}): "
             f"{run.get('num_samples')} samples against `{ref.get('file')}` ({ref.get('statistics')}{made}), sampled "
             f"with the {run.get('weights')} weights of the model {model.get('name')} as built "
             f"({model.get('architecture')}) by {L.sampled_by(sampling)}, guidance {run.get('guidance')}{note}, "
             f"{drawn}, images by the '{sampling.get('conversion')}' conversion, seed "
             f"{run.get('seed')}; the evaluation took {_num(ev.get('fid_seconds'), '.1f')} s.", "",
             f"Inception network: {run.get('network')}."]
    if key != "fid":
        lines += ["", f"These numbers are not FID: {L.random_note(int(run.get('random_inception') or 0))}."]
    return [*lines, "", "| metric | value |", "|---|---|", *rows]


def mix_section(cfg: dict[str, Any], last: dict[str, Any]) -> list[str]:
    """The data mix: each source's shards and weight, samples seen, realised and asked share (none without a mix)."""
    mix = cfg.get("data_mix")
    if not isinstance(mix, dict):
        return []
    rows = []
    for src in mix.get("sources") or []:
        name = src.get("name")
        weight = next((f"{k} {src[k]:g}" for k in ("proportion", "repeat", "choose") if src.get(k) is not None),
                      "every sample once")
        extra = "".join(f", {k} {src[k]}" for k in ("text", "caption", "template", "holdout") if src.get(k) is not None)
        rows.append(f"| {name} | `{src.get('shards')}` | {weight}{extra} | {_num(last.get(f'seen_{name}'), ',')} | "
                    f"{_num(last.get(f'share_{name}'), '.1%')} | {_num(last.get(f'asked_{name}'), '.1%')} |")
    return ["## Data mix", "", f"{len(rows)} sources read by {mix.get('lanes')} lane(s) (one global sample sequence "
            "at any world size); shares are of the samples seen up to the last logged step.", "",
            "| source | shards | weight | samples seen | realised share | asked share |", "|---|---|---|---|---|---|",
            *rows, ""]


def val_section(records: list[dict[str, Any]]) -> list[str]:
    """The last validation loss at fixed timesteps (none without --val-shards): per weights the mean and each noise
    level's, with what produced it."""
    vals = [r for r in records if isinstance(r.get("val_run"), dict)]
    if not vals:
        return []
    last, run = vals[-1], vals[-1]["val_run"]
    first = vals[0]
    weights = [w for w in run.get("weights") or [] if f"val_loss_{w}" in last]
    levels = run.get("noise_levels") or []
    head = "| noise level (objective time) | " + " | ".join(weights) + " |"
    rows = [f"| {lv:g} ({t}) | " + " | ".join(_num(last[f"val_loss_{w}_t"][i]) for w in weights) + " |"
            for i, (lv, t) in enumerate(zip(levels, run.get("times") or []))]
    means = ", ".join(f"{w} {_num(last[f'val_loss_{w}'])} (step {first['step']}: {_num(first.get(f'val_loss_{w}'))})"
                      for w in weights)
    return ["## Validation loss", "",
            f"Step {last['step']}: {means}. {run.get('samples')} samples of {run.get('set')}, the objective's "
            f"unweighted loss ({run.get('objective')}) at {len(levels)} fixed noise levels with fixed noise and no "
            f"condition dropout ({run.get('rule')}); comparable across runs whose training time samplers differ.",
            "", head, "|---|" + "---|" * len(weights), *rows, ""]


def model_as_built(cfg: dict[str, Any]) -> str:
    """The model row: the preset with every override the run gave it ("SiT-XL/2 with depth 2, hidden_size 384")."""
    given = [f"{k} {cfg[k]}" for k in ARCH_OVERRIDES if cfg.get(k) is not None]
    given += [k for k in MODEL_OPTIONS if cfg.get(k) is True]
    return f"`{cfg.get('model')}`" + (f" with {', '.join(given)}" if given else "")


def comparable(ev: dict[str, Any] | None, recipe: dict[str, Any] | None) -> tuple[bool, str]:
    """(whether the paper's number goes beside this run's, why not)."""
    if recipe is None or recipe.get("fid") is None:
        return False, ""
    if recipe.get("departures"):
        return False, (f"the run departs from the recipe in {len(recipe['departures'])} way(s) (below), so the "
                       f"paper's FID-50K {_num(recipe.get('fid'))} is not a number to compare it with")
    if ev is not None and L.fid_key(ev) not in (None, "fid"):
        return False, (f"this run's number is not FID (random Inception weights), so the paper's FID-50K "
                       f"{_num(recipe.get('fid'))} is not shown beside it")
    return True, ""


def build_report(run_dir: Path, png: str) -> str:
    """The Markdown page of a run folder (see the module docstring)."""
    cfg_path = run_dir / "config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    records = [r for r in read_metrics(run_dir) if isinstance(r.get("step"), int)]
    train = [r for r in records if "loss" in r or "steps_per_s" in r]
    evals = [r for r in records if L.fid_key(r) is not None]
    ev = evals[-1] if evals else None
    last = train[-1] if train else {}
    t = throughput(train)
    recipe: dict[str, Any] | None = cfg["recipe"] if isinstance(cfg.get("recipe"), dict) else None
    key = L.fid_key(ev) if ev is not None else None
    ours = f"{ev.get(f'{key}_name', key)} {_num(ev[key])} at step {ev['step']}" \
        if ev is not None and key is not None else "not evaluated"
    if key not in (None, "fid"):
        ours += " (random Inception: not FID)"
    proxy = ev is not None and key == "fid" and ev.get("fid_num_samples") != 50_000
    of = f" of {cfg['max_steps']}" if cfg.get("max_steps") else ""
    beside, why_not = comparable(ev, recipe)
    lines = [f"# Run report: {run_dir.name}", "",
             f"`{run_dir}`, step {last.get('step', 0)}{of}, epoch {last.get('epoch', 0)}, last loss "
             f"{_num(last.get('loss'))}.", "",
             "## Result against the paper", "", "| | number | samples |", "|---|---|---|",
             f"| this run | {ours} | {ev.get('fid_num_samples') if ev is not None else 'n/a'} |"]
    if beside and recipe is not None:
        lines.append(f"| {recipe.get('paper', 'paper')} ({recipe.get('name', 'recipe')}) | FID-50K "
                     f"{_num(recipe.get('fid'))} | 50000 |")
    if why_not:
        lines += ["", f"Not compared with the paper: {why_not}."]
    if proxy and ev is not None:
        lines += ["", f"This run's number is a proxy ({ev.get('fid_name')}): the paper metric is FID-50K (50,000 "
                  "samples); run `dit-sample --num-samples 50000` and `dit-eval` for it."]
    if recipe is not None and recipe.get("departures"):
        lines += ["", "Departures from the recipe:", "", *[f"- {d}" for d in recipe["departures"]]]
    lines += ["", "## Curves", "", f"![loss, FID and throughput against the step]({png})", "",
              *val_section(records), *mix_section(cfg, last),
              "## Last evaluation", "", *_evaluation(cfg, ev), "",
              "## Throughput", "", "| | |", "|---|---|",
              f"| images/s (mean over the logged intervals; the last) | {_num(t['images_per_s'], '.1f')}; "
              f"{_num(t['last_images_per_s'], '.1f')} |",
              f"| devices | {t['world_size'] or 'n/a'} x {t['device']} |",
              f"| training time (logged intervals) | {t['seconds'] / 3600:.3g} h |",
              f"| {t['device']}-hours | {t['device_hours']:.3g} |"]
    if t["mfu"] is not None:
        lines.append(f"| MFU (last interval) | {t['mfu']:.1%} |")
    settings = [f"| model | {model_as_built(cfg)} |"] if cfg.get("model") else []
    settings += [f"| {k} | `{cfg[k]}` |" for k in KEY_SETTINGS if k != "model" and cfg.get(k) not in (None, False)]
    lines += ["", "## Divergence guard", "",
              f"Policy `{cfg.get('on_divergence', 'stop')}`: {last.get('skipped_steps', 0)} step(s) skipped, "
              f"{last.get('rollbacks', 0)} rollback(s) (RUN/log.txt names each).", "",
              "## Config", "", "| setting | value |", "|---|---|", *settings,
              "", "<details><summary>config.json</summary>", "", "```json",
              json.dumps(cfg, indent=1, sort_keys=True), "```", "</details>", ""]
    return "\n".join(lines)


def write_report(run_dir: str | Path, out: str | Path | None = None) -> tuple[Path, Path]:
    """Write RUN/report.md and RUN/report.png (or into `out`); returns both paths. A folder that cannot be
    written is one line naming --out, before any work."""
    run = Path(run_dir).expanduser()
    if not (run / "metrics.jsonl").is_file():
        raise UserError(f"{run} has no metrics.jsonl: pass a run folder written by dit-train")
    folder = Path(out).expanduser() if out is not None else run
    try:
        check_writable_dir(folder, "the report" if out is None else f"--out {out}")
    except UserError as e:
        raise UserError(f"{e}{', or --out DIR for the report' if out is None else ''}") from None
    folder.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((run / "config.json").read_text(encoding="utf-8")) if (run / "config.json").is_file() else {}
    recipe: dict[str, Any] | None = cfg["recipe"] if isinstance(cfg.get("recipe"), dict) else None
    records = [r for r in read_metrics(run) if isinstance(r.get("step"), int) and L.fid_key(r)]
    beside, _ = comparable(records[-1] if records else None, recipe)
    paper = (f"{recipe.get('paper', 'paper')}: FID-50K {recipe['fid']}", float(recipe["fid"])) \
        if beside and recipe is not None and isinstance(recipe.get("fid"), (int, float)) else None
    png = plot_metrics(run, folder / "report.png", paper=paper, objective=cfg.get("objective"))
    md = folder / "report.md"
    try:
        atomic_write_bytes(md, build_report(run, png.name if folder == run else str(png)).encode("utf-8"))
    except OSError as e:
        raise UserError(f"cannot write {md} ({e.strerror or e}); pass --out DIR, a writable folder") from None
    return md, png
