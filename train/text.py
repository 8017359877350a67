"""The condition a run trains on, from its model and its text set (dit/conditioning.py), and its text features.

- `open_text_set(manifest, folder)`: a text set (`dit-extract --text-encoder`, a sibling of the training shards
  made from their captions; `dit-train --text FOLDER`): its encoder's identity, the width and the longest caption
  of its features, and the empty prompt's features (`Manifest.null_text()`, every token real), the null condition
  of caption dropout and of guidance.
- `run_conditioning(model, text)`: the model's `Conditioning`, a text model's with the set's empty prompt.
- `BatchText`: what turns a training batch into the features the conditioning reads: the cached features the
  loader joined from the text set (`Batch.text`, `Batch.text_mask`) as they are, or (`--text-features online`) the
  batch's drawn captions (`Batch.captions`) encoded by the text set's encoder (common.text_encoders.from_identity:
  refused when what loads is another encoder) into the same layout (`TextFeatures.as_batch`).
- `TextPart`: the checkpoint key `text` of a text-conditional run: the encoder's identity, how the features were
  made, and the empty prompt's features; a resume must use the same encoder.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, NamedTuple

import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.dit.conditioning import Conditioning

TEXT_FEATURES = ("cached", "online")  # --text-features: from the text set, or the captions encoded while training


@dataclass(frozen=True)
class TextSet:
    """A text set's side of a run (module docstring)."""

    identity: dict[str, Any]  # the text encoder's (common/text_encoders.py TextEncoder.identity)
    null_text: torch.Tensor   # [L0, D] in the set's stored dtype (the encoder's): the empty prompt's features
    null_mask: torch.Tensor   # [L0] bool
    dim: int
    max_length: int           # the encoder's token limit: the longest caption's features
    folder: str = ""          # where the text set is (--text)
    manifest: Any = None      # its shards.Manifest (the loader reads its shards beside the training shards')

    def record(self, features: str) -> dict[str, Any]:
        return {"encoder": dict(self.identity), "features": features, "null_text": self.null_text.clone(),
                "null_mask": self.null_mask.clone()}


def open_text_set(manifest: Any, folder: str = "") -> TextSet:
    """The text side of a text set's manifest (its `text_encoder` identity and `null_text()`)."""
    from dit_pipeline.common.text_encoders import DTYPES

    identity = dict(manifest.text_encoder)
    # stored values, exact in float32, back in the stored dtype: the batches' features come in it (train/data.py)
    null = torch.as_tensor(manifest.null_text(), dtype=torch.float32).to(DTYPES[manifest.dtype])
    dim = int(identity.get("dim") or null.shape[-1])
    null = null.reshape(-1, dim)
    return TextSet(identity, null, torch.ones(null.shape[0], dtype=torch.bool), dim,
                   int(identity.get("max_length") or 0), str(folder), manifest)


def run_conditioning(model: Any, text: TextSet | None) -> Conditioning:
    """The conditioning the trainer asks (dit/conditioning.py): the model's, with the text set's empty prompt as
    the null condition of a text model."""
    return model.conditioning() if text is None else model.conditioning(text.null_text, text.null_mask)


class TextBatch(NamedTuple):
    """The features of a batch's captions (what TextTokens.batch_kwargs reads)."""

    text: torch.Tensor       # [B, L, D] in the encoder's dtype, zero past each caption's length
    text_mask: torch.Tensor  # [B, L] bool


class BatchText:
    """batch -> the object the conditioning reads: the batch itself (labels, or its cached text features), or with
    an encoder its captions' features (online)."""

    def __init__(self, encoder: Any | None = None):
        self.encoder = encoder

    def __call__(self, batch: Any) -> Any:
        if self.encoder is None:
            return batch
        captions = getattr(batch, "captions", None)
        if captions is None:
            raise UserError("--text-features online needs the captions in the batches; this shard set's loader gives "
                            "none (extract it with its captions)")
        with torch.no_grad():
            text, mask = self.encoder.encode(list(captions)).as_batch()  # the encoder's dtype, as cached
        return TextBatch(text, mask)


def online_encoder(text: TextSet, device: torch.device) -> Any:
    """The text set's encoder (common/text_encoders.py, rebuilt from its identity and checked against it) for
    --text-features online."""
    from dit_pipeline.common.text_encoders import from_identity

    return from_identity(text.identity, device=device, where=f"--text {text.folder}")


@dataclass
class TextPart:
    """`text`: a text-conditional run's encoder identity, feature mode and empty-prompt features (absent for every
    other run). A checkpoint and a run must agree on having it and on the encoder (cached and online features of
    one encoder are the same features)."""

    record: dict[str, Any] | None
    keys: ClassVar[tuple[str, ...]] = ("text",)
    required: ClassVar[tuple[str, ...]] = ()
    # what decides the features (common.text_encoders.identity_problems), and the release's revision
    compared: ClassVar[tuple[str, ...]] = ("family", "class", "max_length", "hidden_state", "dim", "dtype",
                                           "weights_sha256", "revision", "tokenizer")

    def state_dict(self) -> dict[str, Any]:
        return {} if self.record is None else {"text": self.record}

    def check(self, ckpt: Mapping[str, Any], where: str) -> None:
        saved = ckpt.get("text")
        if (saved is None) != (self.record is None):
            what = "text features" if saved is not None else "class labels"
            raise UserError(f"checkpoint {where} was trained on {what}; this run's shard set gives "
                            f"{'class labels' if saved is not None else 'text features'}. Pass the --shards (and "
                            "--text) it was trained on, or a new --run-dir.")
        if saved is None or self.record is None:
            return
        theirs, mine = saved.get("encoder") or {}, self.record["encoder"]
        changed = [k for k in self.compared if theirs.get(k) != mine.get(k)]
        if changed:
            raise UserError(f"checkpoint {where} was trained with the text encoder {theirs.get('name')!r} "
                            f"({', '.join(f'{k} {theirs.get(k)!r}' for k in changed)}); this run's is "
                            f"{mine.get('name')!r} ({', '.join(f'{k} {mine.get(k)!r}' for k in changed)}). Use the "
                            "text set and encoder it was trained with, or a new --run-dir.")

    def load_state_dict(self, ckpt: Mapping[str, Any]) -> None:
        return None
