"""The CLIP score as NanoGen computes it (End2End-Diffusion/diffusion-bench `src/eval/clipscore.py` and
`src/eval/generation.py`): per sample, the cosine of CLIP's image and text embeddings (`image_embeds ·
text_embeds`, both unit-norm; no factor of 100 and no clamp at 0), the prompt tokenized with padding and
truncation (77 tokens for the released CLIPs), the image through CLIPProcessor's default (torchvision) resize
and crop (evaluate/clip.py); the score is the mean over all samples. Default model:
`openai/clip-vit-large-patch14`, NanoGen's.

Papers that follow torchmetrics' `CLIPScore` report 100 * max(cosine, 0) instead; the same embeddings give it
as `x100_clamped` beside the NanoGen number, named apart so the two never mix.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from dit_pipeline.evaluate.clip import Clip


class ClipScorer:
    def __init__(self, clip: Clip):
        self.clip = clip

    def score(self, images: np.ndarray, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """uint8 [n, H, W, 3] and their prompt records -> one {"cosine"} per sample."""
        img = self.clip.image_embeds(self.clip.pixels_torchvision(images))
        txt = self.clip.text_embeds([r["prompt"] for r in records])
        cos = (img * txt).sum(dim=-1).double().cpu().tolist()
        return [{"cosine": float(c)} for c in cos]

    @staticmethod
    def summarize(per_sample: Sequence[dict[str, Any]]) -> dict[str, Any]:
        cos = np.array([s["cosine"] for s in per_sample], np.float64)
        return {"value": float(cos.sum() / len(cos)), "x100_clamped": float(np.mean(100.0 * np.maximum(cos, 0.0))),
                "std": float(cos.std())}

