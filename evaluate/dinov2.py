"""FD_DINOv2: the Frechet distance of DINOv2 ViT-L/14 features, as EDM2 reports it beside FID (Karras et al. 2024,
"Analyzing and Improving the Training Dynamics of Diffusion Models"; NVlabs/edm2 `calculate_metrics.py`,
`DINOv2Detector`, modelled on layer6ai-labs/dgm-eval).

Facts followed:
- network: DINOv2 ViT-L/14 (`dinov2_vitl14`, Meta's release), whose forward returns the final-norm class token
  (1024 values; its head is the identity). timm builds the same network (`vit_large_patch14_dinov2`, head
  removed: the forward returns the same normed class token) from the same weights; it is built for 224 x 224
  inputs, and the 37 x 37 position table of the weights is resampled once as DINOv2 resamples it for such an
  input (bicubic `F.interpolate` with scale factor (16 + 0.1) / 37, its "interpolate offset", no antialias;
  the class token's entry kept);
- input: the uint8 image resized to 224 x 224 bicubic, then / 255 and normalized with the ImageNet mean and std.
  Two resize variants, as EDM2 has them: `pil` (PIL's bicubic resize of the uint8 image, rounded back to uint8:
  dgm-eval's exact reference) and `torch` (`F.interpolate(bicubic, antialias=True)` on the float image, no
  rounding: the fast default; BENCHMARKS.md states how far the two are apart);
- distance: the Frechet distance of the two feature Gaussians (mean, unbiased covariance), computed exactly as
  FID is (evaluate/metrics.py).

Weights (`spec`), as the REPA teacher's (common/teacher.py): None = Meta's `dinov2_vitl14_pretrain.pth` in
torch.hub's cache (`<torch.hub.get_dir()>/checkpoints/`), fetched from Meta's URL when missing and reachable; or a
local file (.pth in Meta's or timm's names, or .safetensors, e.g. timm's `vit_large_patch14_dinov2.lvd142m`, or
one written by `common.teacher.save_teacher`, whose metadata may describe another size: the tests' tiny model).

Features are cached like Inception's (evaluate/features.py): `.NAME.<sha256[:16]>.<extractor>.dinov2.npz` beside
the input, keyed by its content and the extractor (weights hash and resize variant); every rank extracts the
batches `dit-sample`'s split gives it and rank 0 gathers them.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from dit_pipeline.common import distributed as dist
from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import atomic_write, missing_file, sha256_file
from dit_pipeline.common.teacher import (IMAGENET_MEAN, IMAGENET_STD, META_BASE_URL, TeacherArch, _check_keys,
                                         _described_arch, _load_file, _unreachable)
from dit_pipeline.evaluate.features import gather_rows
from dit_pipeline.evaluate.inputs import Source
from dit_pipeline.sample.plan import rank_batches

IMAGE_SIZE = 224
RESIZES = ("torch", "pil")
VITL14 = TeacherArch("vit_large_patch14_dinov2", "dinov2_vitl14_pretrain.pth", "timm/vit_large_patch14_dinov2.lvd142m",
                     meta_dir="dinov2_vitl14", label="DINOv2 ViT-L/14")
EXTRACTOR_VERSION = "dinov2-cls.v1"  # bump when anything changes the features of the same pixels
INTERPOLATE_OFFSET = 0.1             # DINOv2's position-table resampling (module docstring)
CACHE_FORMAT = "dit-pipeline.eval-features-dinov2"


class DINOv2Features(torch.nn.Module):
    """uint8 images [N, H, W, 3] -> the normed class token [N, D] (float32); see the module docstring."""

    def __init__(self, model: torch.nn.Module, resize: str = "torch"):
        super().__init__()
        if resize not in RESIZES:
            raise ValueError(f"resize must be one of {RESIZES}, got {resize!r}")
        self.model, self.resize = model.eval().requires_grad_(False), resize
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 [N, H, W, 3] -> float32 [N, 3, 224, 224], resized, / 255, normalized."""
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(f"expected uint8 images [N, H, W, 3], got {images.dtype} {list(images.shape)}")
        if self.resize == "pil":
            from PIL import Image

            resized = [np.asarray(Image.fromarray(im, "RGB").resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BICUBIC))
                       for im in images.cpu().numpy()]
            x = torch.from_numpy(np.stack(resized)).to(self.mean.device).permute(0, 3, 1, 2).float()
        else:
            x = images.to(self.mean.device).permute(0, 3, 1, 2).float()
            x = F.interpolate(x, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bicubic", antialias=True)
        return (x / 255 - self.mean) / self.std

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(self.preprocess(images)).float()


def resample_position_table(pos_embed: torch.Tensor, grid: int) -> torch.Tensor:
    """[1, 1 + M*M, D] (class token first) -> [1, 1 + grid*grid, D], as DINOv2 resamples it for a grid x grid
    input: bicubic with scale factor (grid + 0.1) / M, no antialias, in float32."""
    n = pos_embed.shape[1] - 1
    side = int(round(n ** 0.5))
    if side * side != n:
        raise UserError(f"the DINOv2 weights' position table has {n} patch entries, not a square grid")
    if side == grid:
        return pos_embed
    cls, patches = pos_embed[:, :1].float(), pos_embed[:, 1:].float()
    scale = (grid + INTERPOLATE_OFFSET) / side
    table = F.interpolate(patches.reshape(1, side, side, -1).permute(0, 3, 1, 2), scale_factor=(scale, scale),
                          mode="bicubic", antialias=False)
    assert table.shape[-2:] == (grid, grid), table.shape
    return torch.cat([cls, table.permute(0, 2, 3, 1).reshape(1, grid * grid, -1)], dim=1).to(pos_embed.dtype)


def _weights_file(spec: str | None) -> tuple[Path, TeacherArch]:
    """The file of `spec` (module docstring) and the architecture it holds."""
    if spec is not None:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise UserError(f"--dinov2 {spec}: {missing_file(path)}; pass Meta's {VITL14.meta_file} or timm's "
                            f"{VITL14.hf_id} model.safetensors, or leave it out to use torch.hub's cache")
        return path, _described_arch(path) or VITL14
    path = Path(torch.hub.get_dir()) / "checkpoints" / VITL14.meta_file
    if path.is_file():
        return path, VITL14
    url = f"{META_BASE_URL}/{VITL14.meta_dir}/{VITL14.meta_file}"
    offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("DIT_OFFLINE") == "1"
    why = "offline" if offline else _unreachable(url)
    if why is None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.hub.download_url_to_file(url, str(path), progress=False)  # a temporary name, then moved
            return path, VITL14
        except (OSError, ValueError) as e:
            why = f"downloading it failed ({type(e).__name__}: {e})"
    raise UserError(f"FD_DINOv2 needs the DINOv2 ViT-L/14 weights: {path} is missing ({why}). Download {url} there "
                    "where there is a network, or pass the file with --dinov2 PATH")


def load_dinov2(spec: str | None = None, *, resize: str = "torch",
                device: torch.device | str = "cpu") -> tuple[DINOv2Features, dict[str, Any]]:
    """The feature network and its identity {"extractor", "weights", "weights_sha256", "resize"} (cache keys)."""
    import timm

    file, arch = _weights_file(spec)
    sd = _load_file(file, f"--dinov2 {file}")
    sd.pop("mask_token", None)                  # Meta's layout: only used in DINOv2's own training
    if "pos_embed" in sd and sd["pos_embed"].dim() == 3:
        sd["pos_embed"] = resample_position_table(sd["pos_embed"], IMAGE_SIZE // arch.overrides.get("patch_size", 14))
    with torch.random.fork_rng(devices=[]):  # timm initialises randomly before the weights arrive
        model = timm.create_model(arch.timm_name, pretrained=False, num_classes=0, img_size=IMAGE_SIZE,
                                  **arch.overrides)
        _check_keys(sd, model, f"--dinov2 {file}", arch)
        model.load_state_dict(sd, strict=True)
    ident = {"extractor": f"{EXTRACTOR_VERSION}-{resize}", "weights": file.name, "weights_sha256": sha256_file(file),
             "arch": arch.timm_name, "resize": resize}
    return DINOv2Features(model, resize).to(device), ident


def _cache_path(source: Source, digest: str, ident: dict[str, Any]) -> Path:
    tag = f"{ident['extractor']}-{ident['weights_sha256'][:8]}"
    return source.path.parent / f".{source.path.name}.{digest[:16]}.{tag}.dinov2.npz"


def source_features(source: Source, net: DINOv2Features, ident: dict[str, Any], *, batch_size: int,
                    use_cache: bool, log: logging.Logger) -> np.ndarray | None:
    """DINOv2 features [N, D] of every image of `source` on rank 0 (None elsewhere, and for a source without
    images: a statistics or Inception features file)."""
    if source.kind not in ("npz", "folder"):
        return None
    digest = dist.on_rank0(source.content_hash) if use_cache else None
    cache = _cache_path(source, digest, ident) if digest is not None else None
    if dist.on_rank0(lambda: cache is not None and cache.is_file()):
        if not dist.is_main():
            return None
        log.info("%s: cached DINOv2 features %s", source.path, cache)
        with np.load(cache) as f:
            return np.asarray(f["dinov2"], np.float32)
    ws, idx, rows = dist.world_size(), [], []
    with source.reader() as reader:
        for b in rank_batches(range(source.count), batch_size, dist.rank(), ws):
            rows.append(net(torch.from_numpy(np.array(reader.read(b[0], b[-1] + 1), np.uint8))).cpu().numpy())
            idx.extend(b)
    mine = {"dinov2": np.concatenate(rows) if rows else np.zeros((0, net.model.num_features), np.float32)}
    counts = [sum(len(b) for b in rank_batches(range(source.count), batch_size, r, ws)) for r in range(ws)]
    gathered = gather_rows(idx, mine, source.count, counts)
    if not dist.is_main() or gathered is None:
        return None
    if cache is not None:
        meta = {"source": str(source.path), "sha256": digest, "count": source.count, "extractor": ident}
        try:
            with atomic_write(cache) as f:
                np.savez(f, format=np.array(CACHE_FORMAT), meta=np.array(json.dumps(meta, sort_keys=True)),
                         dinov2=gathered["dinov2"])
        except OSError as e:
            log.warning("could not cache the DINOv2 features of %s in %s (%s)", source.path, cache, e)
    return gathered["dinov2"]
