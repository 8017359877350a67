"""Names, versions and required keys of the files dit-pipeline writes around DiT weights (docs/ARCHITECTURE.md).

Defined once, here at the bottom of the import picture, because both sides need them: train/ writes and
resumes training checkpoints (train.state, train.checkpoint) and dit.weights reads them and their sidecars.
"""
from __future__ import annotations

CHECKPOINT_FORMAT = "dit-pipeline.checkpoint"   # RUN/checkpoints/step-NNNNNNN.pt
CHECKPOINT_VERSION = 1
# what a training checkpoint must hold to resume from (besides format and version)
CHECKPOINT_KEYS = ("model", "ema", "opt", "step", "epoch", "data", "model_config", "config", "manifest_fingerprint")

SIDECAR_FORMAT = "dit-pipeline.weights-sidecar"  # step-NNNNNNN-ema.json beside the bare EMA weights
SIDECAR_VERSION = 1
