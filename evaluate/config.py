"""Settings of `dit-eval` (EvalConfig, a keyword-only dataclass that validates itself) and of FID during
training (FidSettings, which dit-train's TrainConfig inherits)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dit_pipeline.common.errors import collect
from dit_pipeline.common.settings import positive, setting
from dit_pipeline.sample.config import GRIDS, DecodeSettings

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

    def validate(self) -> None:
        problems = []
        if not str(self.samples).strip():
            problems.append("SAMPLES is empty: give an .npz of images, a folder of images or a statistics file")
        if not str(self.ref).strip():
            problems.append("--ref is empty: give the reference batch, e.g. VIRTUAL_imagenet256_labeled.npz")
        if self.batch_size < 1:
            problems.append(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.input_size < 75:
            problems.append(f"the Inception input size must be >= 75, got {self.input_size}")
        collect(problems, "dit-eval settings")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def json_path(self) -> Path:
        return Path(self.json) if self.json else Path(str(Path(self.samples).expanduser()) + ".eval.json")


# ----------------------------------------------------------------------------------------------------------
# Settings of FID during training (evaluate.hook.FidHook); dit-train's TrainConfig inherits them, so they are
# stored flat in its config.

@dataclass(kw_only=True)
class FidSettings(DecodeSettings):
    """Every `fid_every` steps all ranks sample with the EMA weights as dit-sample does and rank 0 logs FID,
    sFID, Inception Score, precision and recall against `fid_ref`."""

    fid_every: int | None = setting(
        None, "Every N steps all ranks sample with the EMA weights (as dit-sample) and log fid, sfid, "
        "inception_score, precision, recall to metrics.jsonl (needs --vae, --fid-ref)", group=GRIDS, shown="off")
    fid_ref: str | None = setting(
        None, "FID reference: the ADM reference batch (VIRTUAL_imagenet256_labeled.npz), an .npz or folder of "
        "images, or a statistics file", group=GRIDS)
    fid_num_samples: int = setting(5000, "Samples per FID evaluation", group=GRIDS)
    fid_steps: int = setting(250, "DDPM steps of the FID samples", group=GRIDS)
    fid_cfg_scale: float = setting(1.5, "Guidance scale of the FID samples", group=GRIDS)
    fid_batch_size: int = setting(32, "FID samples per GPU and batch", group=GRIDS)
    inception: str | None = setting(
        None, "Inception weights file weights-inception-2015-12-05-6726825d.pth", group=GRIDS,
        shown="torch hub cache, fetched once")
    fid_input_size: int = setting(INPUT_SIZE, "Inception input resolution (a test knob; 299 for real numbers)",
                                  group=GRIDS, hidden=True)
    fid_random_inception: int | None = setting(
        None, "Random Inception weights of this seed instead of the file (a test knob: FID without weights)",
        group=GRIDS, hidden=True)

    def fid_problems(self) -> list[str]:
        p: list[str] = []
        if self.fid_every is None:
            if self.fid_ref:
                p.append("--fid-ref only serves FID during training: add --fid-every N (or drop it)")
            return p
        p += positive(self, "fid_every", "fid_num_samples", "fid_steps", "fid_batch_size")
        if not str(self.fid_ref or "").strip():
            p.append("--fid-every needs --fid-ref, the reference (e.g. VIRTUAL_imagenet256_labeled.npz)")
        if not str(self.vae or "").strip():
            p.append("--fid-every needs --vae, the VAE that decodes the samples (the one the shards were "
                     "extracted with)")
        if isinstance(self.fid_num_samples, int) and 0 < self.fid_num_samples < 4:
            p.append(f"--fid-num-samples must be >= 4 (precision/recall use 3 nearest neighbours), got "
                     f"{self.fid_num_samples}")
        if not (isinstance(self.fid_cfg_scale, (int, float)) and self.fid_cfg_scale >= 1.0):
            p.append(f"--fid-cfg-scale must be >= 1 (1 = no guidance), got {self.fid_cfg_scale!r}")
        return p
