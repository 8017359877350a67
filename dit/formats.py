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
# A sharded run's checkpoint (--parallel zero2|fsdp|hsdp) is a folder RUN/checkpoints/step-NNNNNNN.dcp/ of the same
# keys: the tensors under SHARDED_KEYS as one safetensors file per rank (torch.distributed.checkpoint), the rest in
# SHARDED_RECORDS with each of those tensors replaced by {SHARDED_PLACEHOLDER: its key}.
SHARDED_SUFFIX = ".dcp"
SHARDED_RECORDS = "records.pt"
SHARDED_KEYS = ("model", "ema", "opt", "projector")
SHARDED_PLACEHOLDER = "dcp"

SIDECAR_FORMAT = "dit-pipeline.weights-sidecar"  # step-NNNNNNN-ema.json beside the bare EMA weights
SIDECAR_VERSION = 1
