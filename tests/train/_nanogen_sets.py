"""The sets a NanoGen recipe's own `recipe.extraction` commands write, as manifests, without reading an image or
loading real weights: each command parsed by dit-extract's CLI into its ExtractConfig, the tokenizer's identity from
the registries' identity builders (common/vae_identity.py `space_vae_identity` on a tiny random stand-in of the
space's class with the space's geometry; common/nanogen_encoders.py `space_encoder_identity`; common/pixels.py),
then what dit-extract decides from them (extract/tokenizer.py: the latent shape, the store, the normalization with the
command's --latent-stats file; extract/run.py: samples per shard, the extraction record) over ImageNet's 1,281,167
images in shards of the command's size. The text command's set is its encoder's identity (the preset, with Qwen3-0.6B's
width)."""
from __future__ import annotations

import functools
import math
import shlex
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping

import pytest
import torch

from dit_pipeline.extract.config import ExtractConfig
from dit_pipeline.shards import (Manifest, ShardRecord, format_version_for, sample_key, shard_name,
                                 write_manifest)

IMAGENET = 1_281_167
CLASSES = tuple(f"n{c:08d}" for c in range(1000))
# The hub configs' normalization fields NanoGen's rule reads, for the AutoencoderKL stand-ins (src/stage1/vae.py
# l.137-149): REPA-E/e2e-vavae-hf ships latents_mean/latents_std (NanoGen normalizes it per channel); the others
# scaling and shift factors (FLUX.1's and SD3.5's configs: 0.3611 / 0.1159 and 1.5305 / 0.0609; a preset's own
# factors win over these). AutoencoderKLQwenImage's config always has latents_mean/std, FLUX.2 its BatchNorm.
PER_CHANNEL_CONFIGS = frozenset({"e2e-vavae"})
CONFIG_FACTORS = {"flux": (0.3611, 0.1159), "e2e-flux": (0.3611, 0.1159), "sd3.5": (1.5305, 0.0609),
                  "e2e-sd3.5": (1.5305, 0.0609)}
QWEN3_0_6B_DIM = 1024  # Qwen/Qwen3-0.6B's hidden_size (its config.json): the text set's width


def commands(recipe: Mapping[str, Any]) -> list[list[str]]:
    """The recipe's extraction commands (joined by " && "), each as its words."""
    return [shlex.split(c) for c in str(recipe["extraction"]).split(" && ")]


def parse(words: list[str]) -> ExtractConfig:
    """The ExtractConfig dit-extract's CLI makes of `words` ("dit-extract", options...); click.UsageError when an
    option does not exist or takes another value."""
    from dit_pipeline import cli

    assert words[0] == "dit-extract", words
    ctx = cli.extract_main.make_context("dit-extract", list(words[1:]))
    params = dict(ctx.params)
    params.pop("debug", None)
    return ExtractConfig(**params).validate()


def roles(recipe: Mapping[str, Any]) -> dict[str, ExtractConfig]:
    """{"latents": ..., "reg": REG's class tokens, "text": the text set} of the recipe's commands."""
    out: dict[str, ExtractConfig] = {}
    for words in commands(recipe):
        cfg = parse(words)
        role = "text" if cfg.text_encoder else "reg" if cfg.encoder_formula == "reg" else "latents"
        assert role not in out, (role, recipe["extraction"])
        out[role] = cfg
    return out


@functools.lru_cache(maxsize=None)
def stand_in_vae(name: str) -> torch.nn.Module:
    """A tiny random VAE of space `name`'s class with its latent channels and downsampling, in its layout."""
    from diffusers import AutoencoderKL

    from dit_pipeline.common.latent_spaces import VAE_SPACES, with_layout

    s = VAE_SPACES[name]
    if getattr(__import__("diffusers"), s.cls, None) is None:  # make test-min-deps: diffusers at its floor
        from dit_pipeline.common.latent_spaces import DIFFUSERS_MIN

        pytest.skip(f"the {name} space's {s.cls} needs diffusers >= {DIFFUSERS_MIN[s.cls]} (older releases are "
                    "refused naming that version: tests/common/test_latent_spaces.py)")
    c, h, _ = s.latent_256
    factor = 256 // h
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if s.cls == "AutoencoderKLFlux2":  # 32 channels at f8, patchified 2 x 2
            from diffusers import AutoencoderKLFlux2

            k = int(math.log2(factor // 2)) + 1
            vae = AutoencoderKLFlux2(block_out_channels=(8,) * k, down_block_types=("DownEncoderBlock2D",) * k,
                                     up_block_types=("UpDecoderBlock2D",) * k, latent_channels=c // 4,
                                     norm_num_groups=4, layers_per_block=1)
        elif s.cls == "AutoencoderKLQwenImage":
            from diffusers import AutoencoderKLQwenImage

            k = int(math.log2(factor))
            vae = AutoencoderKLQwenImage(base_dim=8, z_dim=c, dim_mult=[1] * (k + 1), num_res_blocks=1,
                                         temperal_downsample=[False] * k)
        else:
            k = int(math.log2(factor)) + 1
            stats = dict(latents_mean=[0.1] * c, latents_std=[1.5] * c) if name in PER_CHANNEL_CONFIGS else {}
            scale, shift = CONFIG_FACTORS.get(name, (0.18215, 0.0))
            vae = AutoencoderKL(block_out_channels=(8,) * k, down_block_types=("DownEncoderBlock2D",) * k,
                                up_block_types=("UpDecoderBlock2D",) * k, latent_channels=c, norm_num_groups=4,
                                layers_per_block=1, scaling_factor=scale, shift_factor=shift, **stats)
    return with_layout(vae.eval())


def identity(cfg: ExtractConfig) -> dict[str, Any]:
    """The tokenizer identity the command records (`extraction.vae`, or `extraction.encoder`)."""
    from dit_pipeline.common.latent_spaces import VAE_SPACES
    from dit_pipeline.common.nanogen_encoders import ENCODER_SPACES, space_encoder_identity, weights_record
    from dit_pipeline.common.pixels import is_pixel_space, load_pixel_space
    from dit_pipeline.common.vae_identity import space_vae_identity

    if cfg.encoder and is_pixel_space(cfg.encoder):
        return dict(load_pixel_space(cfg.image_size)[1])
    if cfg.encoder:
        space = ENCODER_SPACES[cfg.encoder]  # a KeyError: the command names none of NanoGen's encoders
        assert cfg.encoder_weights is None
        return space_encoder_identity(space, image_size=cfg.image_size, weights=weights_record(space, None, True),
                                      formula="reg" if cfg.encoder_formula == "reg" else "nanogen")
    return space_vae_identity(VAE_SPACES[cfg.vae], stand_in_vae(cfg.vae))


def write_stats(path: Path, shape: list[int]) -> None:
    """A statistics file of NanoGen's stats.pt form (mean and var per channel and position) at `path`."""
    if path.is_file():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    torch.save({"mean": torch.randn(shape, generator=g) * 0.1, "var": torch.rand(shape, generator=g) + 0.5}, path)


def command_manifest(cfg: ExtractConfig, root: Path, total: int = IMAGENET,
                     classes: tuple[str, ...] = CLASSES) -> Manifest:
    """The manifest the latent (or class-token) command `cfg` writes for `total` images (none read), run in the
    folder `root` (where a stand-in of the statistics file its --latent-stats names is written)."""
    import dataclasses

    from dit_pipeline.extract.files import ImageList
    from dit_pipeline.extract.run import _samples_per_shard, extraction_record
    from dit_pipeline.extract.tokenizer import check_store, latent_shape, resolve_normalization

    ident = identity(cfg)
    check_store(cfg, ident)
    shape = latent_shape(cfg, ident)
    if cfg.latent_stats:
        cfg = dataclasses.replace(cfg, latent_stats=str(root / cfg.latent_stats))
        write_stats(Path(cfg.latent_stats), shape)
    norm = resolve_normalization(cfg, ident, shape)
    per = _samples_per_shard(cfg, shape)
    images = ImageList(Path(cfg.data_path), classes, (), ())
    record = extraction_record(cfg, images, ident, precision=cfg.precision if cfg.precision != "auto" else "fp32",
                               batch_size=32, samples_per_shard=per, device=torch.device("cpu"))
    shards, n = [], 0
    while n < total:
        k = min(per, total - n)
        shards.append(ShardRecord(shard_name(len(shards)), k, sample_key(n), sample_key(n + k - 1), 1 << 20, "0" * 64))
        n += k
    pixels = None
    if cfg.pixels:
        from dit_pipeline.shards.pixels import pixels_entry

        pixels = pixels_entry(cfg.image_size, total, cfg.pixel_encoding)
    return Manifest(format_version=format_version_for(pixels=cfg.pixels, normalization=norm.is_per_channel),
                    tool_version="test", extraction=record, normalization=norm.per_channel,
                    scaling_factor=float(norm.scaling_factor), shift_factor=norm.shift_factor,
                    image_size=cfg.image_size, views=cfg.views, store=cfg.shard_store, dtype=cfg.dtype,
                    latent_shape=list(shape), class_names=list(classes), num_classes=len(classes),
                    total_samples=total, samples_per_shard=per, shards=shards, skipped=[], pixels=pixels)


def text_set(cfg: ExtractConfig) -> SimpleNamespace:
    """What extraction_departures reads of the text set the text command writes: its encoder's identity."""
    from dit_pipeline.common.text_encoders import resolve_spec

    source, preset, length = resolve_spec(str(cfg.text_encoder))
    return SimpleNamespace(text_encoder={"source": source, "name": preset, "preset": preset, "dim": QWEN3_0_6B_DIM,
                                         "max_length": cfg.text_max_length or length})


def write_sets(recipe: Mapping[str, Any], root: Path) -> dict[str, Path]:
    """The manifests of the recipe's latent set and, for REG, its class tokens, written under root (no shard: a
    plan reads the manifests; the commands run in root); {"latents": manifest.json path, "reg": the token set's
    folder}."""
    cfgs = roles(recipe)
    out: dict[str, Path] = {}
    for role in ("latents", "reg"):
        if role in cfgs:
            folder = root / role
            folder.mkdir(parents=True)
            write_manifest(folder, command_manifest(cfgs[role], root))
            out[role] = folder
    out["latents"] = out["latents"] / "manifest.json"
    return out
