"""How a recipe's `requires` recognises what a set was made with (train/recipes.py `extraction_departures` calls
these): a VAE or text encoder as the release it names (`recognise`), a feature encoder under any of its names
(`recognise_encoder`; the rules: the recipes module docstring), NanoGen's latent space by its name and its
normalization (`requires: latent_space`), and REG's class tokens by their target encoder (`requires: reg`).

`latent_space` names one of NanoGen's spaces (common/latent_spaces.py `VAE_SPACES`, common/nanogen_encoders.py
`ENCODER_SPACES`). A set holds it when its manifest records the name (`dit-extract --vae NAME` / `--encoder NAME`), or,
for a VAE whose space NanoGen normalizes by factors fixed by name (the SD-VAEs), when its VAE is recognised as the
space's repository (`recognise`) with exactly those factors; and its normalization is NanoGen's: a VAE
space's own (the identity's rule, `LatentNorm.of_vae`, not replaced by --latent-stats or a `dit-shards stats --write`
revision), a representation space's from a statistics file (`--latent-stats`, NanoGen's stats.pt; statistics
computed from the shards are others). `reg` is the --reg-tokens set: the target encoder (`recognise_encoder`),
the `reg` formula and the input size of the target's resolution (224 px at 256).
"""
from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import Any, Mapping

# Other names the same weights are published under: the single-file repositories of the SD-VAEs and their files
VAE_ALIASES: dict[str, tuple[str, ...]] = {
    "stabilityai/sd-vae-ft-ema": ("stabilityai/sd-vae-ft-ema-original", "vae-ft-ema-560000-ema-pruned"),
    "stabilityai/sd-vae-ft-mse": ("stabilityai/sd-vae-ft-mse-original", "vae-ft-mse-840000-ema-pruned"),
}
# A feature encoder under NanoGen's name (a config's stage_1.params.encoder_name, src/encoders/vision_encoder.py) and
# the names its weights go by: what NanoGen's loader loads (torch.hub, transformers, its PE and DINOv3 loaders), timm's
# and the hub's names of the same release
ENCODER_NAMES: dict[str, tuple[str, ...]] = {
    "dinov2-vit-b": ("dinov2_vitb14_reg", "vit_base_patch14_reg4_dinov2", "facebook/dinov2-with-registers-base"),
    "dinov3-vit-b16": ("dinov3_vitb16", "vit_base_patch16_dinov3", "facebook/dinov3-vitb16-pretrain-lvd1689m"),
    "siglip2-vit-b": ("google/siglip2-base-patch16-256",),
    "pe-vit-l": ("PE-Core-L14-336", "vit_pe_core_large_patch14_336"),
    "langpe-vit-l": ("PE-Lang-L14-448", "vit_pe_lang_large_patch14_448"),
    "spatialpe-vit-l": ("PE-Spatial-L14-448", "vit_pe_spatial_large_patch14_448"),
}


def hub_parts(name: str) -> tuple[str, str, str | None] | None:
    """(owner, repository, subfolder or None) of "owner/name" or "owner/name/subfolder"."""
    parts = name.strip("/").split("/")
    if len(parts) not in (2, 3) or not all(parts):
        return None
    return parts[0], parts[1], (parts[2] if len(parts) == 3 else None)


_CACHE = re.compile(r"models--([^/]+)--([^/]+)/snapshots/[^/]+(?:/(.+?))?/?$")
_WEIGHT_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")


def _fold(x: str) -> str:
    return x.casefold()


def _is_local(identity: Mapping[str, Any]) -> bool:
    return identity.get("kind") in ("folder", "file") or str(identity.get("source") or "").startswith(("/", "~", "."))


def recognise(required: str, identity: Mapping[str, Any] | None) -> str | None:
    """How a VAE or text encoder identity (a manifest's) is the release `required` names ("owner/name[/subfolder]"):
    "its hub id", "the hub id recorded for it", "its Hugging Face cache path", "its folder name" or "its file name";
    None when it is not recognised as it (module docstring)."""
    if not identity or not identity.get("source"):
        return None
    want = hub_parts(required)
    assert want is not None, required
    owner, repo, sub = want
    source = str(identity["source"]).replace("\\", "/")
    subfolder = identity.get("subfolder")

    def same(hub: str, folder: str | None) -> bool:
        parts = hub_parts(hub)
        if parts is None:
            return False
        o, r, s = parts
        return _fold(f"{o}/{r}") == _fold(f"{owner}/{repo}") and _fold(s or folder or "") == _fold(sub or "")

    if identity.get("hub_id") and same(str(identity["hub_id"]), identity.get("hub_subfolder", subfolder)):
        return "the hub id recorded for it"
    if not _is_local(identity):
        return "its hub id" if same(source, subfolder) else None
    if (m := _CACHE.search(source)) and same(f"{m[1]}/{m[2]}", m[3]):
        return "its Hugging Face cache path"
    path = PurePosixPath(source)
    names = [*(path.parts[:-1]), path.stem if path.suffix.lower() in _WEIGHT_SUFFIXES else path.name]
    tail = [_fold(x) for x in names[-2:]]
    aliases = {_fold(a.rsplit("/", 1)[-1]) for a in VAE_ALIASES.get(f"{owner}/{repo}", ())}
    if sub is not None and tail == [_fold(repo), _fold(sub)]:
        return "its folder name"
    if tail[-1:] == [_fold(repo)]:  # a repository folder (a pipeline's, whose subfolder the loader picks)
        return "its folder name"
    if tail[-1] in aliases:
        return "its file name" if path.suffix.lower() in _WEIGHT_SUFFIXES else "its folder name"
    return None


def recognise_encoder(required: str, identity: Mapping[str, Any] | None) -> str | None:
    """How a feature encoder identity is the encoder NanoGen names `required` ("dinov2-vit-b"), or None."""
    if not identity or identity.get("kind") != "features":
        return None
    if str(identity.get("weights") or "").startswith("random"):
        return None
    names = next(({_fold(n) for n in (k, *v)} for k, v in ENCODER_NAMES.items()
                  if _fold(required) in {_fold(n) for n in (k, *v)}), {_fold(required)})
    for key in ("latent_space", "target_encoder", "name", "hub_id", "model"):  # NanoGen's name first
        if identity.get(key) and _fold(str(identity[key])) in names:
            return f"its {'model name' if key == 'model' else key.replace('_', ' ')} {identity[key]}"
    return None


def is_space(name: str) -> bool:
    """Whether `name` is one of NanoGen's spaces (a VAE's or a representation encoder's)."""
    from dit_pipeline.common.latent_spaces import VAE_SPACES
    from dit_pipeline.common.nanogen_encoders import ENCODER_SPACES

    return name in VAE_SPACES or name in ENCODER_SPACES


def _space_of(extraction: Mapping[str, Any]) -> str | None:
    """NanoGen's name of the space a set holds: the name its extraction recorded (common.latent_spaces.space_name),
    or, for a VAE whose space NanoGen normalizes by fixed factors (the SD-VAEs), a copy recognised as the space's
    repository (`recognise`) with exactly those factors."""
    from dit_pipeline.common.latent_spaces import VAE_SPACES, space_name

    name = space_name(dict(extraction))
    vae = extraction.get("vae") or {}
    if name is not None or not vae or vae.get("normalization") or vae.get("latents_mean"):
        return name
    for s in VAE_SPACES.values():
        hub = s.hub_id + (f"/{s.subfolder}" if s.subfolder else "")
        if s.scaling_factor is not None and recognise(hub, vae) is not None and s.cls == vae.get("class") \
                and vae.get("scaling_factor") == s.scaling_factor and not vae.get("shift_factor"):
            return s.name
    return None


def space_departures(want: str, m: Any, met: list[str]) -> list[str]:
    """The shard set against NanoGen's space `want`: the space it holds, then the normalization NanoGen applies
    to that space (module docstring)."""
    from dit_pipeline.common.latent_norm import LatentNorm, describe_source
    from dit_pipeline.common.latent_spaces import VAE_SPACES

    flag = f"dit-extract --vae {want}" if want in VAE_SPACES else f"dit-extract --encoder {want}"
    have = _space_of(m.extraction)
    if have != want:
        shown = have or "none of NanoGen's"
        return [f"latent space {shown} where the recipe needs NanoGen's {want} ({flag})"]
    norm = m.norm
    if want in VAE_SPACES:
        own = LatentNorm.of_vae(m.extraction.get("vae") or {})
        if norm.key() != own.key():
            return [f"normalization {norm.describe()} where NanoGen normalizes {want} by the VAE's own "
                    f"({own.describe()}; {flag} without --latent-stats, no dit-shards stats --write revision)"]
        met.append(f"latent space {want}: NanoGen's, normalized by the VAE's own")
        return []
    source = (norm.per_channel or {}).get("source") or {}
    if not norm.is_per_position or source.get("kind") != "file":
        what = describe_source(source) if source else norm.describe()
        return [f"normalization from {what} where NanoGen normalizes {want} by its release's statistics file "
                f"({flag} --latent-stats .../stats/{want}/stats.pt)"]
    met.append(f"latent space {want}: NanoGen's, normalized by {describe_source(source)}")
    return []


def reg_departures(want: Mapping[str, Any], reg: Any, folder: str | None, met: list[str]) -> list[str]:
    """REG's class-token set (--reg-tokens) against the target encoder the recipe needs."""
    from dit_pipeline.common.nanogen_encoders import ENCODER_SPACES

    encoder, resolution = str(want["encoder"]), int(want["resolution"])
    needs = f"the class tokens of {encoder} at {resolution} px (dit-extract --encoder {encoder} --encoder-formula reg)"
    if reg is None:
        return [f"no REG class tokens (--reg-tokens) where the recipe needs {needs}"]
    ident = reg.extraction.get("encoder") or {}
    how = recognise_encoder(encoder, ident)
    space = ENCODER_SPACES.get(encoder)
    size = space.input_size(resolution) if space is not None else None
    if how is None or ident.get("formula_name") != "reg" or (size is not None and ident.get("input_size") != size):
        weights = " with random weights" if str(ident.get("weights") or "").startswith("random") else ""
        return [f"REG class tokens {folder}: {ident.get('model')}{weights}, formula {ident.get('formula_name')}, "
                f"{ident.get('input_size')} px input where the recipe needs {needs}, a {size} px input"]
    met.append(f"REG class tokens {encoder} at {resolution} px: {how}")
    return []
