"""Loading the VAE (diffusers `AutoencoderKL`, as the SD-VAE, SD3, FLUX and REPA-E's VAEs are published, or
`AutoencoderDC`) from a hub id, a local diffusers folder or a single original-format weight file, with its
identity record for manifests and checkpoints (common/vae_identity.py).

Offline clusters are the common case, so a single `.safetensors`/`.ckpt` file loads with the SD-VAE config
shipped here (docs/REFERENCE.md: the diffusers config of sd-vae-ft-ema/-mse) instead of fetching it from the Hub.
The latent scale comes from the loaded config (`scaling_factor`, `shift_factor`, and per-channel
`latents_mean` / `latents_std` where the config has them: common/latent_norm.py), never from a literal; so do
the geometry (`latent_channels`, the downsampling factor) and what `encode` returns: a posterior
(`.latent_dist`, AutoencoderKL) or a deterministic latent (`.latent`, AutoencoderDC and any other class whose
`encode` returns one; identity `encoder_output: "latent"`), read by `encode_latents`.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import safetensors.torch  # noqa: F401  (see below)
import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import sha256_file
from dit_pipeline.common.latent_spaces import DIFFUSERS_MIN, VAE_SPACES, with_layout
from dit_pipeline.common.vae_identity import describe_vae, folder_weights_hash, local_source, space_vae_identity

# diffusers' save_pretrained/from_pretrained call `safetensors.torch.save_file`/`load_file` after a bare
# `import safetensors`: the submodule must have been imported by someone. diffusers 0.29 with a current
# huggingface_hub imports it nowhere (AttributeError: module 'safetensors' has no attribute 'torch'; found by
# `make test-min-deps`), so it is imported here, and every module that lets diffusers read or write weights
# imports this one.
DEFAULT_VAE = "stabilityai/sd-vae-ft-ema"
SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")
# AutoencoderDC (DC-AE) came with diffusers 0.32, the FLUX.2 and Qwen-Image VAEs later (common/latent_spaces.py
# DIFFUSERS_MIN); the project's floor stays 0.29.2 for everything else.
DC_MIN_DIFFUSERS = DIFFUSERS_MIN["AutoencoderDC"]

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
    """'folder', 'file' or 'hub' for a --vae value; a value that can only be a local path (a hub id is
    owner/name) and does not exist fails at once, naming the path tried."""
    p = Path(spec).expanduser()
    if p.is_dir():
        return "folder"
    if p.is_file():
        return "file"
    looks_local = (spec.lower().endswith(SINGLE_FILE_SUFFIXES) or spec.startswith((".", "/", "~"))
                   or spec.count("/") != 1)
    if spec in ("ema", "mse"):  # the reference DiT scripts' --vae choices (e.g. from a --config file)
        raise UserError(f"--vae {spec!r}: the reference DiT scripts' short name; pass the hub id "
                        f"stabilityai/sd-vae-ft-{spec} (or a local copy of it: a diffusers folder or a single "
                        ".safetensors file)")
    if looks_local:
        raise UserError(f"--vae {spec!r}: no such file or folder ({p.absolute()}), and not a hub id (owner/name, "
                        f"e.g. {DEFAULT_VAE}). Pass a local diffusers folder (with config.json), a single "
                        ".safetensors/.ckpt file, or a hub id")
    return "hub"


def _hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the Hugging Face hub cannot be reached (a TCP connect within `timeout` s), or None if it can or a
    proxy is configured (then the hub client decides). Without this check an offline machine spends about
    half a minute in the hub client's retries before failing."""
    import socket
    from urllib.parse import urlparse

    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    from huggingface_hub import constants

    url = urlparse(os.environ.get("HF_ENDPOINT") or constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "", port), timeout=timeout).close()
    except OSError as e:
        return f"{url.scheme}://{url.netloc} is unreachable: {e.strerror or e}"
    return None


def _hub_offline_reason() -> str | None:
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    return "HF_HUB_OFFLINE is set" if offline else _hub_unreachable()


def _not_found(spec: str, why: str, subfolder: str | None = None, name: str | None = None) -> UserError:
    from huggingface_hub import constants

    if name is not None:  # a latent-space name: its hub repository must be in the cache
        where = f"{spec}, subfolder {subfolder}" if subfolder else spec
        include = f" --include '{subfolder}/*'" if subfolder else ""
        return UserError(f"--vae {name!r} is NanoGen's {name} latent space ({where}), which is not in the Hugging "
                         f"Face cache ({constants.HF_HUB_CACHE}), and the hub was not asked ({why}); fill the cache "
                         f"where there is a network (huggingface-cli download {spec}{include}) and point HF_HOME "
                         "at it")
    return UserError(f"--vae {spec!r}: no local file or folder of that name ({Path(spec).absolute()}), not in "
                     f"the Hugging Face cache ({constants.HF_HUB_CACHE}), and the hub was not asked ({why}). "
                     "Pass a local diffusers folder or a single .safetensors file (--vae /path/to/vae), or "
                     f"fill the cache where there is a network (huggingface-cli download {spec})")


def _load_hub_vae(spec: str, revision: str | None, subfolder: str | None = None, cls_name: str | None = None,
                  name: str | None = None):
    """The VAE of a hub id (its config's class, or `cls_name`), in `subfolder` of the repository: from the hub,
    or from the local cache when the hub is off or unreachable; UserError saying what was tried (local path,
    cache, hub) when neither has it. `name`: the --vae value typed (a latent-space name), for messages."""
    from diffusers import AutoencoderKL

    sub = {"subfolder": subfolder} if subfolder else {}
    kw = dict(revision=revision, torch_dtype=torch.float32, low_cpu_mem_usage=False, **sub)
    why = _hub_offline_reason()
    local = {} if why is None else {"local_files_only": True}
    try:
        if cls_name is None:
            cls_name = AutoencoderKL.load_config(spec, revision=revision, **sub, **local).get("_class_name")
        return vae_class(cls_name, name or spec).from_pretrained(spec, **kw, **local)
    except (OSError, ValueError):
        if why is None:
            raise
        raise _not_found(spec, why, subfolder, name) from None


def vae_class(name: str | None, spec: str) -> Any:
    """The diffusers class a VAE config names (`_class_name`; none: AutoencoderKL). AutoencoderDC needs
    diffusers >= 0.32: an older one is one UserError saying so."""
    import diffusers

    name = name or "AutoencoderKL"
    cls = getattr(diffusers, name, None)
    if cls is None and name in DIFFUSERS_MIN:
        what = {"AutoencoderDC": "an AutoencoderDC (DC-AE)"}.get(name, f"an {name}")
        raise UserError(f"--vae {spec!r} is {what}, which diffusers provides from version {DIFFUSERS_MIN[name]} "
                        f"on; this environment has diffusers {diffusers.__version__}: pip install "
                        f"'diffusers>={DIFFUSERS_MIN[name]}'")
    if cls is None or not all(hasattr(cls, m) for m in ("from_pretrained", "encode", "decode")):
        raise UserError(f"--vae {spec!r}: its config names the class {name!r}, which diffusers "
                        f"{diffusers.__version__} does not provide as an autoencoder (encode/decode); "
                        "AutoencoderKL and AutoencoderDC are the usual ones")
    return cls


def load_vae(spec: str = DEFAULT_VAE, *, config: str | Path | None = None, revision: str | None = None,
             device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """Load a VAE (the class its config names: AutoencoderKL, AutoencoderDC, ...) and describe it.

    spec: hub id, local diffusers folder (a pipeline folder with a `vae/` subfolder works too) or single file;
    or an RAE decoder state_dict file (`FILE` or `FILE,CONFIG`: common/rae_decoder.py), for feature spaces.
    config: for single files, a folder holding the diffusers config (default: the SD-VAE config above).
    Returns (vae in eval mode on `device`, identity dict for manifests).

    Draws no global random numbers: diffusers builds the model (randomly initialised, at some versions) before
    it loads the weights, and a VAE loaded during training (the sample-grid hook) must not move the trainer's
    random state.
    """
    from dit_pipeline.common.rae_decoder import is_rae_decoder, load_rae_decoder

    from dit_pipeline.common.pixels import is_pixel_space, load_pixel_space

    if is_pixel_space(spec):  # a pixel-space model decodes by the identity (common/pixels.py)
        return load_pixel_space(device=device)
    if is_rae_decoder(spec):  # RAE's pixel decoder of a feature space (FILE or FILE,CONFIG; common/rae_decoder.py)
        return load_rae_decoder(spec, config=config, device=device, dtype=dtype)
    with torch.random.fork_rng(devices=[]):
        if spec in VAE_SPACES and not Path(spec).expanduser().exists():  # NanoGen's name (a local path wins)
            return _load_space(spec, revision=revision, device=device, dtype=dtype)
        return _load_vae(spec, config=config, revision=revision, device=device, dtype=dtype)


def _config_class(path: Path) -> str | None:
    """The `_class_name` of a diffusers config.json (None when it has none or cannot be read: the loader then
    says what is wrong)."""
    try:
        name = json.loads(path.read_text(encoding="utf-8")).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return None
    return str(name) if name else None


def encode_latents(vae: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(mean, std) of the posterior the VAE encodes x to, or (latent, None) for an encoder without one."""
    out = vae.encode(x)
    dist = getattr(out, "latent_dist", None)
    if dist is not None:
        return dist.mean, dist.std
    return out.latent, None


def _load_vae(spec: str, *, config: str | Path | None, revision: str | None, device: torch.device | str,
              dtype: torch.dtype):
    from diffusers import AutoencoderKL

    kind = classify_vae_spec(spec)
    identity: dict[str, Any] = {"source": spec if kind == "hub" else local_source(spec), "kind": kind}
    if identity["source"] != spec:
        identity["source_given"] = spec  # as typed, for display
    try:
        if kind == "folder":
            folder = Path(spec).expanduser()
            if not (folder / "config.json").is_file() and (folder / "vae" / "config.json").is_file():
                folder = folder / "vae"
            if not (folder / "config.json").is_file():
                raise UserError(f"--vae {spec!r}: folder has no config.json (expected a diffusers VAE "
                                "folder, as written by save_pretrained)")
            cls = vae_class(_config_class(folder / "config.json"), spec)
            vae = cls.from_pretrained(str(folder), torch_dtype=torch.float32, low_cpu_mem_usage=False)
            identity["weights_sha256"] = folder_weights_hash(folder)
        elif kind == "file":
            cfg_dir = Path(config) if config is not None else sd_vae_config_dir()
            named = _config_class(cfg_dir / "config.json")
            if named not in (None, "AutoencoderKL"):
                raise UserError(f"--vae {spec!r}: a single weight file loads as an AutoencoderKL only, but "
                                f"--vae-config names {named}; pass the VAE's diffusers folder instead")
            vae = AutoencoderKL.from_single_file(str(Path(spec).expanduser()), config=str(cfg_dir),
                                                 torch_dtype=torch.float32, local_files_only=True)
            identity["weights_sha256"] = sha256_file(Path(spec).expanduser())
            identity["config"] = local_source(config) if config is not None else "builtin:sd-vae"
        else:
            vae = _load_hub_vae(spec, revision)
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
        raise UserError(f"could not load the VAE from {spec!r}: {type(e).__name__}: {str(e).rstrip('.')}.{hint}") from e
    vae = with_layout(vae)  # FLUX.2's patchified latent, Qwen-Image's one frame (common/latent_spaces.py)
    identity.update(describe_vae(vae, spec))
    vae = vae.to(device).eval().requires_grad_(False)
    if dtype != torch.float32:  # diffusers warns on any dtype cast, so cast only when asked to
        vae = vae.to(dtype)
    return vae, identity


def _load_space(name: str, *, revision: str | None, device: torch.device | str, dtype: torch.dtype):
    """NanoGen's VAE latent space `name` (common/latent_spaces.py VAE_SPACES): its hub id and subfolder in the
    class NanoGen loads, from the hub or the local cache, with NanoGen's normalization in the identity."""
    space = VAE_SPACES[name]
    try:
        vae = _load_hub_vae(space.hub_id, revision, space.subfolder, space.cls, name=name)
    except UserError:
        raise
    except (OSError, ValueError, EnvironmentError) as e:
        raise UserError(f"could not load NanoGen's {name} VAE ({space.hub_id}"
                        f"{', subfolder ' + space.subfolder if space.subfolder else ''}): {type(e).__name__}: "
                        f"{str(e).rstrip('.')}. Loading it needs the network or a filled Hugging Face cache "
                        "(HF_HUB_OFFLINE=1)") from e
    vae = with_layout(vae)
    commit = getattr(vae.config, "_commit_hash", None) or _cached_commit(space.hub_id, space.subfolder, revision)
    identity = space_vae_identity(space, vae, revision=revision, commit=commit)
    vae = vae.to(device).eval().requires_grad_(False)
    if dtype != torch.float32:
        vae = vae.to(dtype)
    return vae, identity


def _cached_commit(repo_id: str, subfolder: str | None, revision: str | None) -> str | None:
    """The commit of the cached snapshot that holds the repository's config (what was loaded), or None."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, f"{subfolder}/config.json" if subfolder else "config.json",
                                       revision=revision)
    except Exception:  # noqa: BLE001 - an identity detail, never a reason to fail
        return None
    if not isinstance(found, str):
        return None
    parts = Path(found).parts
    return parts[parts.index("snapshots") + 1] if "snapshots" in parts else None
