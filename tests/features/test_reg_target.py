"""REG's class token is NanoGen's target (issue 44 item 4; `repa.target_encoder: dinov2-vit-b`,
`target_encoder_resolution: 256` in every reg0.03 config): `dit-extract --encoder dinov2-vit-b --encoder-formula reg`
(NanoGen's name) and `--encoder dinov2-b-reg --encoder-formula reg` (RAE's preset with the REG formula) both give the
token NanoGen's training loop computes, transcribed below from End2End-Diffusion/diffusion-bench, on a tiny DINOv2-B/14
with 4 registers saved in torch.hub's own layout (the file NanoGen's `torch.hub.load` reads; timm converts it)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.transforms import Normalize

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.features import load_feature_encoder
from dit_pipeline.train.recipes import recognise_encoder

TINY = {"embed_dim": 32, "depth": 2, "num_heads": 2}
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # timm IMAGENET_DEFAULT_MEAN / STD, as NanoGen imports them


@pytest.fixture(scope="module")
def hub_file(tmp_path_factory):
    """A random tiny DINOv2-reg in torch.hub's layout: `cls_token` without its position, `pos_embed` [1, 1 + 37 * 37,
    C] holding the class token's row, `register_tokens`, `mask_token` (dinov2/models/vision_transformer.py)."""
    import timm

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        native = timm.create_model("vit_base_patch14_reg4_dinov2", pretrained=False, num_classes=0, **TINY)  # 518 px
        g = torch.Generator().manual_seed(1)
        sd = native.state_dict()
        for k, v in sd.items():  # layer scales and norms of order 1, so that every part of the formula shows
            if k.endswith("gamma") or k.startswith("norm."):
                sd[k] = torch.randn(v.shape, generator=g) * 0.5 + (1.0 if k == "norm.weight" else 0.0)
        cls_pos = torch.randn(1, 1, 32, generator=g)
    hub = {k: v for k, v in sd.items() if k not in ("cls_token", "reg_token", "pos_embed")}
    hub.update(cls_token=sd["cls_token"] - cls_pos, pos_embed=torch.cat([cls_pos, sd["pos_embed"]], dim=1),
               register_tokens=sd["reg_token"], mask_token=torch.zeros(1, 32))
    path = tmp_path_factory.mktemp("hub") / "dinov2_vitb14_reg4_pretrain.pth"
    torch.save(hub, path)
    return path


def nanogen_reg_target(path, images: torch.Tensor, resolution: int = 256) -> torch.Tensor:
    """NanoGen's class token of `images` ([B, 3, H, W] in [0, 1], as its loader gives them).

    src/encoders/vision_encoder.py DINOv2Encoder.load_model (l.174-214) at `resolution`: torch.hub's dinov2_vitb14_reg,
    its head dropped, `pos_embed.data = timm.layers.pos_embed.resample_abs_pos_embed(pos_embed, [16 * (resolution //
    256)] * 2)` (l.197-201: the class row kept, bicubic with antialias), the final norm `nn.LayerNorm(embed_dim,
    elementwise_affine=False)` (l.207-210, torch's eps 1e-5). torch.hub's model adds the table to [cls; patches] and
    inserts the registers after the class token: timm's layout holds the same sums (cls + its row, the patch rows).
    src/stage2/engine.py l.114-120: raw = images * 255; preprocess (l.216-223: x / 255, Normalize, interpolate bicubic
    to 224 * (resolution // 256)); forward_features' x_norm_clstoken (l.225-231: the final norm's output, token 0)."""
    import timm
    from timm.layers.pos_embed import resample_abs_pos_embed

    hub = torch.load(path, weights_only=True)
    pos = resample_abs_pos_embed(hub["pos_embed"], [16 * (resolution // 256)] * 2)
    sd = {k: v for k, v in hub.items() if k not in ("cls_token", "pos_embed", "register_tokens", "mask_token")}
    sd.update(cls_token=hub["cls_token"] + pos[:, :1], pos_embed=pos[:, 1:], reg_token=hub["register_tokens"])
    model = timm.create_model("vit_base_patch14_reg4_dinov2", pretrained=False, num_classes=0,
                              img_size=224 * (resolution // 256), **TINY)
    model.load_state_dict(sd)
    model.norm = nn.LayerNorm(32, elementwise_affine=False)
    raw = images.clone() * 255.0
    x = raw / 255.
    x = Normalize(MEAN, STD)(x)
    x = F.interpolate(x, 224 * (resolution // 256), mode="bicubic")
    return model.eval().forward_features(x)[:, 0]


def _images(size: int) -> torch.Tensor:
    u8 = torch.randint(0, 256, (2, 3, size, size), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    return u8.float() / 255.0  # the crops as the extractor gives them


def _spec(tmp_path, name: str, body: dict) -> str:
    f = tmp_path / name
    f.write_text(json.dumps(body))
    return str(f)


@pytest.mark.parametrize("size", [256, 512])  # NanoGen's REG configs train at 256; the target stays at 256 px
def test_both_commands_give_nanogens_reg_class_token(size, hub_file, tmp_path):
    by_name = _spec(tmp_path, "nanogen.json", {"preset": "dinov2-vit-b", "model_args": TINY, "weights": str(hub_file)})
    rae = _spec(tmp_path, "rae.json", {"model": "vit_base_patch14_reg4_dinov2", "model_args": TINY, "input_size": 224,
                                       "weights": str(hub_file)})
    x = _images(size)
    with torch.no_grad():
        want = nanogen_reg_target(hub_file, x)
        for spec in (by_name, rae):
            enc, ident = load_feature_encoder(spec, formula="reg", image_size=size)
            got = enc.encode(x).latent
            assert got.shape == (2, 32, 1, 1) and ident["formula_name"] == "reg" and ident["input_size"] == 224
            np.testing.assert_array_equal(got[:, :, 0, 0].numpy(), want.numpy())  # the same operations in order
            assert ident["downsample_factor"] == size and ident["latent_channels"] == 32
            assert recognise_encoder("dinov2-vit-b", ident) is not None and "latent_space" not in ident
    _, ident = load_feature_encoder(by_name, formula="reg", image_size=size)
    assert (ident["target_encoder"], ident["target_encoder_resolution"]) == ("dinov2-vit-b", 256)
    assert recognise_encoder("dinov2-vit-b", ident) == "its target encoder dinov2-vit-b"


def test_the_rae_latent_is_not_the_reg_target(hub_file, tmp_path):
    """NanoGen's RAE latent of the same encoder (its patch tokens after RAE's resize) is another thing: the REG
    formula is what tells them apart in the manifest (`formula_name`)."""
    by_name = _spec(tmp_path, "nanogen.json", {"preset": "dinov2-vit-b", "model_args": TINY, "weights": str(hub_file)})
    _, ident = load_feature_encoder(by_name, image_size=256)
    assert (ident["formula_name"], ident["latent_space"], ident["downsample_factor"]) == ("nanogen", "dinov2-vit-b",
                                                                                          16)


def test_an_encoder_without_nanogens_class_token_is_refused(tmp_path):
    """SigLIP2's x_norm_clstoken is None and PE's its class token without a final norm (vision_encoder.py l.441,
    l.597-606): refused before any model is built, naming the encoder this build takes it from."""
    for name in ("pe-vit-l", "siglip2-vit-b"):
        with pytest.raises(UserError, match=rf"--encoder {name} --encoder-formula reg: REG's class token is NanoGen's "
                                            r"x_norm_clstoken, which this build takes from dinov2-vit-b"):
            load_feature_encoder(name, formula="reg", pretrained=False)
