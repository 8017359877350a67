"""REG (Representation Entanglement for Generation; Wu et al. 2025, arXiv:2507.01467) as NanoGen trains and samples
it (End2End-Diffusion/diffusion-bench, the `reg0.03` configs): the math beside the network, pure tensors.

A frozen encoder's class token (NanoGen's `target_encoder: dinov2-vit-b`: DINOv2-B with registers, its final norm
without affine, `x_norm_clstoken`) is generated together with the image. NanoGen's facts, in its time (t = 1 noise):
- training (src/stage2/transport/transport.py l.54-59, l.89-92): the class token is noised with the image's t and
  noise of its own, cls_t = (1 - t) cls + t eps', its target made by the image's formula, (cls_t - cls) /
  max(t, t_eps); the network (dit/incontext.py, `reg_dim`) takes cls_t and predicts it (`convert_model_pred`: as the
  image's prediction); loss_reg = reg_coeff x mse over the batch and the token's width, added to the image loss
  (src/stage2/engine.py l.155-160). Here, in SiT's time (t = 1 data), the same: cls_t = t cls + (1 - t) eps', the
  velocity and target through the flow objective's prediction (dit/flow_predictions.py), the term `reg` [N] (the token's
  velocity MSE per sample, whose batch mean is NanoGen's mse) and loss = image loss + reg_coeff x reg. NanoGen
  logs reg_coeff x mse as train/loss_reg.
- sampling (src/stage2/transport/sampler.py l.20-32, src/eval/generation.py l.160-162): the token starts as N(0, I)
  of width z (drawn after the image noise) and is integrated by the image's Euler steps with its own predicted
  velocity; guidance (src/utils/guidance_utils.py) guides it with the image's scale where the image is guided.
  Here the image and the token travel as one packed state [N, C H W + z] (`pack`, `unpack`, `packed_model_fn`), so
  every flow sampler of dit/flow_samplers.py integrates both unchanged; the network sees them apart.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

REG_COEFF = 0.03  # NanoGen's RepaConfig.reg_coeff and every reg0.03 config
# The flow objective's model_kwargs that carry a batch's clean class tokens and their noise (dit/flow.py)
REG_TARGET, REG_NOISE = "reg_target", "reg_noise"


def split_outputs(out: Any, *, base: bool, reg: bool) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                    torch.Tensor | None]:
    """(out, base or None, cls_pred or None) of a network output: a tensor, or NanoGen's tuple (out[, base][, cls])
    of what was asked for (dit/incontext.py)."""
    if not base and not reg:
        return out, None, None
    if not isinstance(out, tuple) or len(out) != 1 + int(base) + int(reg):
        raise ValueError(f"the network was asked for {'the base head' if base else ''}"
                         f"{' and ' if base and reg else ''}{'the class token' if reg else ''} but returned "
                         f"{type(out).__name__}")
    return out[0], out[1] if base else None, out[-1] if reg else None


def pack(x: torch.Tensor, cls: torch.Tensor) -> torch.Tensor:
    """The sampler's state: image [N, C, H, W] and class token [N, z] -> [N, C H W + z]."""
    return torch.cat([x.reshape(x.shape[0], -1), cls.to(x.dtype)], dim=1)


def unpack(z: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, C H W + z] -> (image [N, *shape], class token [N, z])."""
    n = 1
    for s in shape:
        n *= int(s)
    return z[:, :n].reshape(z.shape[0], *shape), z[:, n:]


def packed_model_fn(fn: Callable[..., Any], shape: tuple[int, ...]) -> Callable[..., torch.Tensor]:
    """A network function of the packed state: fn(x, t, cls_t=token, **kwargs) -> (out, cls_pred) becomes
    f(z, t, **kwargs) -> pack(out's first C channels, cls_pred), for the flow samplers (module docstring). The
    attributes of `fn` (the grid-time flag of dit/flow_samplers.py) carry over."""
    channels = int(shape[0])

    def f(z: torch.Tensor, t: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        x, token = unpack(z, shape)
        out, cls_pred = fn(x, t, cls_t=token, **kwargs)
        return pack(out[:, :channels], cls_pred)

    f.__dict__.update(getattr(fn, "__dict__", {}))
    return f


def initial_token(generators: Any, dim: int, device: torch.device) -> torch.Tensor:
    """[B, z] N(0, I), row b from generators[b] (after its image noise: NanoGen's cls_init)."""
    rows = [torch.randn((dim,), generator=g, device=g.device, dtype=torch.float32) for g in generators]
    return torch.stack(rows).to(device)
