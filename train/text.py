"""The condition a run trains on, from its model and its shard set (dit/conditioning.py), and its text features.

- `text_set(manifest)`: what a shard set with text features offers (contract of the captioned shards): the text
  encoder's identity, the width and the longest caption of its features, and the empty prompt's features, which are
  the null condition of caption dropout and of guidance. None for a set without text features.
- `run_conditioning(model, manifest)`: the model's `Conditioning`, a text model's with the set's empty prompt.
- `BatchText`: what turns a training batch into the features the conditioning reads: the cached ones as they are,
  or (`--text-features online`) the batch's captions encoded by the set's text encoder (common/text_encoders.py).
- `TextPart`: the checkpoint key `text` of a text-conditional run: the encoder's identity, how the features were
  made, and the empty prompt's features; a resume must use the same encoder.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, NamedTuple

import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.dit.conditioning import Conditioning

TEXT_FEATURES = ("cached", "online")  # --text-features: from the shards, or encoded from the captions while training


@dataclass(frozen=True)
class TextSet:
    """The text side of a captioned shard set (module docstring)."""

    identity: dict[str, Any]  # the text encoder's (common/text_encoders.py TextEncoder.identity)
    null_text: torch.Tensor   # [L0, D] float32: the empty prompt's features
    null_mask: torch.Tensor   # [L0] bool
    dim: int
    max_length: int           # the encoder's token limit: the longest caption's features

    def record(self, features: str) -> dict[str, Any]:
        return {"encoder": dict(self.identity), "features": features, "null_text": self.null_text.clone(),
                "null_mask": self.null_mask.clone()}


def text_set(manifest: Any) -> TextSet | None:
    """The text side of `manifest`, None when its samples carry no text features. The manifest exposes the encoder's
    identity as `text_encoder` and the empty prompt's features as `empty_prompt` ((tokens [L0, D], mask [L0]))."""
    identity = getattr(manifest, "text_encoder", None)
    if not identity:
        return None
    tokens, mask = manifest.empty_prompt
    tokens, mask = torch.as_tensor(tokens, dtype=torch.float32), torch.as_tensor(mask, dtype=torch.bool)
    dim = int(identity.get("dim", tokens.shape[-1]))
    return TextSet(dict(identity), tokens.reshape(-1, dim), mask.reshape(-1), dim,
                   int(identity.get("max_length") or 0))


def run_conditioning(model: Any, manifest: Any) -> Conditioning:
    """The conditioning the trainer asks (dit/conditioning.py): the model's, with the shard set's empty prompt as
    the null condition of a text model."""
    text = text_set(manifest)
    return model.conditioning() if text is None else model.conditioning(text.null_text, text.null_mask)


class TextBatch(NamedTuple):
    """The features of a batch's captions (what TextTokens.batch_kwargs reads)."""

    text: torch.Tensor       # [B, L, D] float32, right-padded
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
            features = self.encoder.encode(list(captions))
        return TextBatch(features.tokens.float(), features.mask.bool())


def online_encoder(text: TextSet, device: torch.device) -> Any:
    """The shard set's text encoder (common/text_encoders.py, rebuilt from its identity) for --text-features online."""
    try:
        from dit_pipeline.common.text_encoders import load_text_encoder  # type: ignore[import-not-found]
    except ImportError:
        raise UserError("--text-features online needs the text encoders (dit_pipeline.common.text_encoders)") from None
    return load_text_encoder(text.identity["name"], max_length=text.max_length or None, device=str(device))


@dataclass
class TextPart:
    """`text`: a text-conditional run's encoder identity, feature mode and empty-prompt features (absent for every
    other run). A checkpoint and a run must agree on having it and on the encoder."""

    record: dict[str, Any] | None
    keys: ClassVar[tuple[str, ...]] = ("text",)
    required: ClassVar[tuple[str, ...]] = ()
    ignored: ClassVar[tuple[str, ...]] = ("path", "source_given", "dtype")  # where it was read, not what it is

    def state_dict(self) -> dict[str, Any]:
        return {} if self.record is None else {"text": self.record}

    def check(self, ckpt: Mapping[str, Any], where: str) -> None:
        saved = ckpt.get("text")
        if (saved is None) != (self.record is None):
            what = "text features" if saved is not None else "class labels"
            raise UserError(f"checkpoint {where} was trained on {what}; this run's shard set gives "
                            f"{'class labels' if saved is not None else 'text features'}. Pass the --shards it was "
                            "trained on, or a new --run-dir.")
        if saved is None or self.record is None:
            return
        theirs, mine = saved.get("encoder") or {}, self.record["encoder"]
        changed = sorted(k for k in set(theirs) | set(mine) if k not in self.ignored and theirs.get(k) != mine.get(k))
        if changed:
            raise UserError(f"checkpoint {where} was trained with the text encoder {theirs.get('name')!r} "
                            f"({', '.join(f'{k} {theirs.get(k)!r}' for k in changed)}); this run's is "
                            f"{mine.get('name')!r} ({', '.join(f'{k} {mine.get(k)!r}' for k in changed)}). Use the "
                            "shard set and encoder it was trained with, or a new --run-dir.")

    def load_state_dict(self, ckpt: Mapping[str, Any]) -> None:
        return None
