"""Names and versions of the files dit-pipeline writes around DiT weights, and the objectives they record
(docs/ARCHITECTURE.md).

Defined once, here at the bottom of the import picture, because both sides need them: train/ writes and
resumes training checkpoints (train.checkpoint, train.parts) and dit.weights reads them and their sidecars.
"""
from __future__ import annotations

OBJECTIVES = ("ddpm", "flow", "meanflow", "imf", "imf-adaln")  # dit/objectives.py: the registry of each one
#  # what a model learns, as checkpoints, sidecars and exports record it ("objective")

CHECKPOINT_FORMAT = "dit-pipeline.checkpoint"   # RUN/checkpoints/step-NNNNNNN.pt
CHECKPOINT_VERSION = 1
# The keys a training checkpoint holds are owned by the trainer's named parts (train/parts.py).

SIDECAR_FORMAT = "dit-pipeline.weights-sidecar"  # step-NNNNNNN-ema.json beside the bare EMA weights
SIDECAR_VERSION = 1
