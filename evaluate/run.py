"""`dit-eval`: FID, sFID, Inception Score, precision and recall of SAMPLES against REF, as the ADM evaluator
reports them (evaluate/metrics.py), on one process or under torchrun.

Flow: every rank loads the Inception network; rank 0 inspects both inputs and checks that they can be compared;
features of each side come from its cache or are extracted by all ranks (evaluate/features.py); rank 0
computes the metrics, prints them and writes them as JSON (default: beside SAMPLES, `SAMPLES.eval.json`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dit_pipeline.common import distributed as dist
from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import atomic_write_json, check_writable_dir
from dit_pipeline.common.log import setup_logging
from dit_pipeline.evaluate import dinov2, labels, t2i
from dit_pipeline.evaluate import metrics as M
from dit_pipeline.evaluate.features import source_features
from dit_pipeline.evaluate.config import EvalConfig
from dit_pipeline.evaluate.inception import load_inception
from dit_pipeline.evaluate.inputs import Source, check_comparable, open_source

RESULT_FORMAT = "dit-pipeline.eval"
METRIC_NAMES = ("inception_score", "fid", "sfid", "precision", "recall", "fd_dinov2")


@dataclass
class Side:
    """What one input contributes: features (None for a statistics file) and precomputed statistics."""

    source: Source
    features: dict[str, np.ndarray] | None

    def stats(self, key: str) -> M.Statistics | None:
        if key in self.source.stats:
            return self.source.stats[key]
        return M.statistics(self.features[key]) if self.features is not None else None


def _fid(samples: Side, ref: Side, key: str) -> float | None:
    if key not in samples.source.stats and key not in ref.source.stats and samples.features is not None \
            and ref.features is not None:
        return M.frechet_distance_of_features(samples.features[key], ref.features[key])
    if key not in samples.source.stats and samples.features is not None and key in ref.source.stats:
        return M.frechet_distance_to_statistics(samples.features[key], ref.source.stats[key])
    pair = samples.stats(key), ref.stats(key)
    return None if None in pair else M.frechet_distance(*pair)


def compute_metrics(samples: Side, ref: Side, device: torch.device | str = "cpu") -> dict[str, float | None]:
    """The five numbers (None where an input lacks what a metric needs, e.g. a statistics-only REF)."""
    out: dict[str, float | None] = dict.fromkeys(METRIC_NAMES)
    if samples.features is not None:
        out["inception_score"] = M.inception_score(samples.features["logits"])
    out["fid"] = _fid(samples, ref, "pool")
    out["sfid"] = _fid(samples, ref, "spatial")
    if samples.features is not None and ref.features is not None:
        out["precision"], out["recall"] = M.precision_recall(ref.features["pool"], samples.features["pool"],
                                                             device=device)
    return out


def run_eval(cfg: EvalConfig) -> dict[str, Any]:
    """Evaluate (see the module docstring); the result dict (on every rank)."""
    cfg.validate()
    dist.init()
    with dist.leaving_group():
        return _run(cfg)


def _run(cfg: EvalConfig) -> dict[str, Any]:
    log = setup_logging(None, quiet=cfg.quiet)
    start = time.perf_counter()
    device = torch.device(cfg.device) if cfg.device else dist.device()

    def inspect() -> tuple[Source, Source | None, list[dict[str, Any]] | None, str | None]:
        samples = open_source(cfg.samples, "SAMPLES")
        ref = open_source(cfg.ref, "REF") if cfg.ref is not None else None
        if ref is not None:
            check_comparable(samples, ref)
        records, origin = None, None
        if cfg.t2i:  # the prompts and every evaluator's needs, before any model is loaded
            if samples.kind not in ("npz", "folder"):
                raise UserError(f"SAMPLES {samples.path} is a {samples.kind} file; the text-to-image evaluators need "
                                "the images (.npz or folder)")
            records, origin = t2i.sample_prompts(samples, cfg.prompts)
            records = t2i.prepare_records(cfg.t2i, records, origin, cfg.geneval_metadata)
        check_result_path(cfg.json_path)  # before any feature work: the result must have somewhere to go
        return samples, ref, records, origin

    samples, ref, records, origin = dist.on_rank0(inspect)
    sides: list[Side] = []
    ident: dict[str, Any] = {}
    dino = None
    if ref is not None:
        model, ident = _load_model(cfg, device)
        log.info("samples: %s\nreference: %s\nInception: %s (%s)", samples.describe(), ref.describe(),
                 ident["extractor"], ident["weights"])
        for src in (samples, ref):
            feats = None
            if src.kind != "statistics":
                feats = source_features(src, model, ident, batch_size=cfg.batch_size, device=device,
                                        use_cache=cfg.cache, quiet=cfg.quiet, log=log)
            sides.append(Side(src, feats))
        del model
        dino = _dinov2_features(cfg, samples, ref, device, log) if cfg.fd_dinov2 else None
    scored = t2i.run_t2i(cfg, samples, records, str(device), log) if records is not None else None

    def finish() -> dict[str, Any]:
        result: dict[str, Any] = {"format": RESULT_FORMAT, "version": 1}
        described = {"path": str(samples.path), "kind": samples.kind, "count": samples.count,
                     "label_sampling": samples.label_sampling, "class_counts": samples.class_counts}
        if ref is not None:
            try:
                numbers = compute_metrics(sides[0], sides[1], device=device)
            except ValueError as e:
                raise UserError(f"cannot compute the metrics of {samples.path} against {ref.path}: {e}") from None
            if dino is not None:
                numbers["fd_dinov2"] = fd_dinov2(*dino[:2])
            result.update({**numbers, **sample_labels(samples.count, ref.path),
                           "reference_statistics": "precomputed" if "pool" in ref.stats else "computed from its images",
                           "samples": described, "ref": {"path": str(ref.path), "kind": ref.kind, "count": ref.count},
                           "extractor": ident, **({"dinov2_extractor": dino[2]} if dino else {})})
        else:
            result["samples"] = described
        if scored is not None:
            result.update({"t2i": scored[0], "prompts": origin, "t2i_samples": str(cfg.rows_path)})
        result.update({"seconds": round(time.perf_counter() - start, 3), "config": cfg.to_dict()})
        try:
            if scored is not None:
                t2i.write_rows(cfg.rows_path, scored[1])
            atomic_write_json(cfg.json_path, result)
        except OSError as e:
            print(format_result(result), flush=True)  # the numbers are not lost with the file
            raise UserError(f"cannot write {cfg.json_path} ({e.strerror or e}); the metrics are printed above; "
                            "pass --json elsewhere") from None
        return result

    return dist.on_rank0(finish)


def check_result_path(path: Path) -> None:
    """UserError (one line) unless the JSON result can be written at `path`: checked before any feature work, so
    read-only samples never cost an evaluation whose result has nowhere to go."""
    if path.is_dir():
        raise UserError(f"the result file {path} is a folder; pass --json FILE")
    try:
        check_writable_dir(path.parent, f"the result file {path}")
    except UserError as e:
        raise UserError(f"{e}, or --json elsewhere") from None


def sample_labels(count: int, ref: Path) -> dict[str, Any]:
    """The names of the distances for this sample count (evaluate/labels.py) and the reference they are against."""
    names = labels.metric_names(count)
    return {"fid_name": names["fid"], "metric_names": names, "proxy": count != labels.PAPER_SAMPLES,
            "reference_file": ref.name}


def fd_dinov2(samples: np.ndarray | None, ref: np.ndarray | None) -> float | None:
    """FD_DINOv2: the Frechet distance of the DINOv2 features, as FID's (None when an input has no images)."""
    return None if samples is None or ref is None else M.frechet_distance_of_features(samples, ref)


def _dinov2_features(cfg: EvalConfig, samples: Source, ref: Source, device: torch.device,
                     log: Any) -> tuple[np.ndarray | None, np.ndarray | None, dict[str, Any]]:
    """Both sides' DINOv2 features (rank 0; evaluate/dinov2.py) and the extractor's identity."""
    first: list[Any] = []
    dist.on_rank0(lambda: first.append(dinov2.load_dinov2(cfg.dinov2, resize=cfg.dinov2_resize, device=device)))
    net, ident = first[0] if first else dinov2.load_dinov2(cfg.dinov2, resize=cfg.dinov2_resize, device=device)
    feats = [dinov2.source_features(src, net, ident, batch_size=cfg.batch_size, use_cache=cfg.cache, log=log)
             for src in (samples, ref)]
    return feats[0], feats[1], ident


def _load_model(cfg: EvalConfig, device: torch.device) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Rank 0 loads (and if needed fetches) the weights first, so a missing file is one error on every rank."""
    kwargs = dict(random_seed=cfg.random_inception, input_size=cfg.input_size)
    first: list[Any] = []
    dist.on_rank0(lambda: first.append(load_inception(cfg.inception, device=device, **kwargs)))
    return first[0] if first else load_inception(cfg.inception, device=device, **kwargs)


def format_result(result: dict[str, Any]) -> str:
    """The ADM evaluator's printout, one metric per line (n/a where an input lacked what it needs), when there
    was a reference; FD_DINOv2 after them when it was computed; then one line per text-to-image evaluator."""
    shown = {"inception_score": "Inception Score", "fid": "FID", "sfid": "sFID", "precision": "Precision",
             "recall": "Recall", "fd_dinov2": "FD_DINOv2"}
    lines = [f"{shown[k]}: {'n/a' if result.get(k) is None else shown_value(k, result[k])}"
             for k in METRIC_NAMES if "fid" in result and (k != "fd_dinov2" or result.get(k) is not None)]
    return "\n".join(lines + t2i.format_t2i(result.get("t2i") or {}))


DISTANCE_DECIMALS = 6  # printed FID, sFID, FD_DINOv2: papers give 2 decimals; the JSON keeps every digit


def shown_value(key: str, value: float) -> str:
    """A metric as printed: a distance rounded to DISTANCE_DECIMALS (and never -0.0), the others as computed."""
    if key in ("fid", "sfid", "fd_dinov2"):
        return repr(round(float(value), DISTANCE_DECIMALS) + 0.0)
    return repr(float(value))


def format_names(result: dict[str, Any]) -> str:
    """The line naming the numbers with their sample count and reference (evaluate/labels.py)."""
    names = [v for k, v in result.get("metric_names", {}).items() if result.get(k) is not None]
    names += [r["name"] for r in (result.get("t2i") or {}).values()]
    proxy = f"; a proxy: papers report {labels.count_label(labels.PAPER_SAMPLES)}" if result.get("proxy") else ""
    against = f" vs {result.get('reference_file')}" if "reference_file" in result else ""
    prompts = f", prompts from {result['prompts']}" if result.get("prompts") else ""
    return f"names: {', '.join(names)} ({result['samples']['count']} samples{against}{proxy}{prompts})"


def main(cfg: EvalConfig) -> dict[str, Any]:
    """`dit-eval`: evaluate, print the metrics (rank 0) in the ADM evaluator's format and where the JSON is."""
    result = run_eval(cfg)
    if dist.rank() == 0:
        print(format_result(result))
        print(f"wrote {cfg.json_path}" + (f" and {cfg.rows_path}" if result.get("t2i") else ""))
        print(format_names(result))
    return result
