"""What every family's `infer_config` shares: reading a model_config back from a file's tensor shapes.

The shapes give widths, depths, patch and channel counts; they never give the attention head count, which comes
from (in this order) a stored model_config, the head width a QK-norm weight or a RoPE table shows, or the one
preset of these dimensions; otherwise the file is refused with the flag that supplies it. Pure functions of
dicts; `WeightsError` is the error every weight-file problem raises (dit.weights re-exports it).
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

import torch

HEADS_FLAG = "--num-heads"  # dit-sample / dit-sample export: the head count of a file that does not state it


class WeightsError(ValueError):
    """A weight file that cannot be used: unreadable, unsafe, or not a matching DiT."""


Shapes = dict[str, tuple[int, ...]]


def shapes_of(state_dict: Mapping[str, torch.Tensor]) -> Shapes:
    return {k: tuple(v.shape) for k, v in state_dict.items()}


def require(shapes: Shapes, keys: Iterable[str], what: str, where: str) -> None:
    for key in keys:
        if key not in shapes:
            raise WeightsError(f"{where}: not a {what} state_dict (no {key!r}; keys start with {sorted(shapes)[:5]})")


def block_count(shapes: Shapes, prefix: str = "blocks") -> int:
    """How many `prefix.<i>.` blocks the keys hold."""
    return len({m.group(1) for k in shapes if (m := re.match(rf"{prefix}\.(\d+)\.", k))})


def classes(rows: int, stored: Mapping[str, Any] | None, where: str) -> tuple[int, float]:
    """(num_classes, class_dropout_prob) of a label table with `rows` rows: a stored num_classes decides whether
    the last row is the null class; without one the null row is assumed (every released and trained model has
    it) with DiT's dropout 0.1."""
    stored = stored or {}
    num_classes = stored.get("num_classes")
    if num_classes is None:
        return rows - 1, float(stored.get("class_dropout_prob", 0.1) or 0.1)
    if rows == num_classes:
        return int(num_classes), 0.0  # no null row: the model was built without class dropout
    if rows != num_classes + 1:
        raise WeightsError(f"{where}: label table has {rows} rows but the stored config says {num_classes} classes")
    dropout = stored.get("class_dropout_prob")
    return int(num_classes), float(dropout) if dropout else 0.1


def check_stored(config: Mapping[str, Any], stored: Mapping[str, Any] | None, keys: Iterable[str],
                 where: str) -> None:
    """WeightsError when a stored model_config contradicts what the tensors show."""
    for key in keys:
        if stored and key in stored and stored[key] is not None and stored[key] != config[key]:
            raise WeightsError(f"{where}: model_config says {key}={stored[key]!r} but the weights have "
                               f"{key}={config[key]!r}")


def head_width(shapes: Shapes, keys: Iterable[str]) -> int | None:
    """The head width a per-head tensor shows: a QK-norm weight [head_dim] or a RoPE table [T, head_dim]."""
    for key in keys:
        if key in shapes and shapes[key]:
            return int(shapes[key][-1])
    return None


def heads(hidden: int, shapes: Shapes, keys: Iterable[str], stored: int | None, preset: int | None,
          where: str, what: str, hint: int | None = None) -> int:
    """The attention head count of a stage of width `hidden`: stored, else shown by a per-head tensor, else the
    preset's, else the caller's `hint` (--num-heads); WeightsError naming the flag otherwise."""
    if stored is not None:
        return int(stored)
    width = head_width(shapes, keys)
    if width and hidden % width == 0:
        return hidden // width
    if preset is not None:
        return preset
    if hint is not None:
        return int(hint)
    raise WeightsError(f"{where}: {what} and the file has no model_config, so the number of attention heads is "
                       f"unknown; pass {HEADS_FLAG} (or a JSON sidecar with the model_config beside the file)")
