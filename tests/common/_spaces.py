"""Tiny random VAEs of NanoGen's classes, placed in a Hugging Face cache under their real hub ids and subfolders,
so that `load_vae("flux2")` runs the real offline loading path (HF_HUB_OFFLINE, the cache's snapshot)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def has(cls: str) -> bool:
    """Whether the installed diffusers has `cls` (`make test-min-deps` runs the floor, 0.29.2)."""
    import diffusers

    return getattr(diffusers, cls, None) is not None


NEEDS_FLUX2 = pytest.mark.skipif(not has("AutoencoderKLFlux2"), reason="AutoencoderKLFlux2 needs diffusers >= 0.36.0 "
                                 "(the floor refuses it naming that version: test_old_diffusers_is_refused...)")
NEEDS_QWEN = pytest.mark.skipif(not has("AutoencoderKLQwenImage"), reason="AutoencoderKLQwenImage needs diffusers "
                                ">= 0.35.0 (the floor refuses it naming that version)")


def tiny_flux2(seed: int = 0):
    from diffusers import AutoencoderKLFlux2

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLFlux2(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                                 up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4,
                                 layers_per_block=1, sample_size=32)
        with torch.no_grad():  # statistics far from (0, 1), so a wrong eps or order shows
            vae.bn.running_mean.copy_(torch.randn(16) * 0.5)
            vae.bn.running_var.copy_(torch.rand(16) * 2 + 1e-4)
    return vae.eval()


def tiny_qwen(seed: int = 0, **overrides):
    from diffusers import AutoencoderKLQwenImage

    kw = dict(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False],
              latents_mean=[0.11, -0.27, 0.5, -0.05], latents_std=[1.7, 0.6, 2.9, 1.1])
    kw.update(overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoencoderKLQwenImage(**kw).eval()


def tiny_kl(seed: int = 0, **overrides):
    from diffusers import AutoencoderKL

    kw = dict(in_channels=3, out_channels=3, latent_channels=4, down_block_types=("DownEncoderBlock2D",) * 2,
              up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
              norm_num_groups=4, sample_size=32, scaling_factor=0.5)
    kw.update(overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoencoderKL(**kw).eval()


def put_in_cache(cache: Path, repo_id: str, subfolder: str | None, model) -> Path:
    """save_pretrained into the cache's snapshot of `repo_id` (refs/main -> COMMIT); returns the folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    folder = repo / "snapshots" / COMMIT / (subfolder or "")
    shutil.rmtree(folder, ignore_errors=True) if subfolder else None
    model.save_pretrained(folder)
    return folder


def use_cache(monkeypatch, cache: Path) -> None:
    """This process reads the hub from `cache`, offline (what HF_HUB_CACHE and HF_HUB_OFFLINE=1 do for a CLI)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
