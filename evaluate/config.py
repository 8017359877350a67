"""Settings of `dit-eval` (EvalConfig): a keyword-only dataclass that validates itself."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dit_pipeline.common.errors import collect
from dit_pipeline.evaluate.protocols import parse_protocols

INPUT_SIZE = 299  # the TF graph's input resolution


@dataclass(kw_only=True)
class EvalConfig:
    samples: str
    ref: str
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
    protocol: str = "adm"  # evaluate/protocols.py: adm, nanogen, imf, comma-separated, or all

    def validate(self) -> None:
        problems = []
        if not str(self.samples).strip():
            problems.append("SAMPLES is empty: give an .npz of images, a folder of images or a statistics file")
        if not str(self.ref).strip():
            problems.append("--ref is empty: give the reference batch, e.g. VIRTUAL_imagenet256_labeled.npz")
        if self.batch_size < 1:
            problems.append(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.dinov2_resize not in ("torch", "pil"):
            problems.append(f"--dinov2-resize must be torch or pil, got {self.dinov2_resize!r}")
        if self.input_size < 75:
            problems.append(f"the Inception input size must be >= 75, got {self.input_size}")
        try:
            parse_protocols(self.protocol)
        except ValueError as e:
            problems.append(str(e))
        collect(problems, "dit-eval settings")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def json_path(self) -> Path:
        return Path(self.json) if self.json else Path(str(Path(self.samples).expanduser()) + ".eval.json")
