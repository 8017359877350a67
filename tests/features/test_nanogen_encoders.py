"""NanoGen's RAE encoders (issue 44 item 2): `--encoder dinov2-vit-b` ... `spatialpe-vit-l` give the tokens NanoGen's
`RAE.encode` gives, on tiny random models of the real classes (timm's DINOv2-reg, DINOv3 and PE ViTs,
transformers' SiglipVisionModel) loaded through the real path (`--encoder-weights` a timm state_dict, or a
save_pretrained folder), each against NanoGen's code transcribed (End2End-Diffusion/diffusion-bench:
src/stage1/rae.py, src/encoders/vision_encoder.py, src/encoders/models/{pe,rope,dinov3_loader}.py; lines at
each use). One extraction runs end to end with the statistics file and NanoGen's [0, 1] decoder."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchvision import transforms

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.features import load_feature_encoder
from dit_pipeline.common.nanogen_encoders import ENCODER_SPACES
from tests._util import FP32_EPS, assert_close_at_scale

R = 256  # NanoGen's resolution; every encoder gives 16 x 16 tokens there
TINY = {"embed_dim": 32, "depth": 2, "num_heads": 2}
TINY_SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=256,
                   patch_size=16)
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # timm IMAGENET_DEFAULT_MEAN / STD

# configs/stage1/stage1-<name>.yaml encoder_name, what vision_encoder.py loads for it, and misc.latent_size of
# configs/stage2/training/imagenet/ddt-en28d1152hd72-dn2d2048hd128-rae-<name>-vpred-t4c8.yaml
NANOGEN_ENCODERS = {
    "dinov2-vit-b": ("torch.hub facebookresearch/dinov2 dinov2_vitb14_reg", (768, 16, 16)),   # l.185-191
    "dinov3-vit-b16": ("torch.hub facebookresearch/dinov3 dinov3_vitb16 (LVD-1689M weights)", (768, 16, 16)),
    "siglip2-vit-b": ("transformers SiglipVisionModel google/siglip2-base-patch16-256", (768, 16, 16)),  # l.126-136
    "pe-vit-l": ("PE VisionTransformer.from_config('PE-Core-L14-336')", (1024, 16, 16)),      # l.549-574
    "langpe-vit-l": ("PE VisionTransformer.from_config('PE-Lang-L14-448')", (1024, 16, 16)),
    "spatialpe-vit-l": ("PE VisionTransformer.from_config('PE-Spatial-L14-448')", (1024, 16, 16)),
}


def _available(name: str) -> bool:
    import timm

    s = ENCODER_SPACES[name]
    return s.backend != "timm" or timm.is_model(s.model)


def needs(name: str):
    """The encoder's timm model, where the installed timm has it (PE from 1.0.16, DINOv3 from 1.0.20; the floor,
    1.0.3, refuses them naming the version: test_old_timm_is_refused_naming_the_version)."""
    s = ENCODER_SPACES[name]
    why = f"timm has no {s.model} before {s.min_timm}"
    return pytest.param(name, marks=pytest.mark.skipif(not _available(name), reason=why))


ALL = [needs(n) for n in ENCODER_SPACES]


def test_every_nanogen_encoder_is_registered():
    assert {n: (s.nanogen_loads, s.latent_256()) for n, s in ENCODER_SPACES.items()} == NANOGEN_ENCODERS


def _nontrivial(model: nn.Module, seed: int) -> nn.Module:
    """Layer scales, norms and biases of order 1, so that every part (a kept or dropped affine) shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gamma", "gamma_1", "gamma_2")) or "norm" in name or "layernorm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if name.endswith("weight") else 0.0))
    return model.eval()


def timm_tiny(name: str, seed: int = 0, **kw) -> nn.Module:
    import timm

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _nontrivial(timm.create_model(name, pretrained=False, num_classes=0, **TINY, **kw), seed)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """name -> the tiny model's weights as `--encoder-weights` takes them (timm at its pretraining size)."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    root = tmp_path_factory.mktemp("nanogen-enc")
    out = {}
    for name, s in ENCODER_SPACES.items():
        if not _available(name):
            continue
        if s.backend == "timm":
            path = root / f"{name}.pth"
            torch.save(timm_tiny(s.model).state_dict(), path)  # the default img_size: the pretraining grid
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                model = _nontrivial(SiglipVisionModel(SiglipVisionConfig(**TINY_SIGLIP)), 0)
            path = root / name
            model.save_pretrained(path)
        out[name] = path
    return out


def images(n: int = 2, size: int = R) -> torch.Tensor:
    """[0, 1] crops as the extractor gives them (uint8 / 255)."""
    u8 = torch.randint(0, 256, (n, 3, size, size), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    return u8.float() / 255.0


def rae_encode(x: torch.Tensor, encoder) -> torch.Tensor:
    """src/stage1/rae.py RAE.encode l.64-79 (no statistics): x * 255 when in [0, 1], bicubic to the resolution,
    the VisionEncoder's forward (preprocess + forward_features' patch tokens), [B, N, C] -> [B, C, h, w]."""
    if x.max() <= 1.0:
        x = x * 255.0
    if x.shape[-1] != R or x.shape[-2] != R:
        x = nn.functional.interpolate(x, size=(R, R), mode="bicubic", align_corners=False)
    z = encoder(x)
    b, n, c = z.shape
    h = w = int(math.sqrt(n))
    return z.transpose(1, 2).view(b, c, h, w)


def nanogen_dinov2(path) -> nn.Module:
    """DINOv2Encoder.load_model (vision_encoder.py l.174-214): the position table resampled by timm's
    resample_abs_pos_embed to 16 * (R // 256) a side (l.197-201; timm's layout keeps the CLS position folded
    into its token, so no prefix row here), the final norm an affine-free nn.LayerNorm (l.208-210)."""
    import timm
    from timm.layers.pos_embed import resample_abs_pos_embed

    native = timm.create_model("vit_base_patch14_reg4_dinov2", pretrained=False, num_classes=0, **TINY)
    native.load_state_dict(torch.load(path, weights_only=True))
    sd = native.state_dict()
    sd["pos_embed"] = resample_abs_pos_embed(sd["pos_embed"], [16 * (R // 256)] * 2, num_prefix_tokens=0)
    model = timm.create_model("vit_base_patch14_reg4_dinov2", pretrained=False, num_classes=0, img_size=224, **TINY)
    model.load_state_dict(sd)
    model.norm = nn.LayerNorm(32, elementwise_affine=False)
    pre = transforms.Normalize(MEAN, STD)

    def forward(x):  # preprocess l.216-223, forward_features l.225-231 (x_norm_patchtokens: after CLS + 4 registers)
        x = x / 255.
        x = pre(x)
        x = torch.nn.functional.interpolate(x, 224 * (R // 256), mode="bicubic")
        return model.forward_features(x)[:, 5:]
    return forward


def nanogen_dinov3(path) -> nn.Module:
    """DINOv3Encoder (vision_encoder.py l.290-318) with make_dinov3_transform (dinov3_loader.py l.24-31)."""
    import timm

    model = timm.create_model("vit_base_patch16_dinov3", pretrained=False, num_classes=0, **TINY)
    model.load_state_dict(torch.load(path, weights_only=True))
    model.norm = nn.LayerNorm(32, elementwise_affine=False)
    t = transforms.Compose([transforms.Lambda(lambda x: x / 255.), transforms.Resize((R, R), antialias=True),
                            transforms.Normalize(mean=MEAN, std=STD)])
    return lambda x: model.forward_features(t(x))[:, 5:]  # x_norm_patchtokens: after CLS + 4 storage tokens


def nanogen_siglip2(path, affine: bool = True) -> nn.Module:
    """SigLIP2Encoder (vision_encoder.py l.119-164): post_layernorm.elementwise_affine = False (l.142), which
    LayerNorm.forward does not read; preprocess x/255, Normalize(0.5, 0.5), bicubic to R; last_hidden_state."""
    from transformers import SiglipVisionModel

    model = SiglipVisionModel.from_pretrained(path).eval()
    vision = getattr(model, "vision_model", model)  # transformers 5.3 (NanoGen's) nests it; later 5.x does not
    vision.post_layernorm.elementwise_affine = False
    if not affine:  # what the comment there intends (the affine really gone), to show that the test tells them apart
        vision.post_layernorm.weight = None
        vision.post_layernorm.bias = None

    def forward(x):
        x = x / 255.
        x = transforms.Normalize([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])(x)
        x = torch.nn.functional.interpolate(x, R, mode="bicubic")
        return model(x).last_hidden_state
    return forward


def pe_posemb(pos: torch.Tensor, grid: int) -> torch.Tensor:
    """pe.py VisionTransformer._sample_abs_posemb l.503-525 on PE's [1 + G*G, C] table."""
    g0 = math.isqrt(pos.shape[0] - 1)
    cls_token_embed, pos_embed = pos[:1], pos[1:]
    pos_embed = pos_embed.reshape(1, g0, g0, -1).permute(0, 3, 1, 2).contiguous()
    pos_embed = F.interpolate(pos_embed, size=(grid, grid), mode="bilinear", align_corners=False)
    pos_embed = pos_embed.permute(0, 2, 3, 1).reshape(-1, pos.shape[-1]).contiguous()
    return torch.cat([cls_token_embed, pos_embed], dim=0)


def nanogen_pe(name: str, path) -> nn.Module:
    """PEEncoder (vision_encoder.py l.531-608): PE's own ViT with its table sampled to the 16 x 16 grid at every
    forward and RoPE at positions 1..16 (pe.py l.539-573; the timm model rebuilt at 224 px with that table and
    RoPE scaled to no other grid: test_pe_rope_is_pes_integer_positions), forward_features(norm=False) (no
    ln_post), CLS dropped."""
    import timm

    model_name = ENCODER_SPACES[name].model
    native = timm.create_model(model_name, pretrained=False, num_classes=0, **TINY)
    native.load_state_dict(torch.load(path, weights_only=True))
    sd = native.state_dict()
    sd["pos_embed"] = pe_posemb(sd["pos_embed"][0], 14 * (R // 16) // 14)[None]
    model = timm.create_model(model_name, pretrained=False, num_classes=0, img_size=224, ref_feat_shape=(16, 16),
                              **TINY)
    model.load_state_dict(sd, strict=False)
    model.norm = nn.Identity()  # norm=False: ln_post never applied (pe.py l.567-568)

    def forward(x):  # preprocess l.588-594: x/255, bilinear to patch * (R // 16), Normalize(0.5, 0.5)
        x = x / 255.
        x = torch.nn.functional.interpolate(x, 14 * (R // 16), mode="bilinear")
        x = transforms.Normalize([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])(x)
        return model.forward_features(x)[:, 1:]  # use_cls_token: patch tokens after the CLS (l.599-601)
    return forward


def oracle(name: str, path):
    if name == "dinov2-vit-b":
        return nanogen_dinov2(path)
    if name == "dinov3-vit-b16":
        return nanogen_dinov3(path)
    if name == "siglip2-vit-b":
        return nanogen_siglip2(path)
    return nanogen_pe(name, path)


def spec_file(tmp_path, name, path) -> str:
    """A JSON encoder file naming NanoGen's encoder with the tiny architecture and its weights."""
    args = {} if ENCODER_SPACES[name].backend == "transformers" else TINY
    f = tmp_path / f"{name}.json"
    f.write_text(json.dumps({"preset": name, "model_args": args, "weights": str(path)}))
    return str(f)


@pytest.mark.parametrize("name", ALL)
def test_tokens_are_nanogens(name, weights, tmp_path):
    enc, ident = load_feature_encoder(spec_file(tmp_path, name, weights[name]), image_size=R)
    assert (ident["latent_space"], ident["kind"], ident["formula_name"], ident["decoder_output"]) == \
        (name, "features", "nanogen", "unit")
    assert (ident["latent_channels"], ident["downsample_factor"], ident["encoder_output"]) == (32, 16, "latent")
    assert ident["model"] == ENCODER_SPACES[name].model and len(ident["weights_sha256"] or "") == 64
    # the registry's geometry, which the recipes' manifests are built from (tests/train/test_nanogen_matrix.py)
    assert (ident["patch_size"], ident["prefix_tokens"]) == (ENCODER_SPACES[name].patch, ENCODER_SPACES[name].prefix)
    x = images()
    with torch.no_grad():
        got = enc.encode(x).latent
        want = rae_encode(x.clone(), oracle(name, weights[name]))
    assert got.shape == want.shape == (2, 32, 16, 16)
    np.testing.assert_array_equal(got.numpy(), want.numpy())  # the same operations in the same order


@pytest.mark.skipif(not _available("dinov3-vit-b16"), reason="timm < 1.0.20 has no DINOv3")
def test_smaller_crops_are_resized_bicubic_to_the_resolution_first(weights, tmp_path):
    enc, _ = load_feature_encoder(spec_file(tmp_path, "dinov3-vit-b16", weights["dinov3-vit-b16"]), image_size=R)
    x = images(1, 128)
    with torch.no_grad():
        np.testing.assert_array_equal(enc.encode(x).latent.numpy(),
                                      rae_encode(x.clone(), nanogen_dinov3(weights["dinov3-vit-b16"])).numpy())


def test_siglip2_keeps_its_post_layernorm_affine_as_nanogen_does(weights):
    x = images(1)
    with torch.no_grad():
        kept = rae_encode(x.clone(), nanogen_siglip2(weights["siglip2-vit-b"]))
        dropped = rae_encode(x.clone(), nanogen_siglip2(weights["siglip2-vit-b"], affine=False))
    assert float((kept - dropped).abs().max()) > 0.1  # the tests above would see a dropped affine


def pe_rope(q: torch.Tensor, grid: int) -> torch.Tensor:
    """PE's Rope2D (rope.py l.303-347) on the patch tokens of q [B, H, N, D]: RotaryEmbedding(D // 2) frequencies
    1 / 10000 ** (arange(0, d, 2) / d) repeated pairwise (l.~190-230), positions 1..grid (CLS at 0, l.321-324),
    [freqs_x, freqs_y] concatenated, applied as t cos + rotate_half(t) sin with interleaved pairs (l.20-60)."""
    d = q.shape[-1] // 2
    freqs = 1.0 / (10000 ** (torch.arange(0, d, 2)[: (d // 2)].float() / d))
    rope = lambda t: (t.float()[:, None] * freqs[None]).repeat_interleave(2, dim=-1)  # noqa: E731
    ys = xs = torch.arange(grid) + 1
    fy = rope(ys)[:, None].expand(grid, grid, -1)
    fx = rope(xs)[None, :].expand(grid, grid, -1)
    f = torch.cat([fx, fy], dim=-1).reshape(grid * grid, -1)
    pairs = q.reshape(*q.shape[:-1], -1, 2)
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).reshape(q.shape)
    return q * f.cos() + rotated * f.sin()


@pytest.mark.parametrize("name", [needs("pe-vit-l"), needs("spatialpe-vit-l")])
def test_pe_rope_is_pes_integer_positions(name, weights, tmp_path):
    """timm's PE scales RoPE positions to its pretraining grid (ref_feat_shape); PE at 16 x 16 tokens uses 1..16."""
    import timm
    from timm.layers import apply_rot_embed_cat

    enc, _ = load_feature_encoder(spec_file(tmp_path, name, weights[name]), image_size=R)
    q = torch.randn(1, 2, 256, 16, generator=torch.Generator().manual_seed(4))
    want = pe_rope(q, 16)
    assert_close_at_scale(apply_rot_embed_cat(q, enc.model.rope.get_embed()), want, rel=64 * FP32_EPS)
    default = timm.create_model(ENCODER_SPACES[name].model, pretrained=False, num_classes=0, img_size=224, **TINY)
    assert float((apply_rot_embed_cat(q, default.rope.get_embed()) - want).abs().max()) > 0.1


@pytest.mark.skipif(not _available("langpe-vit-l"), reason="timm < 1.0.16 has no PE")
def test_pe_table_is_resampled_bilinear_from_the_pretraining_grid(weights, tmp_path):
    enc, _ = load_feature_encoder(spec_file(tmp_path, "langpe-vit-l", weights["langpe-vit-l"]), image_size=R)
    native = torch.load(weights["langpe-vit-l"], weights_only=True)["pos_embed"][0]  # 1 + 32 * 32 rows
    assert native.shape[0] == 1 + 32 * 32
    np.testing.assert_array_equal(enc.model.pos_embed[0].detach().numpy(), pe_posemb(native, 16).numpy())


@pytest.mark.skipif(not _available("pe-vit-l"), reason="timm < 1.0.16 has no PE")
def test_nanogen_encoders_refuse_rae_options_and_bad_sizes(weights, tmp_path):
    spec = spec_file(tmp_path, "pe-vit-l", weights["pe-vit-l"])
    with pytest.raises(UserError, match=r"--encoder pe-vit-l is NanoGen's encoder with NanoGen's formula .*drop "
                                        r"--encoder-layers and --encoder-formula"):
        load_feature_encoder(spec, layers=2, image_size=R)
    with pytest.raises(UserError, match=r"NanoGen's encoders work at multiples of 16 px .* --image-size is 200"):
        load_feature_encoder(spec, image_size=200)
    with pytest.raises(UserError, match=r"preset 'dinov9' is none of NanoGen's encoders \(dinov2-vit-b, "):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"preset": "dinov9"}))
        load_feature_encoder(str(bad))


def test_old_timm_is_refused_naming_the_version(monkeypatch):
    import timm

    real = timm.is_model
    monkeypatch.setattr(timm, "is_model", lambda n: False if "dinov3" in n else real(n))
    with pytest.raises(UserError, match=r"timm .* has no model 'vit_base_patch16_dinov3' \(timm provides it from "
                                        r"version 1\.0\.20 on: pip install 'timm>=1\.0\.20'\)"):
        load_feature_encoder("dinov3-vit-b16", pretrained=False, image_size=R)
