"""The frozen representation teacher of REPA (dit/repa.py): DINOv2 ViT-B/14 built with timm, its weights from
where users have them, and the preprocessing REPA applies to the training pixels.

Follows REPA (Yu et al. 2024, arXiv:2410.06940; sihyun-yu/REPA) and DINOv2 (Oquab et al. 2023,
facebookresearch/dinov2); docs/REFERENCE.md "REPA" lists the facts:
- model: DINOv2 ViT-B/14 (`dinov2_vitb14`; `dinov2_vitb14_reg` with 4 register tokens), head removed; the
  absolute position table resampled once to the DiT's token grid with timm's `resample_abs_pos_embed`
  (bicubic, antialias), so a 256 px DiT-XL/2 (16x16 tokens) gets a 16x16 table and 224 px inputs;
- features: the final-norm patch tokens (DINOv2's `x_norm_patchtokens`), [N, grid^2, 768];
- input: the uint8 training image (the crop and flip the VAE encoded) / 255, Normalize(ImageNet mean, std),
  then bicubic `F.interpolate` to 14 x grid pixels (no antialias, align_corners False): 224 x res // 256.
Frozen, eval mode, no gradients; the network runs under bf16 autocast on CUDA (REPA: its mixed precision).

Weights (`spec`): a torch.hub name (`dinov2_vitb14`, `dinov2_vitb14_reg`): Meta's file in torch.hub's cache
(`<torch.hub.get_dir()>/checkpoints/dinov2_vitb14_pretrain.pth`), fetched from Meta's URL when missing and
reachable; a local file (.pth/.pt in Meta's or timm's key names, or .safetensors); or a Hugging Face id
(`timm/vit_base_patch14_dinov2.lvd142m`), from the hub or its cache. Pickles load with weights_only=True.
Meta's names are converted to timm's (register tokens: `register_tokens` -> `reg_token`, the class token's
position folded into `cls_token`, as timm does), and every key and shape is checked against the model: a file
of another architecture is a UserError, never a partial load. Every message names the teacher by the flag that
sets it, dit-train's `--repa` (train/repa.py).
"""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
import torch.nn.functional as F

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import sha256_file

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
META_BASE_URL = "https://dl.fbaipublicfiles.com/dinov2"


@dataclass(frozen=True)
class TeacherArch:
    """One supported teacher: the timm model that computes it and where its official weights live."""

    timm_name: str            # timm.create_model name
    meta_file: str            # Meta's release file (its name in torch.hub's cache), at META_BASE_URL/meta_dir/
    hf_id: str                # timm's copy on the Hugging Face hub
    registers: int = 0
    meta_dir: str = "dinov2_vitb14"
    label: str = "DINOv2 ViT-B/14"
    overrides: dict[str, Any] = field(default_factory=dict)  # timm kwargs (tests: tiny widths)


TEACHERS: dict[str, TeacherArch] = {
    "dinov2_vitb14": TeacherArch("vit_base_patch14_dinov2", "dinov2_vitb14_pretrain.pth",
                                 "timm/vit_base_patch14_dinov2.lvd142m"),
    "dinov2_vitb14_reg": TeacherArch("vit_base_patch14_reg4_dinov2", "dinov2_vitb14_reg4_pretrain.pth",
                                     "timm/vit_base_patch14_reg4_dinov2.lvd142m", registers=4,
                                     label="DINOv2 ViT-B/14 with 4 registers"),
}
DEFAULT_TEACHER = "dinov2_vitb14"


class Teacher:
    """A frozen teacher: `teacher(pixels)` -> float32 features [N, grid^2, dim] (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, *, grid: int, identity: dict[str, Any],
                 autocast_dtype: torch.dtype | None):
        self.model, self.grid, self.identity, self.autocast_dtype = model, grid, identity, autocast_dtype
        self.autocast_auto = False  # load_teacher / build_teacher with "auto": to() follows the device
        self.patch_size = int(model.patch_embed.patch_size[0])
        self.image_size = self.patch_size * grid
        self.num_tokens, self.dim = grid * grid, int(model.embed_dim)
        self.num_prefix_tokens = int(model.num_prefix_tokens)
        device = next(model.parameters()).device
        self.mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1)

    @property
    def device(self) -> torch.device:
        return self.mean.device

    def to(self, device: torch.device | str) -> "Teacher":
        """The teacher on `device` (in place); its autocast follows the device when it was "auto" (bf16 on CUDA)."""
        device = torch.device(device)
        self.model.to(device)
        self.mean, self.std = self.mean.to(device), self.std.to(device)
        if self.autocast_auto:
            self.autocast_dtype = torch.bfloat16 if device.type == "cuda" else None
        return self

    def forward_macs(self) -> int:
        """Multiply-accumulates of the network's forward for one image (as dit.forward_macs counts: the patch
        embedding and per block qkv, the two attention matmuls, the output projection and the MLP)."""
        d, tokens = self.dim, self.num_prefix_tokens + self.num_tokens
        hidden = int(self.model.blocks[0].mlp.fc1.out_features)
        block = tokens * d * 3 * d + 2 * tokens * tokens * d + tokens * d * d + 2 * tokens * d * hidden
        return self.num_tokens * d * 3 * self.patch_size ** 2 + len(self.model.blocks) * block

    def check_tokens(self, tokens: int, what: str = "the DiT") -> None:
        """UserError unless the teacher yields `tokens` tokens per image (one per DiT token)."""
        if tokens != self.num_tokens:
            raise UserError(f"the teacher {self.identity['name']} gives {self.num_tokens} tokens per image "
                            f"({self.grid}x{self.grid} at {self.image_size} px) but {what} has {tokens}; load it "
                            "with grid = the DiT's token grid side (input_size // patch_size)")

    def preprocess(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 [N, H, W, 3] or [N, 3, H, W] -> float32 [N, 3, image_size, image_size] on the teacher's device:
        /255, Normalize(ImageNet mean, std), bicubic resize (REPA's order and settings)."""
        if pixels.dtype != torch.uint8 or pixels.dim() != 4 or 3 not in (pixels.shape[1], pixels.shape[-1]):
            raise ValueError(f"the teacher takes uint8 images [N, H, W, 3] or [N, 3, H, W], got {pixels.dtype} "
                             f"{list(pixels.shape)}")
        x = pixels.to(self.device)
        if x.shape[1] != 3:  # channels last
            x = x.permute(0, 3, 1, 2)
        x = (x.float() / 255.0 - self.mean) / self.std
        return F.interpolate(x, size=(self.image_size, self.image_size), mode="bicubic", align_corners=False,
                             antialias=False)

    @torch.no_grad()
    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.preprocess(pixels)
        enabled = self.autocast_dtype is not None
        with torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.float32, enabled=enabled):
            tokens = self.model.forward_features(x)  # [N, prefix + T, D], after the final norm
        return tokens[:, self.num_prefix_tokens:].float()


def load_teacher(spec: str = DEFAULT_TEACHER, *, grid: int, device: torch.device | str = "cpu",
                 autocast_dtype: torch.dtype | None | str = "auto") -> Teacher:
    """The teacher of `spec` (see the module docstring) with its position table resampled to `grid` x `grid`.

    `grid`: the DiT's token grid side (input_size // patch_size; 16 for DiT-XL/2 at 256 px); `autocast_dtype`:
    "auto" = bf16 on CUDA and none elsewhere, or a dtype, or None. Draws no global random numbers.
    """
    if not isinstance(grid, int) or isinstance(grid, bool) or grid < 1:
        raise ValueError(f"grid must be a positive integer (the DiT's token grid side), got {grid!r}")
    device = torch.device(device)
    arch_key, state_dict, identity = _read_weights(spec)
    arch = TEACHERS[arch_key] if arch_key in TEACHERS else _described_arch(Path(spec).expanduser())
    with torch.random.fork_rng(devices=[]):  # timm initialises the model randomly before the weights arrive
        model = _build(arch, grid)
        sd = _to_timm_layout(state_dict, identity["layout"], model, grid)
        _check_keys(sd, model, f"--repa {spec}", arch)
        model.load_state_dict(sd, strict=True)
    model = model.to(device).eval().requires_grad_(False)
    auto = autocast_dtype == "auto"
    if auto:
        autocast_dtype = torch.bfloat16 if device.type == "cuda" else None
    identity.update(name=arch_key, arch=arch.timm_name, registers=arch.registers, grid=grid,
                    image_size=int(model.patch_embed.patch_size[0]) * grid, features=int(model.embed_dim))
    teacher = Teacher(model, grid=grid, identity=identity, autocast_dtype=autocast_dtype)  # type: ignore[arg-type]
    teacher.autocast_auto = auto
    return teacher


def build_teacher(arch: TeacherArch | str = DEFAULT_TEACHER, *, grid: int, device: torch.device | str = "cpu",
                  autocast_dtype: torch.dtype | None | str = "auto") -> Teacher:
    """A teacher of the architecture with random weights (the real cost, for benchmarks; cf. build_sd_vae)."""
    arch = TEACHERS[arch] if isinstance(arch, str) else arch
    device = torch.device(device)
    with torch.random.fork_rng(devices=[]):
        model = _build(arch, grid).to(device).eval().requires_grad_(False)
    if autocast_dtype == "auto":
        autocast_dtype = torch.bfloat16 if device.type == "cuda" else None
    identity = {"name": arch.label, "kind": "random", "arch": arch.timm_name, "grid": grid}
    return Teacher(model, grid=grid, identity=identity, autocast_dtype=autocast_dtype)


def _build(arch: TeacherArch, grid: int) -> torch.nn.Module:
    """The timm model on the CPU (older timm cannot build it on the meta device), head removed."""
    import timm

    patch = arch.overrides.get("patch_size", 14)
    return timm.create_model(arch.timm_name, pretrained=False, num_classes=0, img_size=patch * grid,
                             **arch.overrides)


def _read_weights(spec: str) -> tuple[str, dict[str, torch.Tensor], dict[str, Any]]:
    """(TEACHERS key, state_dict, identity with "spec", "kind", "layout", "weights_sha256"/"commit")."""
    path = Path(spec).expanduser()
    if spec in TEACHERS:
        file = _torch_hub_file(spec)
        sd = _load_file(file, f"--repa {spec}")
        return spec, sd, {"spec": spec, "kind": "torch-hub", "layout": _layout(sd), "file": str(file),
                          "weights_sha256": sha256_file(file)}
    if path.is_file():
        sd = _load_file(path, f"--repa {spec}")
        described = _described_arch(path)
        key = f"{described.label} ({path.name})" if described is not None else _arch_of(sd, spec)
        return key, sd, {"spec": spec, "kind": "file", "layout": _layout(sd), "weights_sha256": sha256_file(path)}
    if path.is_dir():
        raise UserError(f"--repa {spec!r}: {path.absolute()} is a folder; pass the weights file in it (Meta's "
                        f"{TEACHERS[DEFAULT_TEACHER].meta_file} or timm's model.safetensors)")
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1 or spec.endswith((".pth", ".pt")):
        raise UserError(f"--repa {spec!r}: no such file ({path.absolute()}), and not one of "
                        f"{', '.join(TEACHERS)} (torch.hub names) or a Hugging Face id such as "
                        f"{TEACHERS[DEFAULT_TEACHER].hf_id}")
    file, commit = _hub_file(spec)
    sd = _load_file(file, f"--repa {spec}")
    return _arch_of(sd, spec), sd, {"spec": spec, "kind": "hub", "layout": _layout(sd), "commit": commit,
                                    "weights_sha256": sha256_file(file)}


ARCH_METADATA = "dit_pipeline.teacher_arch"  # safetensors metadata: a TeacherArch of the file's own size


def save_teacher(path: str | Path, state_dict: dict[str, torch.Tensor], arch: TeacherArch) -> Path:
    """Write timm-layout weights of a DINOv2-family ViT of any size as .safetensors that `--repa PATH` loads:
    the architecture (timm model and its size overrides) travels in the file's metadata, since a head count is
    not visible in tensor shapes. The tests' tiny random teachers are such files."""
    import json

    from safetensors.torch import save_file

    meta = {ARCH_METADATA: json.dumps({"timm_name": arch.timm_name, "meta_file": arch.meta_file,
                                       "hf_id": arch.hf_id, "registers": arch.registers, "label": arch.label,
                                       "overrides": arch.overrides}, sort_keys=True)}
    path = Path(path)
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(path), metadata=meta)
    return path


def _described_arch(path: Path) -> TeacherArch | None:
    """The TeacherArch a .safetensors file describes in its metadata (save_teacher), else None."""
    import json

    if path.suffix.lower() != ".safetensors":
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            text = (f.metadata() or {}).get(ARCH_METADATA)
        return TeacherArch(**json.loads(text)) if text else None
    except Exception as e:  # noqa: BLE001 - a damaged header or foreign metadata
        raise UserError(f"--repa {path}: its architecture metadata ({ARCH_METADATA}) is unreadable "
                        f"({type(e).__name__}: {e})") from None


def _torch_hub_file(name: str) -> Path:
    """Meta's file for a torch.hub name: from torch.hub's cache, else downloaded into it when reachable."""
    arch = TEACHERS[name]
    file = Path(torch.hub.get_dir()) / "checkpoints" / arch.meta_file
    if file.is_file():
        return file
    url = f"{META_BASE_URL}/{arch.meta_dir}/{arch.meta_file}"
    why = _unreachable(url)
    if why is not None:
        raise UserError(f"--repa {name}: {file} is missing (torch.hub's cache) and {why}. Download {url} "
                        f"there where there is a network, or pass the file itself (--repa /path/"
                        f"{arch.meta_file}) or timm's copy ({arch.hf_id})")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        torch.hub.download_url_to_file(url, str(file), progress=False)  # to a temporary name, then moved
    except (OSError, ValueError) as e:  # URLError and HTTPError are OSErrors
        raise UserError(f"--repa {name}: {file} is missing (torch.hub's cache) and downloading {url} failed "
                        f"({type(e).__name__}: {e}); put the file there or pass it (--repa /path/"
                        f"{arch.meta_file})") from None
    return file


def _hub_file(repo_id: str) -> tuple[Path, str | None]:
    """timm's model.safetensors of a Hugging Face id: from the hub, or its cache when offline or unreachable."""
    from huggingface_hub import constants, hf_hub_download

    from dit_pipeline.common.vae import _hub_unreachable

    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    why = "HF_HUB_OFFLINE is set" if offline else _hub_unreachable()
    try:
        got = Path(hf_hub_download(repo_id, "model.safetensors", local_files_only=why is not None))
    except Exception as e:  # noqa: BLE001 - the hub client raises many types for a missing repo or file
        where = f"not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the hub was not asked ({why})" \
            if why else f"the hub says {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise UserError(f"--repa {repo_id!r}: no local file of that name, and model.safetensors is {where}. "
                        "Pass a local file (--repa /path/model.safetensors or Meta's dinov2_vitb14_pretrain.pth) "
                        f"or fill the cache where there is a network (huggingface-cli download {repo_id})") from None
    commit = got.parent.name if got.parent.parent.name == "snapshots" else None
    return got, commit


def _unreachable(url: str, timeout: float = 3.0) -> str | None:
    """Why `url`'s host cannot be reached (one TCP connect), or None; a configured proxy decides for itself."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    host = urlparse(url)
    try:
        socket.create_connection((host.hostname or "", host.port or 443), timeout=timeout).close()
    except OSError as e:
        return f"{host.scheme}://{host.netloc} is unreachable: {e.strerror or e}"
    return None


def _load_file(path: Path, where: str) -> dict[str, torch.Tensor]:
    """A bare state_dict (or one under "model"/"state_dict") from .safetensors or a pickle (weights_only)."""
    try:
        if path.suffix.lower() == ".safetensors":
            from safetensors.torch import load_file

            obj: Any = load_file(str(path))
        else:
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - unpickling refusals, truncation, not a weight file at all
        detail = " ".join(str(e).split())[:300]
        raise UserError(f"{where}: cannot read {path} as weights ({type(e).__name__}: {detail}); only tensors "
                        "and containers are unpickled") from None
    if isinstance(obj, dict):
        for key in ("model", "state_dict"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise UserError(f"{where}: {path} holds no state_dict of tensors")
    return dict(obj)


def _layout(sd: dict[str, torch.Tensor]) -> str:
    """"meta" (DINOv2's own names: mask_token, register_tokens) or "timm"."""
    return "meta" if ("mask_token" in sd or "register_tokens" in sd) else "timm"


def _arch_of(sd: dict[str, torch.Tensor], spec: str) -> str:
    """The TEACHERS entry a file claims to be: by its register tokens and width (every shape is checked after)."""
    if _width(sd) is None:
        _refuse(sd, spec)
    registers = next((int(sd[k].shape[1]) for k in ("register_tokens", "reg_token") if k in sd and sd[k].dim() == 3), 0)
    same = [k for k, a in TEACHERS.items() if a.registers == registers]
    if not same:
        _refuse(sd, spec)
    return next((k for k in same if TEACHERS[k].overrides.get("embed_dim", 768) == _width(sd)), same[0])


def _width(sd: dict[str, torch.Tensor]) -> int | None:
    w = sd.get("patch_embed.proj.weight")
    return int(w.shape[0]) if w is not None and w.dim() == 4 else None


def _refuse(sd: dict[str, torch.Tensor], spec: str) -> None:
    raise UserError(f"--repa {spec}: {_describe(sd)}; expected one of: "
                    + ", ".join(f"{k} ({a.label})" for k, a in TEACHERS.items()))


def _describe(sd: dict[str, torch.Tensor]) -> str:
    width, depth = _width(sd), len({m.group(1) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))})
    w = sd.get("patch_embed.proj.weight")
    if width is None:
        return f"not a ViT state_dict (no patch_embed.proj.weight; keys start with {sorted(sd)[:4]})"
    return f"a ViT of width {width}, {depth} blocks, patch {w.shape[-1]}"


def _to_timm_layout(sd: dict[str, torch.Tensor], layout: str, model: torch.nn.Module,
                    grid: int) -> dict[str, torch.Tensor]:
    """timm's names, with the position table resampled to grid x grid (timm's resample_abs_pos_embed)."""
    from timm.layers import resample_abs_pos_embed

    sd = dict(sd)
    if layout == "meta":
        sd.pop("mask_token", None)
        if "register_tokens" in sd:  # timm's no_embed_class: the class position is folded into cls_token
            sd["reg_token"] = sd.pop("register_tokens")
            if "pos_embed" in sd and "cls_token" in sd:
                sd["cls_token"] = sd["cls_token"] + sd["pos_embed"][:, :1]
                sd["pos_embed"] = sd["pos_embed"][:, 1:]
    if "pos_embed" in sd and sd["pos_embed"].dim() == 3:
        prefix = 0 if model.no_embed_class else int(model.num_prefix_tokens)
        sd["pos_embed"] = resample_abs_pos_embed(sd["pos_embed"], new_size=[grid, grid], num_prefix_tokens=prefix)
    return sd


def _check_keys(sd: dict[str, torch.Tensor], model: torch.nn.Module, where: str, arch: TeacherArch) -> None:
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
    wrong = [f"{k}: {list(sd[k].shape)} vs {list(v.shape)}" for k, v in expected.items()
             if k in sd and sd[k].shape != v.shape]
    if missing or unexpected or wrong:
        problems = ([f"missing {missing[:4]}"] if missing else []) + \
            ([f"unexpected {unexpected[:4]}"] if unexpected else []) + ([f"shape mismatch {wrong[:3]}"] if wrong else [])
        raise UserError(f"{where}: {_describe(sd)}, not {arch.label} ({'; '.join(problems)}); nothing was loaded")
    bad = [k for k, v in sd.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise UserError(f"{where}: non-finite values in {bad[:4]}; the file is corrupt")
