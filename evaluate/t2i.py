"""The text-to-image evaluators `dit-eval --t2i NAME` runs, one record each: what it needs, the protocol its
number follows, the models it loads (a `dit-eval` setting each, defaulting to the model NanoGen uses) and how
to build it. Adding one is a record here and a scorer with

    check(records)                      # before any model work: a UserError if the prompts cannot be scored
    score(images uint8 [n,H,W,3], records) -> [per-sample dict]   # any batch of samples, in order
    summarize([per-sample dict]) -> {"value": headline number, ...}   # over all samples
    identity                            # JSON: the models and settings used

`run_t2i` below runs every requested scorer over the samples (batches split over the ranks as Inception's
are), gathers the per-sample results on rank 0 and names each number with its sample count
(evaluate/labels.py); the caller never asks which evaluator it is.
"""
from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from dit_pipeline.common import distributed as dist
from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import atomic_write
from dit_pipeline.common.log import progress_enabled
from dit_pipeline.common.prompts import PromptRecord, prompt_record, read_prompts
from dit_pipeline.evaluate import labels
from dit_pipeline.evaluate.clip import DEFAULT_CLIP
from dit_pipeline.evaluate.geneval_detect import DEFAULT_DETECTOR
from dit_pipeline.evaluate.vqa import (DEFAULT_VQASCORE_MODEL, DPG_INSTALL, DPG_PACKAGE, VQASCORE_INSTALL,
                                           VQASCORE_PACKAGE)


@dataclass(frozen=True)
class T2IEvaluator:
    name: str                       # --t2i NAME
    key: str                        # its entry in the .eval.json's "t2i"
    short: str                      # its name in printouts, before the sample count: "CLIPScore-30K"
    protocol: str                   # what the number is, and whose code it follows
    needs: str                      # what the samples must come with
    models: tuple[str, ...]         # the dit-eval settings naming its models (their defaults are NanoGen's)
    package: str | None             # a package outside dit-pipeline's dependencies that it needs, if any
    install: str | None
    build: Callable[[Any, str], Any]  # (EvalConfig, device) -> scorer

    def check(self, records: Sequence[dict[str, Any]]) -> None:
        if self.package is not None:
            from dit_pipeline.evaluate.vqa import require
            require(self.package, self.install or "", self.short)


def _clip_score(cfg: Any, device: str) -> Any:
    from dit_pipeline.evaluate.clip import load_clip
    from dit_pipeline.evaluate.clipscore import ClipScorer

    clip = load_clip(cfg.clip, device)
    scorer = ClipScorer(clip)
    scorer.identity = {"clip": clip.identity}  # type: ignore[attr-defined]
    return scorer


def _geneval(cfg: Any, device: str) -> Any:
    from dit_pipeline.evaluate.geneval_detect import GenevalScorer

    return GenevalScorer(cfg.detector, cfg.clip, device)


def _dpg(cfg: Any, device: str) -> Any:
    from dit_pipeline.evaluate.vqa import DpgScorer

    scorer = DpgScorer(device)
    scorer.identity = {"vqa": "mPLUG-large (dpg_evaluator.MPLUG)"}  # type: ignore[attr-defined]
    return scorer


def _vqascore(cfg: Any, device: str) -> Any:
    from dit_pipeline.evaluate.vqa import VqaScorer

    scorer = VqaScorer(device, cfg.vqa_model)
    scorer.identity = {"vqa": cfg.vqa_model}  # type: ignore[attr-defined]
    return scorer


EVALUATORS: dict[str, T2IEvaluator] = {e.name: e for e in (
    T2IEvaluator("clip-score", "clip_score", "CLIPScore",
                 "NanoGen (End2End-Diffusion/diffusion-bench src/eval/clipscore.py): mean over the samples of the "
                 "cosine of CLIP's image and prompt embeddings (no x100, no clamp)",
                 "a prompt per sample", ("clip",), None, None, _clip_score),
    T2IEvaluator("geneval", "geneval", "GenEval",
                 "GenEval as NanoGen re-implements it (End2End-Diffusion/diffusionbench-evals geneval/): Mask2Former "
                 "detections, CLIP colors; value = fraction of correct images (NanoGen's number), overall = mean of "
                 "the per-task fractions (GenEval's)",
                 "GenEval's prompts with their metadata (tag, include, exclude)", ("detector", "clip"), None, None,
                 _geneval),
    T2IEvaluator("dpg-bench", "dpg_bench", "DPG-Bench",
                 "DPG-Bench as NanoGen runs it (diffusionbench-evals dpgbench/): mPLUG-large answers each prompt's "
                 "questions; mean over the samples of the dependency-adjusted fraction of yes",
                 "DPG-Bench's prompts", (), DPG_PACKAGE, DPG_INSTALL, _dpg),
    T2IEvaluator("vqascore", "vqascore", "VQAScore",
                 "VQAScore as NanoGen runs it on GenAI-Bench (diffusionbench-evals t2v_metrics/): P(Yes) to "
                 "'Does this figure show \"{prompt}\"?', mean over the samples",
                 "a prompt per sample (GenAI-Bench's for its number)", ("vqa_model",), VQASCORE_PACKAGE,
                 VQASCORE_INSTALL, _vqascore),
)}
DEFAULTS = {"clip": DEFAULT_CLIP, "detector": DEFAULT_DETECTOR, "vqa_model": DEFAULT_VQASCORE_MODEL}


# ---- the prompts of the samples -----------------------------------------------------------------------------

def _recorded_prompts(path: Path, kind: str) -> tuple[list[Any] | None, str]:
    """The `prompts` list dit-sample records beside its samples: in the npz record (`NAME.npz.json`) or the npz
    itself (`prompts`), or in a `dit-sample --out` folder's `samples.json`."""
    record = path / "samples.json" if kind == "folder" else Path(str(path) + ".json")
    try:
        data = json.loads(record.read_text())
        if isinstance(data, dict) and isinstance(data.get("prompts"), list):
            return data["prompts"], str(record)
    except (OSError, ValueError):
        pass
    if kind == "npz":
        try:
            with np.load(path, allow_pickle=False) as z:
                if "prompts" in z.files:
                    return [str(p) for p in z["prompts"]], f"{path} (prompts)"
        except (OSError, ValueError):
            pass
    return None, str(record)


def sample_prompts(source: Any, prompts_file: str | None) -> tuple[list[PromptRecord], str]:
    """One prompt record per sample, in the samples' order, and where they came from: `--prompts FILE`, else the
    record dit-sample wrote beside the samples. A UserError when there are none or their count differs."""
    if prompts_file is not None:
        records, origin = read_prompts(prompts_file), f"--prompts {prompts_file}"
    else:
        found, where = _recorded_prompts(source.path, source.kind)
        if found is None:
            raise UserError(f"SAMPLES {source.path}: no prompts recorded with the samples (looked in {where}); pass "
                            "--prompts FILE with one prompt per sample, in the samples' order")
        records = [prompt_record(p, f"{where} prompt {i}") for i, p in enumerate(found)]
        origin = where
    if len(records) != source.count:
        raise UserError(f"SAMPLES {source.path} has {source.count} images but {origin} has {len(records)} prompts; "
                        "they must be aligned, one prompt per sample in the samples' order (write a prompt once per "
                        "image generated from it; a folder's images are in sorted path order)")
    if prompts_file is not None:
        _check_against_record(source, records, origin)
    return records, origin


def _check_against_record(source: Any, records: list[PromptRecord], origin: str) -> None:
    """--prompts FILE against the prompts dit-sample recorded with the samples, where it did (issue 47: `cat f f` in
    place of each prompt repeated has the right count and scored mismatched pairs without a word): the same prompt
    for every sample, or a UserError naming the first index that differs."""
    found, where = _recorded_prompts(source.path, source.kind)
    if found is None:
        return
    recorded = [p.get("prompt") if isinstance(p, dict) else p for p in found]
    for i, (given, made) in enumerate(zip(records, recorded)):
        if not isinstance(made, str) or given["prompt"].strip() != made.strip():
            raise UserError(f"{origin}: sample {i} was generated from {made!r} ({where}), but the file gives "
                            f"{given['prompt']!r}; give the prompts in the samples' order (each prompt once per "
                            "sample made from it), or drop --prompts to score with the recorded ones")


def prepare_records(names: Sequence[str], records: list[PromptRecord], origin: str,
                    geneval_metadata: str | None) -> list[PromptRecord]:
    """The records every requested evaluator can score (GenEval's metadata attached), checked before any work."""
    if "geneval" in names:
        from dit_pipeline.evaluate.geneval import attach_metadata

        meta = read_prompts(geneval_metadata, "--geneval-metadata") if geneval_metadata else None
        records = attach_metadata(records, meta, origin)
    for name in names:
        EVALUATORS[name].check(records)
    return records


# ---- running ------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _hf_bars(enabled: bool) -> Iterator[None]:
    """transformers' and the hub's progress bars (weight loading, downloads) only where ours are shown."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def _build(spec: T2IEvaluator, cfg: Any, device: str) -> Any:
    """Rank 0 builds (and if needed downloads) first, so a missing model is one error on every rank."""
    def build() -> Any:
        with _hf_bars(progress_enabled(cfg.quiet)):
            return spec.build(cfg, device)
    first: list[Any] = []
    dist.on_rank0(lambda: first.append(build()))
    return first[0] if first else build()


def _score_all(scorer: Any, source: Any, records: list[PromptRecord], batch_size: int, what: str,
               quiet: bool) -> list[dict[str, Any]] | None:
    """Every sample's result on rank 0 (None elsewhere): batch k of the samples on rank k % world_size."""
    from tqdm.auto import tqdm

    from dit_pipeline.sample.plan import rank_batches

    mine: list[tuple[int, dict[str, Any]]] = []
    ws = dist.world_size()
    with tqdm(total=source.count, unit="img", desc=what, dynamic_ncols=True,
              disable=not progress_enabled(quiet)) as bar, source.reader() as reader:
        for b in rank_batches(range(source.count), batch_size, dist.rank(), ws):
            mine.extend(zip(b, scorer.score(reader.read(b[0], b[-1] + 1), [records[i] for i in b])))
            bar.update(min(len(b) * ws, bar.total - bar.n))
    with dist.peer_guard(f"gathering the {what} results"):
        everyone = dist.all_gather_object(mine)
    if not dist.is_main():
        return None
    merged = sorted((pair for part in everyone for pair in part), key=lambda p: p[0])
    assert [i for i, _ in merged] == list(range(source.count)), "every sample scored exactly once"
    return [r for _, r in merged]


def run_t2i(cfg: Any, source: Any, records: list[PromptRecord], device: str,
            log: logging.Logger) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """Every evaluator of `cfg.t2i` over the samples: on rank 0 ({key: named result}, per-sample rows), else None."""
    results: dict[str, Any] = {}
    rows: list[dict[str, Any]] = [{"index": i, "prompt": r["prompt"]} for i, r in enumerate(records)]
    for name in cfg.t2i:
        spec = EVALUATORS[name]
        scorer = _build(spec, cfg, device)
        per_sample = _score_all(scorer, source, records, cfg.batch_size, spec.short, cfg.quiet)
        if per_sample is not None:
            n = len(per_sample)
            results[spec.key] = {"name": labels.t2i_metric_name(spec.short, n), "count": n,
                                 **scorer.summarize(per_sample), "protocol": spec.protocol,
                                 "models": getattr(scorer, "identity", None)}
            for row, s in zip(rows, per_sample):
                row[spec.key] = s
            log.info("%s: %s", results[spec.key]["name"], results[spec.key]["value"])
        del scorer
    return (results, rows) if dist.is_main() else None


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """The per-sample results, one JSON object per line (index, prompt, each evaluator's result)."""
    with atomic_write(path) as f:
        for r in rows:
            f.write((json.dumps(r, default=_plain) + "\n").encode())


def _plain(x: Any) -> Any:
    return x.tolist() if isinstance(x, np.ndarray) else float(x) if isinstance(x, np.floating) else str(x)


def format_t2i(results: dict[str, Any]) -> list[str]:
    """One printed line per evaluator: its name with the sample count, its number, and its other numbers."""
    lines = []
    for key, r in results.items():
        extra = ""
        if key == "clip_score":
            extra = f" (mean cosine; 100 x max(cos, 0): {r['x100_clamped']:.4f})"
        elif key == "geneval":
            tasks = ", ".join(f"{t} {v:.4f}" for t, v in r["tasks"].items())
            extra = f" (correct images, NanoGen's number); overall {r['overall']:.6f} (mean of tasks: {tasks})"
        elif key == "dpg_bench":
            extra = " (" + ", ".join(f"{k} {v:.4f}" for k, v in r["level1"].items()) + ")"
        lines.append(f"{r['name']}: {r['value']:.6f}{extra}{_by(r.get('models'))}")
    return lines


def _by(models: dict[str, Any] | None) -> str:
    """", with clip NAME (weights sha256 ...)": the models a number came from (issue 47: the console never named
    the CLIP model)."""
    from dit_pipeline.evaluate.clip import describe_model

    if not models:
        return ""
    return ", with " + ", ".join(f"{k} {describe_model(v) if isinstance(v, dict) else v}" for k, v in models.items())
