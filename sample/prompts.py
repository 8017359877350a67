"""Prompts for `dit-sample --prompt TEXT` (repeatable) and `--prompts FILE`, and what sampling a text model needs.

A prompts file is read by common/prompts.py (`read_prompts`: plain text, one per line; JSON Lines with a "prompt"
per line, e.g. GenEval's evaluation_metadata.jsonl; or JSON), every key of a record kept. Every sample's prompt is
a pure function of its index: with P prompts and N samples (N a multiple of P), prompt k gets the N / P consecutive
samples from k N / P (GenEval's 4 images per prompt are 4 neighbours). The run's record holds one prompt record
per sample, in the samples' order (`prompts`), which `dit-eval --t2i` reads back.

`TextSampling` is what `dit-sample` asks of a text-conditional model: each batch's prompt features (encoded by the
run's text encoder, common/text_encoders.py, which the checkpoint records or --text-encoder names), the empty
prompt's features as the null condition of classifier-free guidance (NanoGen encodes "" with the same encoder:
src/stage2/utils.py `sample_and_decode`), the grid's labels (the prompts, wrapped) and the record of prompts and
encoder.
"""
from __future__ import annotations

import hashlib
import json
import textwrap
from typing import Any, Sequence

import numpy as np
import torch

from dit_pipeline.common.errors import UserError

GRID_WRAP = 28  # characters per line of a prompt in a grid tile
GRID_LINES = 3  # lines of it shown


def prompt_ids(num_prompts: int, num_samples: int) -> np.ndarray:
    """The prompt of every sample: k for samples k n .. (k + 1) n - 1, n = num_samples / num_prompts."""
    if num_prompts < 1 or num_samples % num_prompts:
        raise ValueError(f"{num_samples} samples cannot be split evenly over {num_prompts} prompts")
    return np.repeat(np.arange(num_prompts, dtype=np.int64), num_samples // num_prompts)


def grid_text(prompt: str) -> str:
    """A prompt as a grid tile's label: wrapped, at most GRID_LINES lines (the last one cut with ...)."""
    lines = textwrap.wrap(prompt, GRID_WRAP) or [""]
    if len(lines) > GRID_LINES:
        lines = lines[:GRID_LINES]
        lines[-1] = lines[-1][: GRID_WRAP - 3] + "..."
    return "\n".join(lines)


class TextSampling:
    """The prompts of a run and the encoder that turns them into the model's condition (module docstring)."""

    def __init__(self, prompts: Sequence[dict[str, Any]], ids: np.ndarray, encoder: Any, device: torch.device):
        self.prompts, self.ids, self.encoder, self.device = list(prompts), ids, encoder, device
        self.identity = dict(encoder.identity)
        null = self._encode([""])
        self.null_text, self.null_mask = null["text"][0], null["text_mask"][0]
        self._rows: dict[str, torch.Tensor] | None = None  # every sample's features, once the encoder is let go

    def release_encoder(self) -> "TextSampling":
        """Encode every sample's prompt now (padded to the longest) and let the encoder go; `condition` then reads
        these rows. For the trainer's grids, which draw the same prompts at every step."""
        self._rows = self._encode([self.prompts[int(k)]["prompt"] for k in self.ids])
        self.encoder = None
        return self

    def _encode(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """Features in the encoder's dtype (bfloat16 for Qwen3, as NanoGen samples), zero past each prompt's
        length, padded to the longest (the training batches' layout)."""
        with torch.no_grad():
            text, mask = self.encoder.encode(texts).as_batch()
        return {"text": text.to(self.device), "text_mask": mask.to(self.device)}

    def conditioning(self, model: Any) -> Any:
        """The model's conditioning with the empty prompt as its null (dit/conditioning.py)."""
        return model.conditioning(self.null_text, self.null_mask)

    def condition(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """The features of the prompts of samples `indices` (right-padded to the batch's longest; after
        `release_encoder`, to the longest of all)."""
        if self._rows is not None:
            rows = list(indices)
            return {k: v[rows] for k, v in self._rows.items()}
        return self._encode([self.prompts[int(self.ids[i])]["prompt"] for i in indices])

    def grid_labels(self, ids: Sequence[int]) -> list[str]:
        return [grid_text(self.prompts[int(k)]["prompt"]) for k in ids]

    def fingerprint(self) -> dict[str, Any]:
        """What the pixels depend on: the prompts and the encoder."""
        text = json.dumps([p["prompt"] for p in self.prompts], ensure_ascii=False).encode()
        return {"prompts_sha256": hashlib.sha256(text).hexdigest(), "text_encoder": dict(self.identity)}

    def record(self) -> dict[str, Any]:
        """One prompt record per sample, in the samples' order (what dit-eval --t2i reads), and the encoder."""
        return {"prompts": [self.prompts[int(k)] for k in self.ids], "text_encoder": dict(self.identity)}


def load_sampling_encoder(spec: str | None, recorded: dict[str, Any] | None, text_dim: int, ckpt: str,
                          device: torch.device) -> Any:
    """The text encoder of dit-sample --prompt: the one the checkpoint records (rebuilt from its identity and checked
    against it: common.text_encoders.from_identity), or --text-encoder: where the checkpoint records an encoder, it
    is loaded with the recorded max length and dtype and must be that encoder (a copy in another folder, or the
    hub's), compared as a changed folder is (issue 47: a T5 on a Qwen3-trained model sampled without a word, and
    the model's own encoder named again lost its max length); with no record (a release file), it is the one used.
    UserError when neither names one, or a width not the model's."""
    from dit_pipeline.common.text_encoders import from_identity, identity_problems, load_text_encoder

    identity = (recorded or {}).get("encoder") or {}
    if spec and identity.get("name"):
        encoder = load_text_encoder(spec, max_length=int(identity["max_length"]), device=device,
                                    dtype=identity.get("dtype"))
        problems = identity_problems(identity, encoder)
        if problems:
            raise UserError(f"--text-encoder {spec} is not the text encoder {ckpt} was trained with "
                            f"({identity['name']}): " + "; ".join(problems) + ". Drop --text-encoder to use the "
                            "recorded one, or pass that encoder")
    elif spec:
        encoder = load_text_encoder(spec, device=device)
    elif identity.get("name"):
        encoder = from_identity(identity, device=device, where=f"the checkpoint {ckpt}")
    else:
        raise UserError(f"--ckpt {ckpt} is a text-conditional model whose file records no text encoder (a release "
                        "file); pass --text-encoder (NanoGen's models: qwen3-0.6b), or name a NanoGen file's config: "
                        "--protocol nanogen/<config>")
    if int(encoder.dim) != int(text_dim):
        raise UserError(f"--text-encoder {spec or identity.get('name')}: its features are {encoder.dim} wide, the model "
                        f"takes {text_dim}; pass the encoder the model was trained with")
    return encoder
