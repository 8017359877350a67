"""`dit-extract --encoder`: RAE's feature formula on a tiny random DINOv2-shaped timm model, both flips, the
encoder's identity in the manifest, bf16 storage error, resume and the bad inputs (issue #32)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dit_pipeline.common.errors import UserError
from dit_pipeline.extract import ExtractConfig, run_extract
from dit_pipeline.extract.images import load_rgb
from dit_pipeline.shards import read_manifest, verify_shards
from dit_pipeline.shards.info import format_info, info_dict
from tests._util import FP32_EPS, assert_close_at_scale
from tests.extract.conftest import read_samples, shard_hashes
from tests.extract.test_images import reference_crop
from tests.features._tiny import TINY_IMAGE, TINY_INPUT, tiny_encoder_model
from tests.features.conftest import BASE


def direct_features(path, model) -> np.ndarray:
    """[2, C, 4, 4] by RAE's formula written out: crop, [0, 1], bicubic to 56 px without antialias, ImageNet
    mean/std, the timm forward with the final norm's affine set to identity, prefix tokens dropped; view 1 of
    the mirrored crop."""
    rgb, _ = load_rgb(path)
    x = torch.from_numpy(reference_crop(rgb, TINY_IMAGE)).float().div(255).permute(2, 0, 1)[None]
    x = torch.cat([x, x.flip(-1)])
    x = F.interpolate(x, size=(TINY_INPUT, TINY_INPUT), mode="bicubic", align_corners=False, antialias=False)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    with torch.no_grad():
        model.norm.weight.fill_(1.0)
        model.norm.bias.zero_()
        t = model.forward_features((x - mean) / std)[:, 5:]            # CLS + 4 registers dropped
    return t.transpose(1, 2).reshape(2, t.shape[-1], 4, 4).numpy()


def test_features_equal_the_formula_on_the_timm_model(extracted, tree):
    m = read_manifest(extracted)
    assert (m.store, m.latent_shape, m.views, m.scaling_factor) == ("sample", [32, 4, 4], 2, 1.0)
    enc = m.extraction["encoder"]
    assert m.extraction["vae"] is None
    assert (enc["model"], enc["input_size"], enc["patch_size"], enc["layers"], enc["prefix_tokens"]) == \
        ("vit_base_patch14_reg4_dinov2", TINY_INPUT, 14, 1, 5)
    assert len(enc["weights_sha256"]) == 64 and enc["downsample_factor"] == 8
    model = tiny_encoder_model()
    affine = model.norm.weight.detach().clone()
    samples = read_samples(extracted)
    assert len(samples) == 5
    paths = sorted(p for p in tree.rglob("*.JPEG"))
    for key, s in samples.items():
        ref = direct_features(paths[int(key)], model)
        assert_close_at_scale(s.latent, ref, rel=64 * FP32_EPS)
        assert not np.allclose(s.latent[0], s.latent[1], atol=1e-3)  # the mirror is a view of its own
    assert not torch.allclose(affine, torch.ones_like(affine))        # so the test would see a kept affine
    assert verify_shards(extracted, quick=False, progress=False).ok
    text = format_info(info_dict(extracted))
    assert "encoder:  vit_base_patch14_reg4_dinov2 (rae's formula, 56 px, patch 14" in text
    assert "geometry: features: 32 px -> 32 x 4 x 4 tokens" in text


def test_resume_keeps_every_byte_and_bf16_error_is_measured(extracted, tree, encoder, tmp_path):
    before = shard_hashes(extracted)
    run_extract(ExtractConfig(data_path=str(tree), out=str(extracted), encoder=str(encoder), dtype="float32",
                              **BASE))
    assert shard_hashes(extracted) == before
    out = tmp_path / "bf16"
    run_extract(ExtractConfig(data_path=str(tree), out=str(out), encoder=str(encoder), dtype="bfloat16", **BASE))
    full, half = read_samples(extracted), read_samples(out)
    err = max(float(np.abs(half[k].latent - full[k].latent).max() / np.abs(full[k].latent).max()) for k in full)
    assert 0 < err <= 2 ** -8                                           # bf16: 8 significant bits


def test_layer_sum_and_bad_inputs(tree, encoder, tmp_path):
    out = tmp_path / "sum"
    run_extract(ExtractConfig(data_path=str(tree), out=str(out), encoder=str(encoder), encoder_layers=2,
                              dtype="float32", limit=1, **BASE))
    m = read_manifest(out)
    assert m.extraction["encoder"]["layers"] == 2
    # the sum over both blocks of each block's tokens through the affine-free final LayerNorm (eps 1e-6)
    model = tiny_encoder_model()
    rgb, _ = load_rgb(sorted(tree.rglob("*.JPEG"))[0])
    x = torch.from_numpy(reference_crop(rgb, TINY_IMAGE)).float().div(255).permute(2, 0, 1)[None]
    x = F.interpolate(x, size=(TINY_INPUT, TINY_INPUT), mode="bicubic", align_corners=False, antialias=False)
    x = (x - torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)) / torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    with torch.no_grad():
        t = model.patch_embed(x)
        t = model.norm_pre(model._pos_embed(t))
        total = 0
        for block in model.blocks:
            t = block(t)
            total = total + F.layer_norm(t[:, 5:], (t.shape[-1],), eps=1e-6)
    got = read_samples(out)["000000000"].latent[0]
    assert_close_at_scale(got, total[0].T.reshape(32, 4, 4).numpy(), rel=64 * FP32_EPS)
    with pytest.raises(UserError, match="has only 2 blocks"):
        run_extract(ExtractConfig(data_path=str(tree), out=str(tmp_path / "x"), encoder=str(encoder),
                                  encoder_layers=3, **BASE))
    with pytest.raises(UserError, match="no model 'vit_nonexistent'"):
        run_extract(ExtractConfig(data_path=str(tree), out=str(tmp_path / "y"), encoder="vit_nonexistent", **BASE))
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").glob("shard-*"))


def test_encoder_weights_of_another_size_are_one_complete_line(encoder, tmp_path):
    """Issue 41, item 7: a file of the wrong size gave a cut-off error that suggested --encoder-weights, the flag
    just given; now every mismatch is counted, the first named, and the way on is the encoder, not the flag."""
    from dit_pipeline.common.features import load_feature_encoder

    weights = encoder.parent / "encoder.pth"  # the tiny DINOv2 (width 32, 2 blocks) for DINOv2-B's preset
    with pytest.raises(UserError) as e:
        load_feature_encoder("dinov2-b-reg", weights=str(weights), pretrained=False)
    msg = str(e.value)
    assert msg.startswith(f"--encoder-weights {weights} does not fit --encoder dinov2-b-reg (timm "
                          "vit_base_patch14_reg4_dinov2): ")
    assert "missing (first: cls_token [1, 1, 32] where it needs [1, 1, 768]); pass the --encoder (a timm model " \
           "name or a JSON encoder file) of the file's architecture" in msg
    assert "\n" not in msg and "pass --encoder-weights" not in msg
    # the file's own preset is named when it is one: DINOv2-B without registers read as dinov2-b-reg
    plain = tmp_path / "plain.pth"  # what identifies it: patch 14, width 768, no register tokens
    torch.save({"cls_token": torch.zeros(1, 1, 768), "patch_embed.proj.weight": torch.zeros(768, 3, 14, 14)}, plain)
    with pytest.raises(UserError, match=r"the file is dinov2-b's architecture: pass --encoder dinov2-b$"):
        load_feature_encoder("dinov2-b-reg", weights=str(plain), pretrained=False)
