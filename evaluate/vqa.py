"""The VQA-based text-to-image scores NanoGen reports: DPG-Bench (ELLA's; End2End-Diffusion/diffusionbench-evals
`dpgbench/dpg_evaluator/`) and GenAI-Bench's VQAScore (linzhiqiu/t2v_metrics; diffusionbench-evals
`t2v_metrics/`). Both need multi-GB VQA models that transformers does not provide (mPLUG-large for DPG-Bench,
CLIP-FlanT5-XXL for VQAScore), so the models come from those packages when they are installed; without them
the evaluator refuses before any work, naming the package to install.

DPG-Bench's rule (`evaluator.py` `compute_vqa_scores`, `compute_sample_score`, `aggregate_results`), written here
from those facts: every question of the prompt's item is asked of the image; an answer "yes" scores 1, anything
else 0; a question whose parent questions (its `dependency` ids other than 0) include one scored 0 is set to 0;
the sample's score is the mean over its questions; the benchmark's score is the mean over samples, and the
category scores (the part of each question's tuple before "(", and its first "-"-separated word for the level-1
category) are means of the unadjusted answers.
VQAScore: t2v_metrics' `VQAScore(model)(images, texts)`, the probability of "Yes" to 'Does this figure show
"{prompt}"? Please answer yes or no.', averaged over the samples (NanoGen's GenAI-Bench setting:
`clip-flant5-xxl`).
"""
from __future__ import annotations

import importlib
from collections import defaultdict
from typing import Any, Callable, Sequence

import numpy as np

from dit_pipeline.common.errors import UserError

DPG_PACKAGE = "dpg_evaluator"
DPG_INSTALL = 'pip install "git+https://github.com/End2End-Diffusion/diffusionbench-evals.git#subdirectory=dpgbench"'
VQASCORE_PACKAGE = "t2v_metrics"
VQASCORE_INSTALL = ('pip install "git+https://github.com/End2End-Diffusion/diffusionbench-evals.git'
                    '#subdirectory=t2v_metrics"')
DEFAULT_VQASCORE_MODEL = "clip-flant5-xxl"


def require(package: str, install: str, what: str) -> Any:
    """The module `package`, or a UserError naming what to install."""
    try:
        return importlib.import_module(package)
    except ImportError as e:
        raise UserError(f"{what} needs the `{package}` package, which brings its VQA model ({e.msg}); install it "
                        f"with: {install}") from None


# ---- DPG-Bench -----------------------------------------------------------------------------------------------

def dpg_scores(answers: dict[int, str], dependencies: dict[int, list[int]]) -> tuple[float, dict[int, float]]:
    """(the sample's score, the unadjusted 0/1 per question) from its answers and the questions' parents."""
    raw = {q: 1.0 if a == "yes" else 0.0 for q, a in answers.items()}
    adjusted = dict(raw)
    for q, parents in dependencies.items():
        if any(adjusted.get(p, 1.0) == 0 for p in parents if p != 0):
            adjusted[q] = 0.0
    return sum(adjusted.values()) / len(adjusted), raw


def dpg_summary(per_sample: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean score and the level-1 / level-2 category means of the unadjusted answers."""
    level2: dict[str, list[float]] = defaultdict(list)
    for s in per_sample:
        for q, tup in s["tuples"].items():
            level2[tup.split("(")[0].strip()].append(s["raw"][q])
    level1: dict[str, list[float]] = defaultdict(list)
    for cat, v in level2.items():
        level1[cat.split("-")[0].strip()].extend(v)
    return {"value": float(np.mean([s["score"] for s in per_sample])),
            "level1": {k: float(np.mean(v)) for k, v in level1.items()},
            "level2": {k: float(np.mean(v)) for k, v in level2.items()}}


class DpgScorer:
    """DPG-Bench with the `dpg_evaluator` package's mPLUG and metadata (prompt -> item, item -> questions)."""

    def __init__(self, device: str):
        pkg = require(DPG_PACKAGE, DPG_INSTALL, "DPG-Bench")
        self.vqa = pkg.MPLUG(device=device)
        self.prompt2id, self.items = pkg.load_prompt2id(), pkg.load_dpg_metadata()

    @staticmethod
    def check(records: Sequence[dict[str, Any]]) -> None:
        require(DPG_PACKAGE, DPG_INSTALL, "DPG-Bench")

    def item(self, prompt: str) -> dict[str, Any]:
        item_id = self.prompt2id.get(prompt)
        if item_id is None or item_id not in self.items:
            raise UserError(f"DPG-Bench: the prompt {prompt[:60]!r} is not one of DPG-Bench's; evaluate samples "
                            "generated from its prompts")
        return self.items[item_id]

    def score(self, images: np.ndarray, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        from PIL import Image

        out = []
        for img, rec in zip(images, records):
            item = self.item(rec["prompt"])
            qids = list(item["qid2question"])
            pil = Image.fromarray(img)
            answers = dict(zip(qids, self.vqa.batch_vqa([pil] * len(qids), [item["qid2question"][q] for q in qids])))
            score, raw = dpg_scores(answers, item["qid2dependency"])
            out.append({"score": score, "raw": raw, "tuples": dict(item["qid2tuple"])})
        return out

    summarize = staticmethod(dpg_summary)


class VqaScorer:
    """VQAScore with the `t2v_metrics` package's model (NanoGen's GenAI-Bench number)."""

    def __init__(self, device: str, model: str = DEFAULT_VQASCORE_MODEL):
        pkg = require(VQASCORE_PACKAGE, VQASCORE_INSTALL, "VQAScore")
        self.scorer: Callable[..., Any] = pkg.VQAScore(model=model, device=device)

    @staticmethod
    def check(records: Sequence[dict[str, Any]]) -> None:
        require(VQASCORE_PACKAGE, VQASCORE_INSTALL, "VQAScore")

    def score(self, images: np.ndarray, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        from PIL import Image

        values = self.scorer(images=[Image.fromarray(i) for i in images], texts=[r["prompt"] for r in records])
        return [{"score": float(v)} for v in np.asarray(values.detach().cpu() if hasattr(values, "detach")
                                                         else values, np.float64).reshape(-1)]

    @staticmethod
    def summarize(per_sample: Sequence[dict[str, Any]]) -> dict[str, Any]:
        return {"value": float(np.mean([s["score"] for s in per_sample]))}
