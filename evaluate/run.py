"""`dit-eval`: FID, sFID, Inception Score, precision and recall of SAMPLES against REF under one or more published
evaluation protocols (evaluate/protocols.py: `adm`, the ADM evaluator, by default; `nanogen`; `imf`), on one
process or under torchrun.

Flow: rank 0 inspects both inputs and checks that they can be compared; for each protocol every rank loads its
Inception network, the reference's recorded network is checked against it (`check_network`), the features of each
side come from its cache or are extracted by all ranks (evaluate/features.py); rank 0 computes the protocol's
metrics, prints them under a line naming the protocol, network, sample count and reference, and writes all of
them as JSON (default: beside SAMPLES, `SAMPLES.eval.json`). The JSON's top-level numbers are the first
protocol's (`protocol` names it); `protocols` holds every protocol's numbers with the same record.
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
from dit_pipeline.evaluate.config import EvalConfig
from dit_pipeline.evaluate.features import source_features
from dit_pipeline.evaluate.inception import describe_network, is_random, load_inception, network_key
from dit_pipeline.evaluate.inputs import Source, check_comparable, open_source
from dit_pipeline.evaluate.protocols import PROTOCOLS, EvalProtocol, describe, parse_protocols

RESULT_FORMAT = "dit-pipeline.eval"
RESULT_VERSION = 2  # 2: protocols, the reference's network, random-Inception keys of their own
METRIC_NAMES = ("inception_score", "fid", "sfid", "precision", "recall", "fd_dinov2")


@dataclass
class Side:
    """What one input contributes: features (None for a statistics file) and precomputed statistics."""

    source: Source
    features: dict[str, np.ndarray] | None
    stored: bool = True  # its precomputed statistics apply (False: made with another resize, see stored_applies)

    def stats(self, key: str) -> M.Statistics | None:
        if _precomputed(self, key) is not None:
            return self.source.stats[key]
        if self.features is None or key not in self.features:
            return None
        return M.statistics(self.features[key])


def _precomputed(side: Side, key: str) -> M.Statistics | None:
    """The side's stored statistics under `key` where they apply (Side.stored), else None."""
    if key in side.source.stats and (side.stored or side.features is None):
        return side.source.stats[key]
    return None


def _fid(samples: Side, ref: Side, key: str) -> float | None:
    have = samples.features is not None and key in samples.features
    own, theirs = _precomputed(samples, key), _precomputed(ref, key)
    if own is None and theirs is None and have and ref.features is not None and key in ref.features:
        return M.frechet_distance_of_features(samples.features[key], ref.features[key])
    if own is None and have and theirs is not None:
        return M.frechet_distance_to_statistics(samples.features[key], theirs)
    pair = samples.stats(key), ref.stats(key)
    return None if None in pair else M.frechet_distance(*pair)


def compute_metrics(samples: Side, ref: Side, device: torch.device | str = "cpu") -> dict[str, float | None]:
    """The ADM evaluator's five numbers (None where an input lacks what a metric needs, e.g. a statistics-only
    REF); FID during training (evaluate/hook.py) calls this same function."""
    out: dict[str, float | None] = dict.fromkeys(METRIC_NAMES)
    if samples.features is not None:
        out["inception_score"] = M.inception_score(samples.features["logits"])
    out["fid"] = _fid(samples, ref, "pool")
    out["sfid"] = _fid(samples, ref, "spatial")
    if samples.features is not None and ref.features is not None:
        out["precision"], out["recall"] = M.precision_recall(ref.features["pool"], samples.features["pool"],
                                                             device=device)
    return out


def protocol_metrics(protocol: EvalProtocol, samples: Side, ref: Side,
                     device: torch.device | str = "cpu") -> dict[str, float | None]:
    """The numbers `protocol` reports, computed by its rules (evaluate/protocols.py)."""
    if protocol.name == "adm":
        return {k: v for k, v in compute_metrics(samples, ref, device).items() if k in protocol.metrics}
    out: dict[str, float | None] = dict.fromkeys(protocol.metrics)
    rule = protocol.score
    if samples.features is not None and len(samples.features["logits"]) >= rule.num_splits:  # else n/a
        out["inception_score"] = M.inception_score_permuted(samples.features["logits"], num_splits=rule.num_splits,
                                                            seed=int(rule.seed or 0), eps=rule.eps, dtype=rule.dtype)
    if protocol.fid_formula == "eigvals":
        pair = ref.stats("pool"), samples.stats("pool")  # iMF: compute_fid(ref_mu, mu, ref_sigma, sigma)
        out["fid"] = None if None in pair else M.frechet_distance_eigvals(*pair)
    else:
        out["fid"] = _fid(samples, ref, "pool")
    return out


def check_network(src: Source, ident: dict[str, Any], what: str) -> str | None:
    """UserError when `src`'s statistics or features were made by another network than `ident` (item 3 of issue
    41: a reference made with random weights gave FID 13.09 where the published weights give 0.40). Returns a
    warning line when the file records no network (accepted with the published weights only)."""
    recorded = src.extractor
    uses_stats = src.kind == "features" or "pool" in src.stats
    if not uses_stats:
        return None
    if recorded is None:
        if is_random(ident):
            raise UserError(f"{what} {src.path} holds statistics of an unrecorded network ({src.provenance}); a "
                            f"random-weight Inception's distance to them means nothing. Make the reference with "
                            f"dit-eval --make-ref (it records its network), or evaluate with the published weights")
        return f"{what} {src.path}: {src.provenance}; assumed to be inception-2015-12-05's published weights"
    if network_key(recorded) != network_key(ident):
        raise UserError(f"{what} {src.path} holds {'features' if src.kind == 'features' else 'statistics'} of "
                        f"{describe_network(recorded)}, but this evaluation runs {describe_network(ident)}: their "
                        f"distance would mean nothing. Evaluate with the network that made it ({_flags(recorded)}), "
                        f"or make it again with this one (dit-eval --make-ref)")
    if not stored_applies(src, ident) and src.kind in ("statistics", "features"):
        raise UserError(f"{what} {src.path} holds {'features' if src.kind == 'features' else 'statistics'} made with "
                        f"the {_resize(recorded)} resize, but this protocol resizes as {_resize(ident)}: their distance "
                        "mixes two inputs of the network. Pass the images it was made from, or make it with this "
                        "protocol's network")
    if src.kind == "features" and recorded.get("extractor") != ident.get("extractor"):
        raise UserError(f"{what} {src.path} holds features of {recorded.get('extractor')}, but this protocol extracts "
                        f"with {ident.get('extractor')}: pass the images instead of the features file")
    return None


def _resize(ident: dict[str, Any] | None) -> str:
    return str((ident or {}).get("resize") or "tf1")  # identities written before the imf resize: TF1's


def stored_applies(src: Source, ident: dict[str, Any]) -> bool:
    """Whether `src`'s precomputed statistics were made with the resize `ident` runs (issue 47: `--protocol adm,imf`
    against a `--make-ref` reference computed iMF's distance from iMF-resized samples against the reference's
    TF1-resized statistics). Where they were not and the file holds its images, the statistics are computed from
    those images' features under the protocol's own network (Side.stored False); an unrecorded network is assumed
    to apply (the published references record none)."""
    return src.extractor is None or _resize(src.extractor) == _resize(ident)


def _flags(ident: dict[str, Any]) -> str:
    size = int(ident.get("input_size") or 299)
    extra = "" if size == 299 else f" --input-size {size}"
    if is_random(ident):
        return f"--random-inception {ident.get('random_seed')}{extra}"
    return f"the published weights file, no --random-inception{extra}"


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
    names = parse_protocols(cfg.protocol)

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
    per_protocol: dict[str, Any] = {}
    dino = None
    if ref is not None:
        log.info("samples: %s\nreference: %s (%s)", samples.describe(), ref.describe(), ref.provenance)
        for name in names:
            protocol = PROTOCOLS[name]
            model, ident = _load_model(cfg, protocol, device)
            notes = [n for n in (check_network(samples, ident, "SAMPLES"), check_network(ref, ident, "REF")) if n]
            for note in notes:
                log.warning("%s", note)
            log.info("protocol %s: Inception network %s", describe(protocol), describe_network(ident))
            sides = []
            for src in (samples, ref):
                feats = None
                if src.kind != "statistics":
                    feats = source_features(src, model, ident, batch_size=cfg.batch_size, device=device,
                                            use_cache=cfg.cache, quiet=cfg.quiet, log=log)
                sides.append(Side(src, feats, stored=stored_applies(src, ident)))
            for side in sides:
                if not side.stored and "pool" in side.source.stats:
                    notes.append(f"{side.source.path}: its statistics were made with the {_resize(side.source.extractor)}"
                                 f" resize; protocol {name} resizes as {_resize(ident)}, so they are computed from its "
                                 "images' features")
                    log.info("%s", notes[-1])
            per_protocol[name] = (protocol, ident, sides, notes)
            del model
        dino = _dinov2_features(cfg, samples, ref, device, log) if cfg.fd_dinov2 else None
    scored = t2i.run_t2i(cfg, samples, records, str(device), log) if records is not None else None

    def finish() -> dict[str, Any]:
        result: dict[str, Any] = {"format": RESULT_FORMAT, "version": RESULT_VERSION}
        described = {"path": str(samples.path), "kind": samples.kind, "count": samples.count,
                     "label_sampling": samples.label_sampling, "class_counts": samples.class_counts}
        if ref is not None:
            sections = {}
            for name, (protocol, ident, sides, notes) in per_protocol.items():
                try:
                    numbers = protocol_metrics(protocol, *sides, device=device)
                except ValueError as e:
                    raise UserError(f"cannot compute the metrics of {samples.path} against {ref.path} under "
                                    f"protocol {name}: {e}") from None
                if dino is not None and name == names[0]:
                    numbers["fd_dinov2"] = fd_dinov2(*dino[:2])
                sections[name] = protocol_section(protocol, ident, numbers, samples, ref, notes)
            first = sections[names[0]]
            result.update({**first["numbers"],
                           **{k: first[k] for k in ("fid_name", "metric_names", "proxy", "reference_file", "protocol",
                                                    "reference_statistics")},
                           "protocols": sections, "samples": described,
                           "ref": {"path": str(ref.path), "kind": ref.kind, "count": ref.count,
                                   "provenance": ref.provenance,
                                   "stats_keys": list(ref.stats_keys) if ref.stats_keys else None,
                                   "extractor": ref.extractor},
                           "extractor": first["extractor"], **({"dinov2_extractor": dino[2]} if dino else {})})
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


def protocol_section(protocol: EvalProtocol, ident: dict[str, Any], numbers: dict[str, float | None],
                     samples: Source, ref: Source, notes: list[str]) -> dict[str, Any]:
    """One protocol's numbers, stored under their keys (a random Inception's under labels.RANDOM_KEYS) with
    everything that produced them: protocol, network, sample count, reference."""
    seed = ident.get("random_seed") if is_random(ident) else None
    stored = {labels.record_key(k, seed): v for k, v in numbers.items() if k != "fd_dinov2"}
    if "fd_dinov2" in numbers:
        stored["fd_dinov2"] = numbers["fd_dinov2"]
    names = {k: v for k, v in labels.metric_names(samples.count, seed).items() if k in stored}
    return {"protocol": protocol.name, "protocol_record": protocol.record(), "numbers": stored,
            "fid_name": names.get(labels.record_key("fid", seed)), "metric_names": names,
            "proxy": seed is not None or samples.count != labels.PAPER_SAMPLES,
            "random_inception": seed, "reference_file": ref.path.name,
            "reference_statistics": "precomputed" if "pool" in ref.stats and stored_applies(ref, ident)
            else "computed from its images",
            "reference_provenance": ref.provenance, "sample_count": samples.count, "extractor": ident,
            "network": describe_network(ident), "notes": notes}


def check_result_path(path: Path) -> None:
    """UserError (one line) unless the JSON result can be written at `path`: checked before any feature work, so
    read-only samples never cost an evaluation whose result has nowhere to go."""
    if path.is_dir():
        raise UserError(f"the result file {path} is a folder; pass --json FILE")
    try:
        check_writable_dir(path.parent, f"the result file {path}")
    except UserError as e:
        raise UserError(f"{e}, or --json elsewhere") from None


def sample_labels(count: int, ref: Path, random_seed: int | None = None) -> dict[str, Any]:
    """The names of the distances for this sample count (evaluate/labels.py) and the reference they are against."""
    names = labels.metric_names(count, random_seed)
    return {"fid_name": names[labels.record_key("fid", random_seed)], "metric_names": names,
            "proxy": random_seed is not None or count != labels.PAPER_SAMPLES, "reference_file": ref.name}


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


def load_protocol_network(protocol: EvalProtocol, path: str | None, *, device: torch.device | str,
                          random_seed: int | None, input_size: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The Inception network a protocol runs (evaluate/protocols.py `network`, `resize`) and its identity."""
    if protocol.network == "torch-fidelity":
        from dit_pipeline.evaluate.fidelity import load_fidelity_inception

        return load_fidelity_inception(path, device=device, random_seed=random_seed, input_size=input_size)
    return load_inception(path, device=device, random_seed=random_seed, input_size=input_size,
                          resize=protocol.resize)


def _load_model(cfg: EvalConfig, protocol: EvalProtocol,
                device: torch.device) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Rank 0 loads (and if needed fetches) the weights first, so a missing file is one error on every rank."""
    kwargs = dict(random_seed=cfg.random_inception, input_size=cfg.input_size, device=device)
    first: list[Any] = []
    dist.on_rank0(lambda: first.append(load_protocol_network(protocol, cfg.inception, **kwargs)))
    return first[0] if first else load_protocol_network(protocol, cfg.inception, **kwargs)


SHOWN = {"fid": "FID", "sfid": "sFID", "fd_dinov2": "FD_DINOv2", **labels.SCORE_LABELS}
DISTANCE_DECIMALS = 6  # printed FID, sFID, FD_DINOv2, IS, precision, recall: papers give 2; the JSON keeps every digit


def format_result(result: dict[str, Any]) -> str:
    """The printout: per protocol a line naming it, its network, the sample count and the reference, then the ADM
    evaluator's metric lines (n/a where an input lacked what it needs), FD_DINOv2 after them when computed (when
    there was a reference); then one line per text-to-image evaluator."""
    sections = result.get("protocols")
    if sections is None and any(k in result for k in (*METRIC_NAMES, *labels.RANDOM_KEYS.values())):
        sections = {result.get("protocol", "adm"): {"numbers": result, "metric_names": {}}}  # a version 1 result
    lines = []
    for name, sec in (sections or {}).items():
        if "sample_count" in sec:
            lines.append(f"[{name}] {describe(PROTOCOLS[name])}: {sec['sample_count']} samples vs "
                         f"{sec['reference_file']} ({sec['reference_statistics']}), Inception network: {sec['network']}")
        lines += _metric_lines(sec["numbers"], sec.get("metric_names", {}))
    return "\n".join(lines + t2i.format_t2i(result.get("t2i") or {}))


def _metric_lines(numbers: dict[str, Any], names: dict[str, str]) -> list[str]:
    out = []
    for canonical in METRIC_NAMES:  # the ADM evaluator's order; a random Inception's keys in their places
        k = labels.RANDOM_KEYS.get(canonical, canonical)
        k = k if k in numbers else canonical
        if k not in numbers or (k == "fd_dinov2" and numbers.get(k) is None):
            continue
        label = f"{names.get(k, k)} (not FID)" if k in ("fd_rand", "sfd_rand") else SHOWN[k]
        out.append(f"{label}: {'n/a' if numbers.get(k) is None else shown_value(k, numbers[k])}")
    return out


def shown_value(key: str, value: float) -> str:
    """A metric as printed: rounded to DISTANCE_DECIMALS (and never -0.0)."""
    return repr(round(float(value), DISTANCE_DECIMALS) + 0.0)


def format_names(result: dict[str, Any]) -> str:
    """The line naming the numbers with their sample count and reference (evaluate/labels.py)."""
    names = [v for k, v in result.get("metric_names", {}).items() if result.get(k) is not None]
    names += [r["name"] for r in (result.get("t2i") or {}).values()]
    if str(result.get("fid_name") or "").startswith("FD-rand"):
        proxy = f"; a proxy: {labels.random_note(int(result['protocols'][result['protocol']]['random_inception']))}"
    else:
        proxy = f"; a proxy: papers report {labels.count_label(labels.PAPER_SAMPLES)}" if result.get("proxy") else ""
    against = f" vs {result.get('reference_file')}" if "reference_file" in result else ""
    protocol = f", protocol {result['protocol']}" if result.get("protocol") else ""
    prompts = f", prompts from {result['prompts']}" if result.get("prompts") else ""
    return f"names: {', '.join(names)} ({result['samples']['count']} samples{against}{protocol}{proxy}{prompts})"


def main(cfg: EvalConfig) -> dict[str, Any]:
    """`dit-eval`: evaluate, print the metrics (rank 0) in the ADM evaluator's format and where the JSON is."""
    result = run_eval(cfg)
    if dist.rank() == 0:
        print(format_result(result))
        print(f"wrote {cfg.json_path}" + (f" and {cfg.rows_path}" if result.get("t2i") else ""))
        print(format_names(result))
    return result
