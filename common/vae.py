"""Loading the Stable Diffusion VAE (diffusers `AutoencoderKL`) from a hub id, a local diffusers folder or
a single original-format weight file, with an identity record for manifests and checkpoints.

Offline clusters are the common case, so a single `.safetensors`/`.ckpt` file loads with the SD-VAE config
shipped here (docs/REFERENCE.md: the diffusers config of sd-vae-ft-ema/-mse) instead of fetching it from the Hub.
The latent scale comes from the loaded config (`scaling_factor`, `shift_factor`), never from a literal.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import sha256_file

DEFAULT_VAE = "stabilityai/sd-vae-ft-ema"
SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")
_WEIGHT_NAMES = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin",
                 "diffusion_pytorch_model.fp16.safetensors")

# The diffusers config of stabilityai/sd-vae-ft-ema and sd-vae-ft-mse (KL-f8, ~84M parameters).
SD_VAE_CONFIG: dict[str, Any] = {
    "_class_name": "AutoencoderKL",
    "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "in_channels": 3,
    "latent_channels": 4,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "out_channels": 3,
    "sample_size": 256,
    "scaling_factor": 0.18215,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
}


def sd_vae_config_dir(root: str | Path | None = None) -> Path:
    """Write the SD-VAE diffusers config into a folder (a temp one by default) and return it."""
    folder = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="sd-vae-config-"))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(SD_VAE_CONFIG, indent=2))
    return folder


def build_sd_vae(config: dict[str, Any] | None = None):
    """An AutoencoderKL with the SD-VAE architecture and random weights (real cost, for benchmarks)."""
    from diffusers import AutoencoderKL

    cfg = {k: v for k, v in (config or SD_VAE_CONFIG).items() if not k.startswith("_")}
    return AutoencoderKL(**cfg)


def classify_vae_spec(spec: str) -> str:
    """'folder', 'file' or 'hub' for a --vae value (also checks that local paths exist)."""
    p = Path(spec).expanduser()
    if p.is_dir():
        return "folder"
    if p.is_file():
        return "file"
    looks_local = spec.lower().endswith(SINGLE_FILE_SUFFIXES) or spec.startswith((".", "/", "~")) or spec.count("/") > 1
    if looks_local:
        raise UserError(f"--vae {spec!r}: no such file or folder. Pass a hub id (e.g. {DEFAULT_VAE}), a local "
                        "diffusers folder (with config.json), or a single .safetensors/.ckpt file.")
    return "hub"


def _folder_weights_hash(folder: Path) -> str | None:
    for name in _WEIGHT_NAMES:
        f = folder / name
        if f.is_file():
            return sha256_file(f)
    return None


def load_vae(spec: str = DEFAULT_VAE, *, config: str | Path | None = None, revision: str | None = None,
             device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """Load an AutoencoderKL and describe it.

    spec: hub id, local diffusers folder (a pipeline folder with a `vae/` subfolder works too) or single file.
    config: for single files, a folder holding the diffusers config (default: the SD-VAE config above).
    Returns (vae in eval mode on `device`, identity dict for manifests).
    """
    from diffusers import AutoencoderKL

    kind = classify_vae_spec(spec)
    identity: dict[str, Any] = {"source": spec, "kind": kind}
    try:
        if kind == "folder":
            folder = Path(spec).expanduser()
            if not (folder / "config.json").is_file() and (folder / "vae" / "config.json").is_file():
                folder = folder / "vae"
            if not (folder / "config.json").is_file():
                raise UserError(f"--vae {spec!r}: folder has no config.json (expected a diffusers AutoencoderKL "
                                "folder, as written by save_pretrained)")
            vae = AutoencoderKL.from_pretrained(str(folder), torch_dtype=torch.float32, low_cpu_mem_usage=False)
            identity["weights_sha256"] = _folder_weights_hash(folder)
        elif kind == "file":
            cfg_dir = Path(config) if config is not None else sd_vae_config_dir()
            vae = AutoencoderKL.from_single_file(str(Path(spec).expanduser()), config=str(cfg_dir),
                                                 torch_dtype=torch.float32, local_files_only=True)
            identity["weights_sha256"] = sha256_file(Path(spec).expanduser())
            identity["config"] = str(config) if config is not None else "builtin:sd-vae"
        else:
            vae = AutoencoderKL.from_pretrained(spec, revision=revision, torch_dtype=torch.float32,
                                                low_cpu_mem_usage=False)
            identity["revision"] = revision or "main"
            commit = getattr(vae.config, "_commit_hash", None)
            if commit:
                identity["commit"] = commit
    except UserError:
        raise
    except (RuntimeError, KeyError) as e:
        if kind != "file":
            raise
        # load_state_dict lists every mismatching tensor; the first lines say enough.
        detail = " ".join(str(e).strip().splitlines()[:2])
        raise UserError(f"could not load the VAE from {spec!r}: its weights do not fit the config "
                        f"{'builtin:sd-vae' if config is None else str(config)!r} ({type(e).__name__}: {detail} ...). "
                        "Pass an SD-VAE (KL-f8) weight file, or --vae-config with a folder holding the "
                        "diffusers config.json of this VAE.") from e
    except (OSError, ValueError, EnvironmentError) as e:
        hint = ""
        if kind == "hub":
            hint = (" Loading a hub id needs the network (or a filled Hugging Face cache with HF_HUB_OFFLINE=1). "
                    "On an offline cluster pass a local diffusers folder or a single .safetensors file.")
        raise UserError(f"could not load the VAE from {spec!r}: {type(e).__name__}: {e}.{hint}") from e
    scaling = vae.config.get("scaling_factor") if hasattr(vae.config, "get") else getattr(vae.config, "scaling_factor", None)
    if scaling is None:
        raise UserError(f"VAE {spec!r} has no scaling_factor in its config; cannot scale latents")
    identity["scaling_factor"] = float(scaling)
    shift = getattr(vae.config, "shift_factor", None)
    identity["shift_factor"] = None if shift is None else float(shift)
    identity["latent_channels"] = int(vae.config.latent_channels)
    identity["downsample_factor"] = 2 ** (len(vae.config.block_out_channels) - 1)
    identity["class"] = type(vae).__name__
    vae = vae.to(device).eval().requires_grad_(False)
    if dtype != torch.float32:  # diffusers warns on any dtype cast, so cast only when asked to
        vae = vae.to(dtype)
    return vae, identity
