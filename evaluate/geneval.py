"""GenEval (Ghosh et al. 2023) as NanoGen re-implements it without mmdet (End2End-Diffusion/diffusionbench-evals
`geneval/geneval_evaluator/`: `evaluator.py`, `utils.py`, `constants.py`), written here from those facts:

- Prompts carry GenEval's metadata: `tag` (single_object, two_object, counting, colors, position, color_attr),
  `include` (class, count, optionally color and position [relation, index of an earlier include]) and `exclude`.
- Detection (evaluate/geneval_detect.py): Mask2Former instance segmentation at 800 / 1333, candidates scoring at
  least `threshold`; each kept as (box of its mask, score, mask).
- Per class: detections sorted by score, those scoring above 0.3 (0.9 for the `counting` tag) kept, at most 16,
  then an overlap filter that is off at `max_overlap` 1.0 (NanoGen's setting).
- An `include` needs `count` detections of its class (the best `count` are used); with `color`, at least
  `count` of them must be classified as that color by CLIP (one of 10 colors, zero-shot from three templates,
  on the object's masked crop over a #999 background); with `position`, every one of them must stand in the
  relation to every object of the earlier include it names (box centers, offsets shrunk by 0.1 of the two
  boxes' sizes, a relation where the unit offset's component exceeds 0.5). An `exclude` fails when `count` or
  more of its class are detected.
- Scores: NanoGen's `geneval` number (src/eval/generation.py) is the fraction of correct images; GenEval's
  overall score (`summarize_results`) is the mean of the per-tag fractions. Both are reported, named apart.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from dit_pipeline.common.errors import UserError

COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
COLOR_TEMPLATES = ("a photo of a {c} {cls}", "a photo of a {c}-colored {cls}", "a photo of a {c} object")


@dataclass(frozen=True)
class Options:
    """NanoGen's DEFAULT_OPTIONS (geneval_evaluator/constants.py)."""

    threshold: float = 0.3             # detection score floor (and the candidates' floor in post-processing)
    counting_threshold: float = 0.9    # the floor for prompts tagged "counting"
    max_objects: int = 16              # per class
    max_overlap: float = 1.0           # IoU above which a lower-scoring box of the class is dropped (1: off)
    position_threshold: float = 0.1
    bgcolor: str = "#999"              # background of the masked crop the color is classified on
    crop: bool = True                  # classify the color on the object's box, not the whole image


@dataclass
class Detection:
    box: np.ndarray                    # float32 [x1, y1, x2, y2]: first and last pixel rows/columns of the mask
    score: float
    mask: np.ndarray | None = None     # uint8 [H, W], 255 on the object


ColorFn = Callable[[str, Sequence[Detection]], list[str]]


def iou(a: np.ndarray, b: np.ndarray) -> float:
    """IoU of two boxes with inclusive pixel bounds (+1 on each side's length)."""
    def area(x1: float, y1: float, x2: float, y2: float) -> float:
        return max(x2 - x1 + 1, 0) * max(y2 - y1 + 1, 0)
    inter = area(max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3]))
    union = area(*a[:4]) + area(*b[:4]) - inter
    return float(inter / union) if union else 0.0


def filter_detections(found: dict[str, list[Detection]], tag: str, opts: Options = Options()) -> dict[str, list[Detection]]:
    """The detections a prompt is judged on: per class, best first, above the tag's floor, at most max_objects,
    overlapping ones dropped when max_overlap < 1; classes left without any are absent."""
    floor = opts.counting_threshold if tag == "counting" else opts.threshold
    kept_by_class = {}
    for cls, dets in found.items():
        ranked = [d for d in sorted(dets, key=lambda d: d.score, reverse=True) if d.score > floor]
        kept: list[Detection] = []
        for d in ranked[:opts.max_objects]:
            if opts.max_overlap < 1 and any(iou(d.box, k.box) >= opts.max_overlap for k in kept):
                continue
            kept.append(d)
        if kept:
            kept_by_class[cls] = kept
    return kept_by_class


def relation(a: np.ndarray, b: np.ndarray, threshold: float = 0.1) -> set[str]:
    """Where box a stands relative to box b: a subset of {left of, right of, above, below} (image y grows down)."""
    ca = np.array([(a[0] + a[2]) / 2, (a[1] + a[3]) / 2], np.float64)
    cb = np.array([(b[0] + b[2]) / 2, (b[1] + b[3]) / 2], np.float64)
    size_a = np.abs(np.array([a[2] - a[0], a[3] - a[1]], np.float64))
    size_b = np.abs(np.array([b[2] - b[0], b[3] - b[1]], np.float64))
    offset = ca - cb
    shrunk = np.maximum(np.abs(offset) - threshold * (size_a + size_b), 0) * np.sign(offset)
    if np.all(np.abs(shrunk) < 1e-3):
        return set()
    dx, dy = shrunk / np.linalg.norm(offset)
    out = set()
    if dx < -0.5:
        out.add("left of")
    if dx > 0.5:
        out.add("right of")
    if dy < -0.5:
        out.add("above")
    if dy > 0.5:
        out.add("below")
    return out


def judge(record: dict[str, Any], detected: dict[str, list[Detection]], colors_of: ColorFn,
          opts: Options = Options()) -> tuple[bool, list[str]]:
    """(correct, reasons) of one image's filtered detections against its prompt's metadata."""
    correct, reasons = True, []
    groups: list[list[Detection] | None] = []
    for req in record.get("include", []):
        cls, n = req["class"], int(req["count"])
        found = detected.get(cls, [])[:n]
        matched = len(found) >= n
        if not matched:
            reasons.append(f"expected {cls}>={n}, found {len(found)}")
        else:
            if "color" in req:
                colors = colors_of(cls, found)
                if colors.count(req["color"]) < n:
                    matched = False
                    reasons.append(f"expected {req['color']} {cls}>={n}, found {colors.count(req['color'])} "
                                   f"{req['color']} ({', '.join(colors)})")
            if "position" in req and matched:
                rel, target = req["position"]
                if groups[target] is None:
                    matched = False
                    reasons.append(f"no target for {cls} to be {rel}")
                else:
                    for obj in found:
                        bad = next((relation(obj.box, t.box, opts.position_threshold) for t in groups[target]
                                    if rel not in relation(obj.box, t.box, opts.position_threshold)), None)
                        if bad is not None:
                            matched = False
                            found_rel = " and ".join(sorted(bad)) or "no relation"
                            reasons.append(f"expected {cls} {rel} target, found {found_rel}")
                            break
        correct = correct and matched
        groups.append(found if matched else None)
    for req in record.get("exclude", []):
        have = len(detected.get(req["class"], []))
        if have >= int(req["count"]):
            correct = False
            reasons.append(f"expected {req['class']}<{req['count']}, found {have}")
    return correct, reasons


def metadata_key(record: dict[str, Any]) -> str:
    """What identifies a prompt's metadata (GenEval groups images by it for its per-prompt score)."""
    return json.dumps({k: record[k] for k in ("prompt", "tag", "include", "exclude") if k in record},
                      sort_keys=True)


def summarize(per_sample: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """NanoGen's number (fraction of correct images) as `value`; GenEval's overall (mean of the per-tag
    fractions), the per-tag fractions, and the fraction of prompts with at least one correct image."""
    correct = np.array([bool(s["correct"]) for s in per_sample])
    tasks: dict[str, list[bool]] = {}
    prompts: dict[str, bool] = {}
    for s in per_sample:
        tasks.setdefault(s["tag"], []).append(bool(s["correct"]))
        prompts[s["key"]] = prompts.get(s["key"], False) or bool(s["correct"])
    task_scores = {t: float(np.mean(v)) for t, v in tasks.items()}
    return {"value": float(correct.mean()), "overall": float(np.mean(list(task_scores.values()))),
            "tasks": task_scores, "task_counts": {t: len(v) for t, v in tasks.items()},
            "correct_images": int(correct.sum()), "prompts": len(prompts),
            "correct_prompts": float(np.mean(list(prompts.values())))}


def attach_metadata(records: list[dict[str, Any]], metadata: Sequence[dict[str, Any]] | None,
                    source: str) -> list[dict[str, Any]]:
    """Records with GenEval's metadata: their own (`tag` and `include`), else the entry of `metadata` with the
    same prompt; a UserError names the first prompt without any."""
    table = {m["prompt"]: m for m in metadata or ()}
    out = []
    for i, r in enumerate(records):
        if "tag" in r and "include" in r:
            out.append(r)
        elif r["prompt"] in table:
            out.append({**table[r["prompt"]], **r})
        else:
            where = "in --geneval-metadata" if metadata is not None else \
                "(pass --geneval-metadata FILE: GenEval's evaluation_metadata.jsonl or NanoGen's metadata.json)"
            raise UserError(f"GenEval: sample {i}'s prompt {r['prompt'][:60]!r} ({source}) has no GenEval metadata "
                            f"(tag, include) {where}")
        bad = [k for k in ("tag", "include") if k not in out[-1]] or \
            [q for q in out[-1]["include"] + out[-1].get("exclude", []) if "class" not in q or "count" not in q]
        if bad:
            raise UserError(f"GenEval: the metadata of {r['prompt'][:60]!r} is incomplete ({bad}); every include "
                            "and exclude needs class and count")
    return out
