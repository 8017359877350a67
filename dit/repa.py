"""Representation alignment (REPA; Yu et al. 2024, "Representation Alignment for Generation: Training
Diffusion Transformers Is Easier Than You Think", arXiv:2410.06940): the model side, pure math.

A projector MLP maps the DiT's token hidden state after block `encoder_depth` to the feature width of a
frozen teacher (DINOv2 ViT-B/14: 768); the projection loss is the negative cosine similarity between the
projected tokens and the teacher's normalized patch tokens, averaged over tokens, samples and teachers;
the training loss is the denoising loss + `proj_coeff` x the projection loss. Facts as in the paper and
its code (sihyun-yu/REPA, docs/REFERENCE.md "REPA"):

- projector per teacher: Linear(hidden, 2048) - SiLU - Linear(2048, 2048) - SiLU - Linear(2048, z_dim),
  applied to every token; REPA builds it inside its SiT, so the SiT's init (xavier-uniform weights, zero
  biases for every Linear) covers it, not torch's default Linear init. Ours is initialised the same way.
- projection loss of one sample: mean over tokens of -<z / |z|, p / |p|> (F.normalize on both, eps 1e-12);
  the batch value is the mean over samples and teachers. encoder_depth 8 and proj_coeff 0.5 in every
  published run.

Parameter names: a `Projector`'s state_dict is `0.weight, 0.bias, 2.*, 4.*` (the Linear layers of the
Sequential), i.e. REPA's `projectors.<i>.*` without the `projectors.<i>.` prefix; `REPAModel` holds the DiT as
`dit` and the projectors as `projectors`, and `repa_layout` / `split_repa_layout` convert its state_dict to and
from the layout of REPA's SiT and its released checkpoint (DiT names at the top, `projectors.<i>.<j>.*`).
Wrapping (DDP, autocast, compile) is applied from outside, as for the DiT itself.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Sequence, cast

import torch
import torch.nn.functional as F
from torch import nn

from .family import DiffusionTransformer

PROJECTOR_DIM = 2048
TEACHER_DIM = 768          # DINOv2 ViT-B/14's feature width
ENCODER_DEPTH = 8          # the block whose output is aligned, in every published REPA run
PROJ_COEFF = 0.5           # weight of the projection loss
PROJECTOR_KEY = re.compile(r"^projectors\.(\d+)\.(\d+)\.(weight|bias)$")


class Projector(nn.Sequential):
    """[..., hidden] -> [..., z_dim]: Linear - SiLU - Linear - SiLU - Linear, REPA's `build_mlp`."""

    def __init__(self, hidden_size: int, z_dim: int = TEACHER_DIM, projector_dim: int = PROJECTOR_DIM):
        super().__init__(nn.Linear(hidden_size, projector_dim), nn.SiLU(), nn.Linear(projector_dim, projector_dim),
                         nn.SiLU(), nn.Linear(projector_dim, z_dim))
        self.z_dim, self.projector_dim = int(z_dim), int(projector_dim)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """REPA's init: xavier-uniform weights and zero biases (its SiT's init applied to every Linear)."""
        for layer in self:
            if isinstance(layer, nn.Linear) and layer.bias is not None:
                nn.init.xavier_uniform_(layer.weight)
                nn.init.zeros_(layer.bias)


class REPAModel(nn.Module):
    """A DiT and its projectors as one module (one DDP wrapper, one optimizer): forward -> (out, zs), zs[i] the
    projection for teacher i, [N, T, z_dims[i]], of the tokens after block `encoder_depth`."""

    def __init__(self, dit: DiffusionTransformer, *, encoder_depth: int = ENCODER_DEPTH,
                 z_dims: Sequence[int] = (TEACHER_DIM,), projector_dim: int = PROJECTOR_DIM):
        super().__init__()
        if isinstance(encoder_depth, bool) or not isinstance(encoder_depth, int) \
                or not 1 <= encoder_depth <= dit.num_blocks:
            raise ValueError(f"encoder_depth must be in 1..{dit.num_blocks} (the DiT's depth), got "
                             f"{encoder_depth!r}")
        if not z_dims or any(int(z) < 1 for z in z_dims):
            raise ValueError(f"z_dims must list one positive feature width per teacher, got {list(z_dims)}")
        self.dit = dit
        self.encoder_depth = int(encoder_depth)
        width = dit.hidden_size_at(self.encoder_depth)  # the tokens' width after the aligned block
        self.projectors = nn.ModuleList(Projector(width, int(z), projector_dim) for z in z_dims)

    @property
    def config(self) -> dict[str, Any]:
        """JSON-able description of the alignment head (the DiT's own is `self.dit.config`)."""
        projectors = cast("list[Projector]", list(self.projectors))
        return {"encoder_depth": self.encoder_depth, "z_dims": [p.z_dim for p in projectors],
                "projector_dim": projectors[0].projector_dim}

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None,
                force_drop_ids: torch.Tensor | None = None, generator: torch.Generator | None = None,
                **condition: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
        out, hidden = self.dit(x, t, y, force_drop_ids, generator, return_hidden=self.encoder_depth, **condition)
        return out, [projector(hidden) for projector in self.projectors]

    def dit_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The DiT's own forward, called through this module: where FSDP2 shards this module as the root unit, the
        DiT's embeddings and final layer are gathered only in a forward of the root (train/parallel.py registers this
        method as one), so a pass of the DiT alone, outside training (the validation loss), runs through here."""
        return self.dit(*args, **kwargs)

    def dit_forward_with_cfg(self, *args: Any, **kwargs: Any) -> Any:
        """The DiT's guided forward (a sampler's: the training run's sample grids and FID) called through this
        module, for the reason `dit_forward` gives."""
        return self.dit.forward_with_cfg(*args, **kwargs)


def projector_macs(config: dict[str, Any], hidden_size: int, tokens: int) -> int:
    """Multiply-accumulates of the projectors' forward for one image (REPAModel.config; tokens = T)."""
    width = int(config["projector_dim"])
    return sum(tokens * (hidden_size * width + width * width + width * int(z)) for z in config["z_dims"])


def repa_layout(model: REPAModel) -> dict[str, torch.Tensor]:
    """The state_dict in REPA's layout: the DiT's official names plus `projectors.<i>.<j>.(weight|bias)`."""
    out = dict(model.dit.state_dict())
    out.update({f"projectors.{k}": v for k, v in model.projectors.state_dict().items()})
    return out


def split_repa_layout(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor],
                                                                     dict[str, torch.Tensor]]:
    """(DiT state_dict, projectors state_dict with keys `<i>.<j>.*`) of a REPA-layout state_dict."""
    dit_part = {k: v for k, v in state_dict.items() if not k.startswith("projectors.")}
    proj = {k[len("projectors."):]: v for k, v in state_dict.items() if k.startswith("projectors.")}
    return dit_part, proj


def projection_loss(targets: Sequence[torch.Tensor], predictions: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-sample REPA projection loss [N]: mean over teachers and tokens of -cos(target, prediction).

    targets[i], predictions[i]: [N, T, D_i] (teacher features and projector outputs); computed in float32.
    The batch loss REPA optimises is this vector's mean.
    """
    if len(targets) != len(predictions) or not targets:
        raise ValueError(f"projection_loss needs one prediction per teacher: {len(targets)} teacher feature "
                         f"tensors, {len(predictions)} projections")
    per_teacher = []
    with torch.autocast(targets[0].device.type, enabled=False):  # the cosine in float32 whatever the autocast
        for i, (z, p) in enumerate(zip(targets, predictions)):
            per_teacher.append(_negative_cosine(i, z, p))
    return torch.stack(per_teacher).mean(dim=0)


def _negative_cosine(i: int, z: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """[N]: mean over tokens of -cos(z, p), in float32 (F.normalize in fp16 gave NaN in REPA #46)."""
    if z.dim() != 3 or z.shape != p.shape:
        raise ValueError(f"teacher {i}: features {list(z.shape)} and projection {list(p.shape)} must both be "
                         "[N, T, D] with the same sizes (same batch, token count and width)")
    cos = (F.normalize(z.float(), dim=-1) * F.normalize(p.float(), dim=-1)).sum(dim=-1)  # [N, T]
    return -cos.mean(dim=1)


def training_losses(objective: Any, model: Callable[..., tuple[torch.Tensor, list[torch.Tensor]]],
                    x_start: torch.Tensor, t: torch.Tensor, targets: Sequence[torch.Tensor],
                    model_kwargs: dict[str, Any] | None = None, noise: torch.Tensor | None = None,
                    proj_coeff: float = PROJ_COEFF) -> dict[str, torch.Tensor]:
    """The objective's per-sample terms with REPA's added: {"loss", "mse" (, "vb"), "proj"}, each [N];
    loss = the objective's loss + proj_coeff * proj (so the batch mean is REPA's total).

    `objective`: dit.FlowMatching or dit.GaussianDiffusion (its training_losses calls the model once);
    `model`: a REPAModel (or anything called like one, e.g. its DDP wrapper) returning (out, zs);
    `targets`: the teachers' features for the same samples (common.teacher.Teacher), one per projector.
    """
    captured: list[list[torch.Tensor]] = []

    def net(x: torch.Tensor, tt: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        out, zs = model(x, tt, **kwargs)
        captured.append(zs)
        return out

    terms = objective.training_losses(net, x_start, t, model_kwargs, noise=noise)
    if len(captured) != 1:
        raise RuntimeError(f"the objective called the model {len(captured)} times; REPA needs exactly one pass")
    proj = projection_loss(targets, captured[0])
    return {**terms, "loss": terms["loss"] + float(proj_coeff) * proj, "proj": proj}
