"""Encoder-state reuse across neighbouring sampling steps (DDT, Wang et al. 2025, Sec. "encoder sharing"): a model
with an encoder/decoder split (`encode(x, t, y) -> s`, `decode(x, s)`: dit/ddt.py) recomputes its encoder only
every `every`-th network call and decodes the other calls with the last state, so a sampler pays one decoder
pass for those steps. This is DDT's release sampler's `state_refresh_rate` K (MCG-NJU/DDT
src/diffusion/stateful_flow_matching/sampling.py l.88-92: the state is reset where the step index i % K == 0, and
its Euler sampler makes one network call per step); the release's paper also searches the recompute steps by a
dynamic programme over a probe run, which is not done here.

`EncoderReuse(model, every)` is called like the model (forward, forward_with_cfg and the attributes samplers
read), so every sampler runs it unchanged. A state belongs to the batch it was computed on: the release runs the
doubled [uncond; cond] batch at every step, also outside its guidance interval, and so does sample/generate.py
whenever the encoder is reused; a call with another batch shape before the next recompute is an error (it would
decode one batch with another's state). `reset()` starts a new batch of samples. `every=1` is the model itself.
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
        self.steps: list[int] = []  # the calls (since reset) whose encoder was computed
        self._state: torch.Tensor | None = None
        self._shape: tuple[int, ...] | None = None

    def __getattr__(self, name: str) -> Any:  # num_classes, in_channels, input_size, learn_sigma, ...
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["model"], name)

    def reset(self) -> None:
        """Forget the state (a new batch of samples starts)."""
        self.calls, self._state, self._shape, self.steps = 0, None, None, []

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if self._state is None or self.calls % self.every == 0:  # the release's i % state_refresh_rate == 0
            self._state, self._shape = self.model.encode(x, t, y, **kwargs), tuple(x.shape)
            self.computed += 1
            self.steps.append(self.calls)
        elif tuple(x.shape) != self._shape:
            raise ValueError(f"encoder reuse: call {self.calls} has a batch of shape {tuple(x.shape)} but the encoder "
                             f"state was computed on {self._shape}; a state belongs to one batch (run the doubled "
                             "batch at every step, as DDT's release does, or reset() for a new batch)")
        self.calls += 1
        assert self._state is not None
        return self.model.decode(x, self._state)

    def forward_with_cfg(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, cfg_scale: float | torch.Tensor,
                         guide_channels: int | str | None = 3) -> torch.Tensor:
        """The model's guidance with this forward (the shared DiffusionTransformer.forward_with_cfg)."""
        from .family import DiffusionTransformer

        return DiffusionTransformer.forward_with_cfg(self, x, t, y, cfg_scale,  # type: ignore[arg-type]
                                                     guide_channels=guide_channels)
