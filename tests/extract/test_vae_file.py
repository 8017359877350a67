"""`--vae` as a single original-format (LDM / CompVis) weight file with a local config folder, offline."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.vae import load_vae


def _ldm_key(key: str, num_blocks: int) -> str:
    """diffusers AutoencoderKL key -> the original LDM checkpoint key (as in vae-ft-mse-840000-ema-pruned)."""
    key = key.replace("conv_norm_out", "norm_out")
    m = re.fullmatch(r"encoder\.down_blocks\.(\d+)\.(resnets|downsamplers)\.(\d+)\.(.+)", key)
    if m:
        i, kind, j, rest = m.groups()
        if kind == "downsamplers":
            return f"encoder.down.{i}.downsample.{rest}"
        return f"encoder.down.{i}.block.{j}.{rest.replace('conv_shortcut', 'nin_shortcut')}"
    m = re.fullmatch(r"decoder\.up_blocks\.(\d+)\.(resnets|upsamplers)\.(\d+)\.(.+)", key)
    if m:
        i, kind, j, rest = m.groups()
        level = num_blocks - 1 - int(i)          # LDM numbers decoder levels from the bottom
        if kind == "upsamplers":
            return f"decoder.up.{level}.upsample.{rest}"
        return f"decoder.up.{level}.block.{j}.{rest.replace('conv_shortcut', 'nin_shortcut')}"
    m = re.fullmatch(r"(encoder|decoder)\.mid_block\.(resnets|attentions)\.(\d+)\.(.+)", key)
    if m:
        side, kind, j, rest = m.groups()
        if kind == "resnets":
            return f"{side}.mid.block_{int(j) + 1}.{rest}"
        for a, b in (("group_norm", "norm"), ("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "proj_out")):
            rest = rest.replace(a, b)
        return f"{side}.mid.attn_1.{rest}"
    return key                                   # conv_in, conv_out, quant_conv, post_quant_conv


def to_ldm_file(diffusers_dir: Path, path: Path) -> Path:
    """Save a diffusers AutoencoderKL folder as one LDM-layout .safetensors file."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(str(diffusers_dir))
    n = len(vae.config.block_out_channels)
    out = {}
    for k, v in vae.state_dict().items():
        new = _ldm_key(k, n)
        if ".attn_1." in new and new.endswith(".weight") and v.ndim == 2:
            v = v[:, :, None, None]              # LDM attention projections are 1x1 convolutions
        out[new] = v.contiguous()
    save_file(out, str(path))
    return path


def test_single_file_with_config_folder_loads_the_same_weights(tiny_vae_dir, tmp_path):
    ckpt = to_ldm_file(tiny_vae_dir, tmp_path / "vae-ldm.safetensors")
    vae, ident = load_vae(str(ckpt), config=tiny_vae_dir)
    ref, _ = load_vae(str(tiny_vae_dir))
    a, b = vae.state_dict(), ref.state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in b)
    assert ident["kind"] == "file" and ident["scaling_factor"] == 0.5 and ident["config"] == str(tiny_vae_dir)
    assert len(ident["weights_sha256"]) == 64


def test_single_file_that_does_not_fit_the_config_is_a_user_error(tiny_vae_dir, tmp_path):
    ckpt = to_ldm_file(tiny_vae_dir, tmp_path / "vae-ldm.safetensors")
    with pytest.raises(UserError, match="do not fit the config 'builtin:sd-vae'.*--vae-config"):
        load_vae(str(ckpt))           # the built-in SD-VAE config has 128+ channels
