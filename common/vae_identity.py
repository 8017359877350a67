"""The VAE's identity record, which manifests and checkpoints store (docs/FORMAT.md): what a loaded VAE is (its
latent scale and per-channel statistics, geometry, class and what its `encode` returns: `describe_vae`, and the
record of one of NanoGen's spaces: `space_vae_identity`), how a local source is recorded (`local_source`, the
weights' hash) and where the VAE a record names is found again (`recorded_vae`). Loading is common/vae.py's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import sha256_file
from dit_pipeline.common.latent_spaces import VAE_SPACES, Layout, space_identity

_WEIGHT_NAMES = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin",
                 "diffusion_pytorch_model.fp16.safetensors")
# The side of the blank image a VAE of another class encodes once at load time, to learn its geometry and output.
_PROBE_SIZE = 128


def recorded_vae(identity: dict[str, Any] | None, where: str, base: str | Path | None = None
                 ) -> tuple[str, str | None] | None:
    """(--vae, --vae-config) of the VAE an identity record (a manifest's or checkpoint's) names, or None when
    there is no record. A local folder or file is used only while it still exists (UserError naming it
    otherwise); a hub id is used as recorded (it fails at once when neither cached nor reachable).

    Records store local paths absolute (`source`; `source_given` is the path as typed). Records written before
    that may hold a relative path, typed in a working directory nobody recorded: it is looked for relative to
    `base` (the manifest's folder, where the shards were written) first, then to the current directory."""
    if not identity or not identity.get("source"):
        return None
    source, kind = str(identity["source"]), identity.get("kind")
    if kind == "pixels":  # nothing to find: the identity decoder (common/pixels.py)
        return source, None
    config = identity.get("config")
    config = None if config in (None, "builtin:sd-vae") else str(config)
    if kind == "hub" and identity.get("latent_space") in VAE_SPACES:  # NanoGen's name (common/latent_spaces.py)
        return str(identity["latent_space"]), None
    if kind == "hub":
        return source, None
    exists = Path.is_dir if kind == "folder" else Path.is_file
    tried = _candidates(source, base)
    for path in tried:
        if exists(path):
            return str(path), (str(_candidates(config, base, exists=Path.exists)[0]) if config else None)
    where_tried = " or ".join(str(p.absolute()) for p in tried)
    raise UserError(f"{where} records the VAE {source!r}, a local {kind} that does not exist here "
                    f"({where_tried}); pass --vae (the VAE the shards were extracted with)")


def _candidates(path: str, base: str | Path | None, exists=None) -> list[Path]:
    """Where a recorded local path may be: itself when absolute, else under `base`, then under the current
    directory (with `exists`, the first that exists comes first)."""
    p = Path(path).expanduser()
    found = [p] if p.is_absolute() else [*([Path(base) / p] if base is not None else []), Path.cwd() / p]
    if exists is not None:
        found.sort(key=lambda c: not exists(c))
    return found


def local_source(spec: str | Path) -> str:
    """The absolute form of a local --vae / --vae-config path, as records store it (so that sampling or
    drawing grids from another folder finds the same files)."""
    return str(Path(spec).expanduser().resolve())


def folder_weights_hash(folder: Path) -> str | None:
    for name in _WEIGHT_NAMES:
        f = folder / name
        if f.is_file():
            return sha256_file(f)
    return None


def _config_value(vae: Any, key: str) -> Any:
    cfg = vae.config
    return cfg.get(key) if hasattr(cfg, "get") else getattr(cfg, key, None)


def describe_vae(vae: Any, spec: str) -> dict[str, Any]:
    """The identity fields read from a loaded VAE: its latent scale and per-channel statistics, geometry and
    class, and (for anything but an AutoencoderKL, whose posterior is known) what its encode returns. Keys
    that an SD-VAE's identity never had appear only when they apply, so its identity stays what it was."""
    if isinstance(vae, Layout):
        return {"scaling_factor": 1.0, "shift_factor": None, "class": type(vae.vae).__name__, **vae.describe()}
    scaling = _config_value(vae, "scaling_factor")
    if scaling is None:
        raise UserError(f"VAE {spec!r} has no scaling_factor in its config; cannot scale latents")
    shift = _config_value(vae, "shift_factor")
    out: dict[str, Any] = {"scaling_factor": float(scaling), "shift_factor": None if shift is None else float(shift)}
    name = type(vae).__name__
    if name == "AutoencoderKL":
        channels, factor, output = int(vae.config.latent_channels), 2 ** (len(vae.config.block_out_channels) - 1), None
    elif name == "AutoencoderDC":  # encode(x).latent, downsampling 2 ** (stages - 1) (diffusers' attribute)
        channels, factor, output = int(vae.config.latent_channels), int(vae.spatial_compression_ratio), "latent"
    else:
        channels, factor, output = _probe(vae, spec)
    out["latent_channels"], out["downsample_factor"], out["class"] = channels, factor, name
    if output is not None:
        out["encoder_output"] = output
    mean, std = _config_value(vae, "latents_mean"), _config_value(vae, "latents_std")
    if mean is not None and std is not None:
        out["latents_mean"], out["latents_std"] = [float(v) for v in mean], [float(v) for v in std]
    return out


@torch.no_grad()
def _probe(vae: Any, spec: str) -> tuple[int, int, str]:
    """(latent channels, downsampling factor, "latent_dist" | "latent") of a VAE of another class, from one
    encode of a blank image (its config's spatial_compression_ratio, where it has one, must agree)."""
    x = torch.zeros(1, 3, _PROBE_SIZE, _PROBE_SIZE)
    try:
        out = vae.encode(x)
    except Exception as e:  # the class's own failure, e.g. a video VAE that wants [B, C, T, H, W]
        raise UserError(f"--vae {spec!r} ({type(vae).__name__}) cannot encode a [1, 3, {_PROBE_SIZE}, {_PROBE_SIZE}] "
                        f"image batch ({type(e).__name__}: {e}); only image autoencoders are supported") from None
    z, kind = _encoder_latent(out)
    if z is None:
        raise UserError(f"--vae {spec!r} ({type(vae).__name__}): its encode returns neither .latent_dist (a "
                        "posterior) nor .latent; dit-extract cannot read its latents")
    factor = _PROBE_SIZE // int(z.shape[-1])
    stated = getattr(vae, "spatial_compression_ratio", None)
    if z.dim() != 4 or z.shape[-1] * factor != _PROBE_SIZE or (stated is not None and int(stated) != factor):
        raise UserError(f"--vae {spec!r} ({type(vae).__name__}) encodes a {_PROBE_SIZE} px image to shape "
                        f"{list(z.shape)}, not a [1, C, h, w] latent of a power-of-two downsampling"
                        + (f" (its config says {stated})" if stated is not None else ""))
    return int(z.shape[1]), factor, kind


def _encoder_latent(out: Any) -> tuple[Any, str | None]:
    """(a tensor of the encoder output's shape, which output) of `vae.encode(x)`."""
    dist = getattr(out, "latent_dist", None)
    if dist is not None:
        return dist.mean, "latent_dist"
    latent = getattr(out, "latent", None)
    return (latent, "latent") if latent is not None else (None, None)


def space_vae_identity(space: Any, vae: Any, *, revision: str | None = None, commit: str | None = None
                       ) -> dict[str, Any]:
    """The identity `dit-extract --vae NAME` records for NanoGen's space `space` (a VaeSpace) whose VAE `vae` (in
    its layout: `with_layout`) was loaded from its hub id and subfolder: the hub source, the VAE's geometry and
    NanoGen's normalization of the space (common/latent_spaces.py space_identity) under its name."""
    identity: dict[str, Any] = {"source": space.hub_id, "kind": "hub", "subfolder": space.subfolder,
                                "revision": revision or "main"}
    if commit:
        identity["commit"] = commit
    identity.update(describe_vae(vae, space.name))
    identity.pop("latents_mean", None)  # NanoGen's rule decides (space_identity), not diffusers' pipeline rule
    identity.pop("latents_std", None)
    identity.update(space_identity(space, vae))
    return identity
