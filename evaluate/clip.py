"""CLIP through transformers, for the CLIP score and GenEval's color classifier: `load_clip(spec)` (a hub id or a
local folder, e.g. `openai/clip-vit-large-patch14`, the model NanoGen's CLIP score and GenEval use), image and
text embeddings on the unit sphere.

The image preprocessing is written out here so that it does not change with the transformers version (which
backend `CLIPProcessor.from_pretrained` picks has changed over releases) and runs batched on the device. Two
variants, both with the sizes, mean and std of the checkpoint's `preprocessor_config.json` (224 shortest edge,
224 x 224 center crop and OpenAI's mean/std for the released CLIPs):
- "torchvision": what NanoGen's CLIP score ran (End2End-Diffusion/diffusion-bench `src/eval/clipscore.py`:
  `CLIPProcessor.from_pretrained(name)`, which under its pinned transformers 5.3 is the torchvision backend):
  uint8 resize of the short side with bicubic and antialiasing (the long side `int(size * long / short)`),
  center crop at `int((h - crop) / 2)`, then `/ 255` and the normalization in float32;
- "pil": what NanoGen's GenEval color classifier ran (diffusionbench-evals `geneval/geneval_evaluator/
  evaluator.py`: `CLIPProcessor.from_pretrained(..., use_fast=False)`): PIL's bicubic resize of each image, the
  center crop at `(h - crop) // 2`, `/ 255` in float64 then float32, the normalization.
tests/evaluate/test_t2i_clip.py checks both against transformers' own processors.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from dit_pipeline.common.errors import UserError

DEFAULT_CLIP = "openai/clip-vit-large-patch14"


def _field(size: Any, key: str) -> Any:
    """A key of a size setting, whether the processor keeps it as a dict or as transformers' SizeDict."""
    return size.get(key) if isinstance(size, dict) else getattr(size, key, None)


@dataclass
class Clip:
    model: Any                      # transformers.CLIPModel, eval mode, float32
    tokenizer: Any
    short_edge: int                 # resize target of the short side
    crop: tuple[int, int]           # (height, width) of the center crop
    mean: torch.Tensor              # [3]
    std: torch.Tensor               # [3]
    device: torch.device
    identity: dict[str, Any]

    # ---- images -------------------------------------------------------------------------------------------
    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        """float32 [n, 3, h, w] in 0..1 -> normalized."""
        return (x - self.mean.view(1, 3, 1, 1)) / self.std.view(1, 3, 1, 1)

    def pixels_torchvision(self, images: np.ndarray | torch.Tensor) -> torch.Tensor:
        """uint8 [n, H, W, 3] (one size) -> normalized float32 [n, 3, crop_h, crop_w] (the "torchvision" variant)."""
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms.v2 import functional as F

        x = images if isinstance(images, torch.Tensor) else torch.from_numpy(np.array(images, np.uint8))
        x = x.to(self.device).permute(0, 3, 1, 2).contiguous()
        h, w = x.shape[-2:]
        short, long = (h, w) if h <= w else (w, h)
        new_long = int(self.short_edge * long / short)
        size = [self.short_edge, new_long] if h <= w else [new_long, self.short_edge]
        x = F.resize(x, size, interpolation=InterpolationMode.BICUBIC, antialias=True)
        ch, cw = self.crop
        top, left = int((x.shape[-2] - ch) / 2.0), int((x.shape[-1] - cw) / 2.0)
        x = x[..., top:top + ch, left:left + cw]
        return self._normalize(x.float() / 255.0)

    def pixels_pil(self, images: Sequence[Any]) -> torch.Tensor:
        """RGB PIL images (any sizes) -> normalized float32 [n, 3, crop_h, crop_w] (the "pil" variant)."""
        from PIL import Image

        out = []
        for im in images:
            w, h = im.size
            short, long = (h, w) if h <= w else (w, h)
            new_long = int(self.short_edge * long / short)
            nh, nw = (self.short_edge, new_long) if h <= w else (new_long, self.short_edge)
            arr = np.asarray(im.convert("RGB").resize((nw, nh), resample=Image.Resampling.BICUBIC, reducing_gap=None))
            ch, cw = self.crop
            top, left = (arr.shape[0] - ch) // 2, (arr.shape[1] - cw) // 2
            arr = arr[max(top, 0):max(top, 0) + ch, max(left, 0):max(left, 0) + cw]
            out.append((arr.astype(np.float64) * (1 / 255)).astype(np.float32))
        x = torch.from_numpy(np.stack(out)).permute(0, 3, 1, 2).to(self.device)
        return self._normalize(x)

    @torch.no_grad()
    def image_embeds(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Unit-norm image embeddings [n, D] (CLIPModel's `image_embeds`)."""
        pooled = self.model.vision_model(pixel_values=pixel_values).pooler_output
        e = self.model.visual_projection(pooled)
        return e / e.norm(p=2, dim=-1, keepdim=True)

    # ---- text ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def text_embeds(self, texts: Sequence[str], truncation: bool = True) -> torch.Tensor:
        """Unit-norm text embeddings [n, D]: the batch padded to its longest text and, with `truncation`, cut to
        the tokenizer's maximum (77 tokens for the released CLIPs), as `CLIPProcessor(text=..., padding=True,
        truncation=True)` tokenizes."""
        tok = self.tokenizer(list(texts), padding=True, truncation=truncation, return_tensors="pt")
        out = self.model.text_model(input_ids=tok["input_ids"].to(self.device),
                                    attention_mask=tok["attention_mask"].to(self.device))
        e = self.model.text_projection(out.pooler_output)
        return e / e.norm(p=2, dim=-1, keepdim=True)


def load_clip(spec: str, device: torch.device | str = "cpu", what: str = "--clip") -> Clip:
    """CLIPModel, its tokenizer and its image settings from a hub id or a local folder (see the module docstring)."""
    from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

    from dit_pipeline.common.vae import _hub_offline_reason

    local = Path(spec).expanduser().is_dir() or spec.startswith(("/", ".", "~"))  # a path, found or not
    offline = None if local else _hub_offline_reason()
    kw = {"local_files_only": True} if offline else {}
    try:
        model = CLIPModel.from_pretrained(spec, **kw)
        tokenizer = AutoTokenizer.from_pretrained(spec, **kw)
        proc = AutoImageProcessor.from_pretrained(spec, **kw)
    except (OSError, ValueError) as e:
        why = str(e).splitlines()[0][:300]
        if offline:  # issue 47: the message asked for "a hub id such as openai/clip-vit-large-patch14", the id given
            raise UserError(f"{what} {spec}: not a local folder and not in the Hugging Face cache, and the hub was not "
                            f"asked ({offline}); pass a folder written by save_pretrained, or fill the cache where "
                            f"there is a network (huggingface-cli download {spec})") from None
        other = "a folder written by save_pretrained" if local or spec == DEFAULT_CLIP else \
            f"a hub id such as {DEFAULT_CLIP} or a folder written by save_pretrained"
        raise UserError(f"{what} {spec}: cannot load a CLIP model, its tokenizer and its image processor from it "
                        f"({why}); give {other}") from None
    dev = torch.device(device)
    model = model.float().eval().to(dev)
    model.requires_grad_(False)
    short = _field(proc.size, "shortest_edge")
    crop = (_field(proc.crop_size, "height"), _field(proc.crop_size, "width"))
    if not short or None in crop:
        raise UserError(f"{what} {spec}: its image processor has size {proc.size} and crop {proc.crop_size}; "
                        "the CLIP preprocessing needs a shortest_edge resize and a height x width center crop")
    ident = {"name": spec, "class": type(model).__name__, "projection_dim": int(model.config.projection_dim),
             "image_size": int(model.config.vision_config.image_size), "short_edge": int(short),
             "crop": [int(crop[0]), int(crop[1])], "commit": getattr(model.config, "_commit_hash", None),
             "weights_sha256": weights_sha256(spec)}
    return Clip(model, tokenizer, int(short), (int(crop[0]), int(crop[1])),
                torch.tensor(list(proc.image_mean), dtype=torch.float32, device=dev),
                torch.tensor(list(proc.image_std), dtype=torch.float32, device=dev), dev, ident)


def weights_sha256(spec: str) -> str | None:
    """sha256 over (name, sha256) of the weight files a CLIP loads from (its .safetensors files, which transformers
    prefers, else its .bin files), in a local folder or the hub cache's snapshot of `spec`; None where none is found.
    Recorded with the scores, so a number names the exact weights, not just a folder or hub name."""
    from dit_pipeline.common.io import sha256_file

    folder = Path(spec).expanduser()
    if not folder.is_dir():
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            return None
        found = next((f for f in (try_to_load_from_cache(spec, n) for n in ("model.safetensors", "pytorch_model.bin",
                                                                              "model.safetensors.index.json"))
                      if isinstance(f, str)), None)
        if found is None:
            return None
        folder = Path(found).parent
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\t{sha256_file(f)}\n".encode())
    return h.hexdigest()


def describe_model(identity: dict[str, Any]) -> str:
    """"NAME (weights sha256 0123456789ab...)", or with its hub commit where no weight file was found."""
    sha, commit = identity.get("weights_sha256"), identity.get("commit")
    return f"{identity.get('name')}" + (f" (weights sha256 {sha[:12]}...)" if sha else
                                       f" (commit {commit})" if commit else "")
