"""PixelGen's perceptual losses on an x-predicting model's clean image (NanoGen, End2End-Diffusion/diffusion-bench
src/stage2/perceptual_loss.py and configs/stage2/training/imagenet/pixelgen-...-0.1lpips-0.01pdino-thresh0.7.yaml):
LPIPS and a DINOv2 feature distance between the predicted and the true image, each per sample, weighted (0.1 and
0.01) and counted only where the noise level is below 0.7; dit.flow.FlowMatching adds them to its loss
(`x_terms`). Their networks come from files users supply; nothing is downloaded.

LPIPS (Zhang et al. 2018, the `lpips` package's v0.1 "vgg", as NanoGen's stage1/disc/lpips.py computes it):
the inputs in [-1, 1] shifted by (-.030, -.088, -.188) and scaled by (.458, .448, .450), torchvision's VGG16
`features` up to relu1_2, relu2_2, relu3_3, relu4_3 and relu5_3, each feature map divided by its channel norm
(+1e-10), the squared difference weighted per channel by the lin layer (1 x 1, no bias), averaged over the
positions, summed over the five layers. Files (`--lpips VGG,LIN`, or one file holding both): the VGG16 weights
in torchvision's names (`features.N.weight`; `vgg16-397923af.pth`) or the lpips layout (`net.sliceK.N.weight`),
and the lin weights in the lpips package's names (`lin0.model.1.weight` ... `lin4`, shape [1, C, 1, 1]; the
package's lpips/weights/v0.1/vgg.pth; `model.0` of a model without dropout is read too). The widths come from
the files, so a small VGG-shaped network loads the same way (tests).

DINO (NanoGen's `dinov2-vit-b`): DINOv2 ViT-B/14 with registers (common/teacher.py loads it and any other
DINOv2 file), the image (x + 1) * 127.5 / 255, Normalize(ImageNet mean, std), bicubic to 14 x 16 x (size // 256)
pixels, the ViT's blocks, then a LayerNorm without affine weights (eps 1e-5: NanoGen replaces the model's norm
by nn.LayerNorm(D, elementwise_affine=False)), the patch tokens; the loss is their mean squared difference.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import sha256_file

# torchvision's VGG16 `features`: "C" a 3x3 conv + ReLU, "M" a 2x2 max pool; LPIPS taps relu1_2 ... relu5_3
_VGG16 = ("C", "C", "M", "C", "C", "M", "C", "C", "C", "M", "C", "C", "C", "M", "C", "C", "C")
_TAPS = (3, 8, 15, 22, 29)  # the index of the ReLU after which each tapped slice ends
LPIPS_SHIFT = (-0.030, -0.088, -0.188)
LPIPS_SCALE = (0.458, 0.448, 0.450)
PIXELGEN = {"lpips_weight": 0.1, "pdino_weight": 0.01, "percep_t_thresh": 0.7}


def _vgg_features(widths: list[int]) -> nn.Sequential:
    """torchvision's VGG16 `features` (indices as there, so `features.N.*` loads) with conv widths `widths`."""
    layers: list[nn.Module] = []
    c_in, convs = 3, iter(widths)
    for kind in _VGG16:
        if kind == "M":
            layers.append(nn.MaxPool2d(2, 2))
            continue
        c_out = next(convs)
        layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(inplace=False)]
        c_in = c_out
    return nn.Sequential(*layers)


class LPIPS(nn.Module):
    """lpips(x, y) -> [N]: LPIPS of images in [-1, 1] (module docstring)."""

    def __init__(self, widths: list[int]):
        super().__init__()
        self.features = _vgg_features(widths)
        tapped = [widths[i] for i in (1, 3, 6, 9, 12)]
        self.lins = nn.ParameterList(nn.Parameter(torch.zeros(1, c, 1, 1), requires_grad=False) for c in tapped)
        self.register_buffer("shift", torch.tensor(LPIPS_SHIFT).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("scale", torch.tensor(LPIPS_SCALE).view(1, 3, 1, 1), persistent=False)

    def _taps(self, x: torch.Tensor) -> list[torch.Tensor]:
        out, h = [], (x - self.shift) / self.scale
        for i, layer in enumerate(self.features):
            h = layer(h)
            if i in _TAPS:
                out.append(h / (h.pow(2).sum(dim=1, keepdim=True).sqrt() + 1e-10))
            if i == _TAPS[-1]:
                break
        return out

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        total = x.new_zeros(x.shape[0])
        for fx, fy, w in zip(self._taps(x), self._taps(y), self.lins):
            total = total + ((fx - fy) ** 2 * w).sum(dim=1).mean(dim=(1, 2))
        return total


def _read(path: Path, flag: str) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise UserError(f"{flag} {path}: no such file")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged or foreign file: one line
        raise UserError(f"{flag} {path}: not a weight file ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise UserError(f"{flag} {path}: not a state_dict of tensors")
    return obj


def _vgg_state(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`features.N.*` of torchvision's names, or of the lpips layout `net.sliceK.N.*`."""
    out = {k: v for k, v in sd.items() if k.startswith("features.")}
    for k, v in sd.items():
        parts = k.split(".")
        if len(parts) == 4 and parts[0] == "net" and parts[1].startswith("slice"):
            out[f"features.{parts[2]}.{parts[3]}"] = v
    return out


def load_lpips(spec: str, device: torch.device | str = "cpu") -> tuple[LPIPS, dict[str, Any]]:
    """(LPIPS in eval mode, frozen, on `device`; its identity) from `--lpips VGG,LIN` or one file with both."""
    paths = [Path(p.strip()).expanduser() for p in spec.split(",") if p.strip()]
    if not 1 <= len(paths) <= 2:
        raise UserError(f"--lpips {spec!r}: give VGG16_FILE,LIN_FILE (torchvision's vgg16 weights and the lpips "
                        "package's v0.1 vgg.pth), or one file holding both")
    sd: dict[str, torch.Tensor] = {}
    for p in paths:
        sd.update(_read(p, "--lpips"))
    vgg = _vgg_state(sd)
    convs = sorted(int(k.split(".")[1]) for k in vgg if k.endswith(".weight"))
    lins = [sd.get(f"lin{i}.model.1.weight", sd.get(f"lin{i}.model.0.weight")) for i in range(5)]
    if len(convs) != 13 or any(w is None for w in lins):
        raise UserError(f"--lpips {spec}: expected VGG16's 13 convolutions (features.N.weight, found {len(convs)}) "
                        f"and the lin layers lin0..lin4 (lin0.model.1.weight); found {sorted(sd)[:6]} ...")
    widths = [int(vgg[f"features.{i}.weight"].shape[0]) for i in convs]
    model = LPIPS(widths)
    try:
        model.features.load_state_dict({k[len("features."):]: v for k, v in vgg.items()}, strict=True)
        for param, w in zip(model.lins, lins):
            param.copy_(w.reshape(param.shape))  # type: ignore[union-attr]
    except (RuntimeError, TypeError) as e:
        raise UserError(f"--lpips {spec}: the files do not fit VGG16's layout ({str(e).splitlines()[0]})") from None
    identity = {"kind": "lpips-vgg", "files": [str(p.resolve()) for p in paths],
                "sha256": [sha256_file(p) for p in paths], "widths": widths}
    return model.to(device).eval().requires_grad_(False), identity


class DinoDistance(nn.Module):
    """dino(x, y) -> [N]: mean squared difference of DINOv2's affine-free normalized patch tokens of images in
    [-1, 1] (module docstring); `teacher` is a common.teacher.Teacher (its timm model and input size)."""

    def __init__(self, teacher: Any, eps: float = 1e-5):
        super().__init__()
        self.model, self.size, self.prefix, self.eps = teacher.model, int(teacher.image_size), \
            int(teacher.num_prefix_tokens), float(eps)
        self.register_buffer("mean", teacher.mean.detach().clone().cpu(), persistent=False)
        self.register_buffer("std", teacher.std.detach().clone().cpu(), persistent=False)

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        x = ((x + 1.0) * 127.5 / 255.0 - self.mean) / self.std
        x = F.interpolate(x, size=(self.size, self.size), mode="bicubic", align_corners=False)
        m = self.model
        h = m._pos_embed(m.patch_embed(x))
        h = m.norm_pre(m.patch_drop(h))
        for block in m.blocks:
            h = block(h)
        return F.layer_norm(h[:, self.prefix:], (h.shape[-1],), eps=self.eps)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.tokens(x) - self.tokens(y)) ** 2).mean(dim=(1, 2))


@dataclass(frozen=True)
class XTerm:
    """A loss term on the predicted clean image: name (its metric), fn(x_pred, x) -> [N], weight."""

    name: str
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    weight: float


def perceptual_terms(settings: dict[str, Any], image_size: int, device: torch.device | str) -> list[XTerm]:
    """The run's perceptual terms (TrainConfig's --lpips / --pdino and their weights), their networks loaded."""
    terms = []
    if settings.get("lpips"):
        lp, _ = load_lpips(str(settings["lpips"]), device)
        terms.append(XTerm("lpips", lp, float(settings.get("lpips_weight", PIXELGEN["lpips_weight"]))))
    if settings.get("pdino"):
        from dit_pipeline.common.teacher import load_teacher

        teacher = load_teacher(str(settings["pdino"]), grid=max(1, 16 * image_size // 256), device=device,
                               autocast_dtype=None)
        terms.append(XTerm("pdino", DinoDistance(teacher).to(device).eval().requires_grad_(False),
                           float(settings.get("pdino_weight", PIXELGEN["pdino_weight"]))))
    return terms
