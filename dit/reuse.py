"""Encoder-state reuse across neighbouring sampling steps (DDT, Wang et al. 2025, Sec. "encoder sharing"): a model
with an encoder/decoder split (`encode(x, t, y) -> s`, `decode(x, s)`: dit/ddt.py) recomputes its encoder only
every `every`-th network call and decodes the other calls with the last state, so a sampler pays one decoder
pass for those steps. DDT's release chooses the recompute steps by a dynamic programme over a probe run; this
wrapper recomputes uniformly (every k-th call), the release's `state_refresh_rate` without its schedule search.

`EncoderReuse(model, every)` is called like the model (forward, forward_with_cfg and the attributes samplers
read), so every sampler runs it unchanged; a call with another batch shape (guidance switched on or off by a
guidance interval) recomputes, since a state belongs to one batch. `every=1` is the model itself.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def can_reuse_encoder(model: nn.Module) -> bool:
    """Whether `model` has the encoder/decoder split this needs."""
    return callable(getattr(model, "encode", None)) and callable(getattr(model, "decode", None))


class EncoderReuse(nn.Module):
    """`model` with its encoder state reused for `every - 1` calls after each computed one (module docstring)."""

    def __init__(self, model: nn.Module, every: int):
        super().__init__()
        if not can_reuse_encoder(model):
            raise ValueError(f"{type(model).__name__} has no encoder/decoder split to reuse (encode/decode)")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive integer, got {every!r}")
        self.model: Any = model  # the wrapped model (encode / decode), typed loosely: any family with the split
        self.every = every
        self.calls, self.computed = 0, 0
        self._state: torch.Tensor | None = None
        self._shape: tuple[int, ...] | None = None

    def __getattr__(self, name: str) -> Any:  # num_classes, in_channels, input_size, learn_sigma, ...
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["model"], name)

    def reset(self) -> None:
        """Forget the state (a new batch of samples starts)."""
        self.calls, self._state, self._shape = 0, None, None

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        fresh = self._state is None or tuple(x.shape) != self._shape or self.calls % self.every == 0
        if fresh:
            self._state, self._shape = self.model.encode(x, t, y, **kwargs), tuple(x.shape)
            self.calls, self.computed = 0, self.computed + 1
        self.calls += 1
        assert self._state is not None
        return self.model.decode(x, self._state)

    def forward_with_cfg(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, cfg_scale: float | torch.Tensor,
                         guide_channels: int | str | None = 3) -> torch.Tensor:
        """The model's guidance with this forward (the shared DiffusionTransformer.forward_with_cfg)."""
        from .family import DiffusionTransformer

        return DiffusionTransformer.forward_with_cfg(self, x, t, y, cfg_scale,  # type: ignore[arg-type]
                                                     guide_channels=guide_channels)
