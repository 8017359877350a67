"""What `dit-sample` asks of a model's condition (dit/conditioning.py), one object per kind: the id of every sample's
condition (its class, or its prompt's index: the npz's arr_1), each batch's condition inputs, the conditioning whose
null the guidance uses, the grid's tile labels, and what the run's fingerprint and record keep. `sampling_for` picks
it by the model's conditioning kind, so sample/run.py never asks which kind a model is.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.sample import plan
from dit_pipeline.sample.config import SampleConfig
from dit_pipeline.sample.names import label_texts
from dit_pipeline.common.prompts import read_prompts
from dit_pipeline.sample.prompts import TextSampling, load_sampling_encoder, prompt_ids


@dataclass
class ClassSampling:
    """Class labels: --class-labels, or drawn for --num-samples (sample/plan.py)."""

    ids: np.ndarray
    class_names: Sequence[str] | None = None

    def conditioning(self, model: Any) -> Any:
        return model.conditioning()

    def condition(self, indices: Sequence[int]) -> dict[str, torch.Tensor] | None:
        return None  # generate_images takes the labels themselves

    def grid_labels(self, ids: Sequence[int]) -> list[str]:
        return label_texts(ids, self.class_names)

    def fingerprint(self) -> dict[str, Any]:
        return {}

    def record(self) -> dict[str, Any]:
        return {}


@dataclass
class NoSampling(ClassSampling):
    """An unconditional model: no condition input (every id 0)."""

    def condition(self, indices: Sequence[int]) -> dict[str, torch.Tensor] | None:
        return {}

    def grid_labels(self, ids: Sequence[int]) -> list[str]:
        return ["" for _ in ids]


Sampling = ClassSampling | TextSampling


def _class(cfg: SampleConfig, loaded: Any, device: torch.device) -> tuple[SampleConfig, Sampling]:
    if cfg.prompts is not None or cfg.prompts_file is not None:
        raise UserError(f"--prompt / --prompts: {cfg.ckpt} is a class-conditional model; pass --class-labels or "
                        "--num-samples")
    num_classes = int(loaded.config["num_classes"])
    bad = sorted({int(c) for c in cfg.class_labels or [] if int(c) >= num_classes})
    if bad:
        raise UserError(f"--class-labels {bad} out of range: the model has {num_classes} classes "
                        f"(0..{num_classes - 1})")
    given = None if cfg.class_labels is None else [int(c) for c in cfg.class_labels]
    ids = plan.class_labels(num_samples=cfg.total, seed=cfg.seed, num_classes=num_classes, given=given,
                            sampling=cfg.labels)
    return cfg, ClassSampling(ids, (loaded.latent or {}).get("class_names"))


def _text(cfg: SampleConfig, loaded: Any, device: torch.device) -> tuple[SampleConfig, Sampling]:
    if cfg.class_labels is not None or (cfg.prompts is None and cfg.prompts_file is None):
        raise UserError(f"--ckpt {cfg.ckpt} is a text-conditional model: pass --prompt TEXT (repeatable) or "
                        "--prompts FILE")
    records = read_prompts(cfg.prompts_file) if cfg.prompts_file else [{"prompt": p} for p in cfg.prompts or []]
    if cfg.prompts_file:  # the file's prompts become the run's (recorded), the file's metadata stays in the record
        cfg = dataclasses.replace(cfg, prompts=[r["prompt"] for r in records], prompts_file=None)
    if cfg.total % len(records):
        raise UserError(f"--num-samples {cfg.total} is not a multiple of the {len(records)} prompts (each prompt gets "
                        "the same number of samples)")
    encoder = load_sampling_encoder(cfg.text_encoder, loaded.info.get("text"), int(loaded.config["text_dim"]),
                                    str(cfg.ckpt), device)
    return cfg, TextSampling(records, prompt_ids(len(records), cfg.total), encoder, device)


def _none(cfg: SampleConfig, loaded: Any, device: torch.device) -> tuple[SampleConfig, Sampling]:
    if cfg.class_labels is not None or cfg.prompts is not None or cfg.prompts_file is not None:
        raise UserError(f"--ckpt {cfg.ckpt} is an unconditional model: pass --num-samples only")
    return cfg, NoSampling(np.zeros(cfg.total, dtype=np.int64))


KINDS: dict[str, Callable[[SampleConfig, Any, torch.device], tuple[SampleConfig, Sampling]]] = {
    "class": _class, "text": _text, "none": _none}


def sampling_for(cfg: SampleConfig, loaded: Any, device: torch.device) -> tuple[SampleConfig, Sampling]:
    """(`cfg` with a prompts file's prompts in it, the sampling object of the model's conditioning kind)."""
    return KINDS[loaded.model.condition_kind](cfg, loaded, device)


# The trainer's grids (sample.grid.SampleGridHook): a tile per class of `labels`, or per prompt of `prompts`
# encoded once by the run's text encoder (`text_encoder()` loads it), which is let go after.

def _class_grid(labels: Sequence[int], class_names: Sequence[str] | None, prompts: Any, text_encoder: Any,
                device: torch.device) -> Sampling:
    return ClassSampling(np.asarray([int(c) for c in labels], dtype=np.int64), class_names)


def _text_grid(labels: Sequence[int], class_names: Sequence[str] | None, prompts: Sequence[dict[str, Any]] | None,
               text_encoder: Callable[[], Any] | None, device: torch.device) -> Sampling:
    if not prompts or text_encoder is None:
        raise UserError("a text run's sample grids draw prompts: pass --sample-prompts FILE (one prompt per line)")
    return TextSampling(prompts, np.arange(len(prompts)), text_encoder(), device).release_encoder()


GRID_KINDS: dict[str, Callable[..., Sampling]] = {"class": _class_grid, "text": _text_grid}


def grid_sampling(kind: str, *, labels: Sequence[int], class_names: Sequence[str] | None,
                  prompts: Sequence[dict[str, Any]] | None, text_encoder: Callable[[], Any] | None,
                  device: torch.device) -> Sampling:
    """The sampling object of a training run's grids for a model of conditioning `kind` (an unconditional run has
    no grids: train.preflight refuses them)."""
    if kind not in GRID_KINDS:
        raise UserError(f"the sample grids draw class labels or prompts; a model conditioned on {kind!r} has neither: "
                        "drop --sample-every and sample its checkpoints with dit-sample")
    return GRID_KINDS[kind](labels, class_names, prompts, text_encoder, device)


# FID during training (evaluate.hook.FidHook): sample i's condition as dit-sample gives it, for the model's condition
# kind: a class drawn by (seed, i) (--fid-labels' rule), or the prompt of sample i (prompt k for the N / P samples from
# k N / P, dit-sample --prompts' rule) encoded batch by batch by the run's text encoder (`text_encoder()` loads it).

def _class_fid(num_samples: int, seed: int, labels: str, num_classes: int, prompts: Any,
               text_encoder: Any, device: torch.device) -> Sampling:
    return ClassSampling(plan.class_labels(num_samples=num_samples, seed=seed, num_classes=num_classes,
                                           sampling=labels))


def _text_fid(num_samples: int, seed: int, labels: str, num_classes: int,
              prompts: Sequence[dict[str, Any]] | None, text_encoder: Callable[[], Any] | None,
              device: torch.device) -> Sampling:
    if not prompts or text_encoder is None:
        raise UserError("FID during training of a text run draws prompts: pass --fid-prompts FILE, or a captioned "
                        "--fid-ref (dit-eval --make-ref FOLDER --captions FILE writes REF.prompts.jsonl beside it)")
    return TextSampling(prompts, prompt_ids(len(prompts), num_samples), text_encoder(), device)


FID_KINDS: dict[str, Callable[..., Sampling]] = {"class": _class_fid, "text": _text_fid}


def fid_sampling(kind: str, *, num_samples: int, seed: int, labels: str, num_classes: int,
                 prompts: Sequence[dict[str, Any]] | None, text_encoder: Callable[[], Any] | None,
                 device: torch.device) -> Sampling:
    """The sampling object of a training run's FID samples for a model of conditioning `kind` (an unconditional run
    has no FID during training: train.preflight refuses it)."""
    if kind not in FID_KINDS:
        raise UserError(f"FID during training draws class labels or prompts; a model conditioned on {kind!r} has "
                        "neither: drop --fid-every and sample its checkpoints with dit-sample")
    return FID_KINDS[kind](num_samples, seed, labels, num_classes, prompts, text_encoder, device)
