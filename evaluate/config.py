"""Settings of `dit-eval` (EvalConfig): a keyword-only dataclass that validates itself. The text-to-image
evaluators (`t2i`, evaluate/t2i.py) name their models by hub id or folder; the defaults are NanoGen's."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dit_pipeline.common.errors import collect
from dit_pipeline.evaluate.t2i import DEFAULTS, EVALUATORS

INPUT_SIZE = 299  # the TF graph's input resolution


@dataclass(kw_only=True)
class EvalConfig:
    samples: str
    ref: str | None = None  # None: only the text-to-image evaluators (t2i)
    json: str | None = None  # default: SAMPLES.eval.json
    inception: str | None = None  # local weights file; None: torch hub cache (fetched once)
    batch_size: int = 64  # images per Inception forward, per process (the ADM evaluator's 64)
    cache: bool = True
    quiet: bool = False
    device: str | None = None  # default: this rank's GPU, else the CPU
    input_size: int = INPUT_SIZE  # hidden test knob: Inception input resolution (299 for real numbers)
    random_inception: int | None = None  # hidden test knob: random weights of this seed instead of the file
    fd_dinov2: bool = False  # also FD_DINOv2 (evaluate/dinov2.py)
    dinov2: str | None = None  # its weights file; None: torch hub cache (fetched once)
    dinov2_resize: str = "torch"  # "torch" (fast, antialiased F.interpolate) or "pil" (dgm-eval's exact reference)
    t2i: tuple[str, ...] = ()  # text-to-image evaluators (evaluate/t2i.py EVALUATORS), in order
    prompts: str | None = None  # one prompt per sample; None: the prompts dit-sample recorded with the samples
    clip: str = DEFAULTS["clip"]  # CLIP score and GenEval's colors
    detector: str = DEFAULTS["detector"]  # GenEval's Mask2Former
    geneval_metadata: str | None = None  # GenEval's metadata, looked up by prompt, for prompts without their own
    vqa_model: str = DEFAULTS["vqa_model"]  # VQAScore's model (a t2v_metrics name)

    def validate(self) -> None:
        problems = []
        if not str(self.samples).strip():
            problems.append("SAMPLES is empty: give an .npz of images, a folder of images or a statistics file")
        if self.ref is None and not self.t2i:
            problems.append("--ref is missing: give the reference batch, e.g. VIRTUAL_imagenet256_labeled.npz (or "
                            "only text-to-image scores with --t2i NAME)")
        elif self.ref is not None and not str(self.ref).strip():
            problems.append("--ref is empty: give the reference batch, e.g. VIRTUAL_imagenet256_labeled.npz")
        unknown = [n for n in self.t2i if n not in EVALUATORS]
        if unknown:
            problems.append(f"--t2i {', '.join(unknown)}: unknown; choose from {', '.join(EVALUATORS)}")
        if len(set(self.t2i)) != len(self.t2i):
            problems.append(f"--t2i names an evaluator twice: {', '.join(self.t2i)}")
        if self.fd_dinov2 and self.ref is None:
            problems.append("--fd-dinov2 needs --ref (a distance between the samples and a reference)")
        if self.prompts is not None and not self.t2i:
            problems.append("--prompts is read by the text-to-image evaluators; add --t2i NAME (e.g. clip-score)")
        if self.geneval_metadata is not None and "geneval" not in self.t2i:
            problems.append("--geneval-metadata is read by GenEval; add --t2i geneval")
        if self.batch_size < 1:
            problems.append(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.dinov2_resize not in ("torch", "pil"):
            problems.append(f"--dinov2-resize must be torch or pil, got {self.dinov2_resize!r}")
        if self.input_size < 75:
            problems.append(f"the Inception input size must be >= 75, got {self.input_size}")
        collect(problems, "dit-eval settings")

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["t2i"] = list(self.t2i)
        return out

    @property
    def json_path(self) -> Path:
        return Path(self.json) if self.json else Path(str(Path(self.samples).expanduser()) + ".eval.json")

    @property
    def rows_path(self) -> Path:
        """The per-sample text-to-image results: SAMPLES.eval.json -> SAMPLES.eval.samples.jsonl."""
        p = self.json_path
        return p.with_name(p.name.removesuffix(".json") + ".samples.jsonl")
