"""What a model is conditioned on besides its time input, as one registry: the class label, text tokens, or nothing.

(The time input itself, and MeanFlow's second time, are dit/conditions.py.) The trainer and the samplers ask the
model's `Conditioning` object for everything that depends on the condition and never read its name:

- `batch_kwargs(batch, drop, device)`: the model's keyword arguments for a training batch (an object with
  `labels`, or `text` and `text_mask`), the rows where `drop` [N] is 1 given the null condition (classifier-free
  guidance's condition dropout), `drop` itself as `force_drop_ids` (the label table drops there; a text model
  ignores it, its rows replaced already);
- `null(kwargs)`: the null condition of a batch (CFG's unconditional half), `concat(a, b)`: two batches joined
  along N (CFG's [cond; uncond]);
- `can_guide`, `describe()`; `model_config()`: what a checkpoint's model_config records ({} for class labels, so
  every file written before this registry reads as it did).

The three kinds:
- "class": `y` [N] int64; the null label is `num_classes` (the last row of the label table). Dropout goes through
  the network's own label table (`force_drop_ids`, DiT's LabelEmbedder), exactly as before this registry, so a
  class-conditional run draws and computes what it always did.
- "text": `text` [N, L, D] float (a text encoder's last hidden state, right-padded) and `text_mask` [N, L] bool
  (True = a real token). The null condition is the empty prompt's features (its tokens and mask: NanoGen encodes
  "" with the run's text encoder, End2End-Diffusion/diffusion-bench src/stage2/utils.py `get_null_cond`; Qwen3's
  tokenizer gives it no token at all). Dropout replaces features and mask of the dropped rows (the same file's
  `apply_cfg_dropout`: torch.where over every condition input). Batches of different lengths are joined by
  right-padding with zero features and False mask: padded keys are masked, so they change nothing.
- "none": no condition input; no guidance.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

CONDITIONINGS = ("class", "text", "none")
DEFAULT_CONDITIONING = "class"  # a model_config without "conditioning" (every file before this registry)

Kwargs = dict[str, Any]


class ClassLabels:
    """Class labels with the null label `num_classes` (module docstring)."""

    name = "class"

    def __init__(self, num_classes: int, dropout_prob: float):
        self.num_classes, self.dropout_prob = int(num_classes), float(dropout_prob)

    @property
    def can_guide(self) -> bool:
        return self.dropout_prob > 0

    def describe(self) -> str:
        return f"{self.num_classes} classes"

    def describe_null(self) -> str:
        return f"the null label {self.num_classes}"

    def model_config(self) -> dict[str, Any]:
        return {}

    def batch_kwargs(self, batch: Any, drop: torch.Tensor | None, device: torch.device) -> Kwargs:
        return {"y": batch.labels.to(device, non_blocking=True), "force_drop_ids": drop}

    def null(self, kwargs: Mapping[str, Any]) -> Kwargs:
        return {"y": torch.full_like(kwargs["y"], self.num_classes)}

    def concat(self, a: Mapping[str, Any], b: Mapping[str, Any]) -> Kwargs:
        return {"y": torch.cat([a["y"], b["y"]])}

    def take(self, kwargs: Mapping[str, Any], index: Any) -> Kwargs:
        return {"y": kwargs["y"][index]}


class TextTokens:
    """Text features and their padding mask; the null condition is the empty prompt's (module docstring).
    `null_text` [L0, D] and `null_mask` [L0] are the run's (the shard set's, a checkpoint's or the text encoder's
    encoding of ""); None where no null is needed (a model without guidance or dropout)."""

    name = "text"

    def __init__(self, dim: int, null_text: torch.Tensor | None = None, null_mask: torch.Tensor | None = None):
        self.dim = int(dim)
        if (null_text is None) != (null_mask is None):
            raise ValueError("the empty prompt's features need both tokens and mask")
        if null_text is not None and null_mask is not None:
            if null_text.dim() != 2 or null_text.shape[1] != self.dim or null_mask.shape != null_text.shape[:1]:
                raise ValueError(f"the empty prompt's features must be [L, {self.dim}] with a mask [L], got "
                                 f"{list(null_text.shape)} and {list(null_mask.shape)}")
            # in the encoder's dtype, as the batches' features (bfloat16 for Qwen3: NanoGen's precision)
            null_text, null_mask = null_text if null_text.is_floating_point() else null_text.float(), null_mask.bool()
        self.null_text, self.null_mask = null_text, null_mask

    @property
    def can_guide(self) -> bool:
        return self.null_text is not None

    def describe(self) -> str:
        return f"text features of width {self.dim}"

    def describe_null(self) -> str:
        return "the empty prompt's features"

    def model_config(self) -> dict[str, Any]:
        return {"conditioning": self.name, "text_dim": self.dim}

    def _null_rows(self, n: int, device: torch.device, dtype: torch.dtype | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.null_text is None or self.null_mask is None:
            raise ValueError("this text conditioning has no null condition (the empty prompt's features); build it "
                             "with null_text and null_mask")
        return (self.null_text.to(device, dtype or self.null_text.dtype)[None].expand(n, -1, -1),
                self.null_mask.to(device)[None].expand(n, -1))

    def batch_kwargs(self, batch: Any, drop: torch.Tensor | None, device: torch.device) -> Kwargs:
        # the stored dtype (bfloat16 for Qwen3) reaches the network unwidened (issue 44 item 6: NanoGen's RMSNorm
        # rounds its bfloat16 input's norm back to bfloat16; widening first changed a text model's output by 2.7e-4)
        text = batch.text.to(device, non_blocking=True)
        text = text if text.is_floating_point() else text.float()
        mask = batch.text_mask.to(device, non_blocking=True).bool()
        check_text(text, mask, self.dim)
        if drop is None:
            return {"text": text, "text_mask": mask}
        null_text, null_mask = self._null_rows(text.shape[0], device, text.dtype)
        (text, mask), (null_text, null_mask) = pad_pair((text, mask), (null_text, null_mask))
        rows = drop.to(device).bool()
        # force_drop_ids: which rows hold the empty prompt now; the network ignores it (the rows are replaced), an
        # objective whose target treats dropped rows apart reads it (MeanFlow's guided velocity, dit/meanflow.py)
        return {"text": torch.where(rows[:, None, None], null_text, text),
                "text_mask": torch.where(rows[:, None], null_mask, mask), "force_drop_ids": drop}

    def null(self, kwargs: Mapping[str, Any]) -> Kwargs:
        text, mask = self._null_rows(kwargs["text"].shape[0], kwargs["text"].device, kwargs["text"].dtype)
        return {"text": text, "text_mask": mask}

    def concat(self, a: Mapping[str, Any], b: Mapping[str, Any]) -> Kwargs:
        (ta, ma), (tb, mb) = pad_pair((a["text"], a["text_mask"]), (b["text"], b["text_mask"]))
        return {"text": torch.cat([ta, tb]), "text_mask": torch.cat([ma, mb])}

    def take(self, kwargs: Mapping[str, Any], index: Any) -> Kwargs:
        return {"text": kwargs["text"][index], "text_mask": kwargs["text_mask"][index]}


class NoCondition:
    """Unconditional: nothing but the time reaches the network."""

    name = "none"
    can_guide = False

    def describe(self) -> str:
        return "unconditional"

    def describe_null(self) -> str:
        return "nothing"

    def model_config(self) -> dict[str, Any]:
        return {"conditioning": self.name}

    def batch_kwargs(self, batch: Any, drop: torch.Tensor | None, device: torch.device) -> Kwargs:
        return {}

    def null(self, kwargs: Mapping[str, Any]) -> Kwargs:
        raise ValueError("an unconditional model has no null condition to guide against")

    def concat(self, a: Mapping[str, Any], b: Mapping[str, Any]) -> Kwargs:
        return {}

    def take(self, kwargs: Mapping[str, Any], index: Any) -> Kwargs:
        return {}


Conditioning = ClassLabels | TextTokens | NoCondition


def conditioning_of(config: Mapping[str, Any], null_text: torch.Tensor | None = None,
                    null_mask: torch.Tensor | None = None) -> Conditioning:
    """The conditioning a model_config records (absent: class labels); a text model's null condition is the
    given empty-prompt features."""
    kind = kind_of(config)
    if kind == "class":
        return ClassLabels(int(config["num_classes"]), float(config.get("class_dropout_prob", 0.0)))
    if kind == "text":
        return TextTokens(int(config["text_dim"]), null_text, null_mask)
    return NoCondition()


def kind_of(config: Mapping[str, Any]) -> str:
    kind = str(config.get("conditioning", DEFAULT_CONDITIONING))
    if kind not in CONDITIONINGS:
        raise ValueError(f"unknown conditioning {kind!r}; known: {', '.join(CONDITIONINGS)}")
    return kind


def check_text(text: torch.Tensor, mask: torch.Tensor, dim: int) -> None:
    """ValueError unless text is [N, L, dim] and mask [N, L]."""
    if text.dim() != 3 or text.shape[2] != dim:
        raise ValueError(f"text features must be [N, L, {dim}], got {list(text.shape)}")
    if tuple(mask.shape) != tuple(text.shape[:2]):
        raise ValueError(f"text_mask must be [N, L] = {list(text.shape[:2])}, got {list(mask.shape)}")


def pad_text(text: torch.Tensor, mask: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad [N, L, D] features and their [N, L] mask to `length` tokens (zeros, False)."""
    extra = length - text.shape[1]
    if extra <= 0:
        return text, mask
    return (torch.cat([text, text.new_zeros(text.shape[0], extra, text.shape[2])], dim=1),
            torch.cat([mask, mask.new_zeros(mask.shape[0], extra)], dim=1))


def pad_pair(a: tuple[torch.Tensor, torch.Tensor],
             b: tuple[torch.Tensor, torch.Tensor]) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                                             tuple[torch.Tensor, torch.Tensor]]:
    """Two (features, mask) pairs right-padded to the longer one's length."""
    length = max(a[0].shape[1], b[0].shape[1])
    return pad_text(*a, length), pad_text(*b, length)
