"""PixelGen's perceptual terms (common/perceptual.py) against NanoGen's code, transcribed here (End2End-Diffusion/
diffusion-bench at 4848f0c), on tiny networks of the real layouts loaded from files:

- src/stage1/disc/lpips.py lines 15-22 (ScalingLayer: shift -.030 -.088 -.188, scale .458 .448 .450), 33-58 (VGG16
  features sliced after relu1_2 .. relu5_3: indices 0-3, 4-8, 9-15, 16-22, 23-29), 61-63 (x / (norm + 1e-10)),
  66-67 (mean over H, W), 94-107 (lin 1x1 conv without bias on the squared difference, summed over layers);
- src/encoders/vision_encoder.py lines 207-223 (`dinov2-vit-b`: norm replaced by nn.LayerNorm(D,
  elementwise_affine=False); x / 255, ImageNet Normalize, bicubic to 224 * res // 256) and
  src/stage2/perceptual_loss.py lines 38-55 ((x + 1) * 127.5 into preprocess, x_norm_patchtokens, squared
  difference mean over tokens and channels, weights in order, `lpips` at its index);
- src/stage2/transport/transport.py lines 94-98: the term times (t < percep_loss_t_thresh), t NanoGen's noise level.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dit_pipeline.common.errors import ConfigError, UserError
from dit_pipeline.common.perceptual import DinoDistance, XTerm, load_lpips
from dit_pipeline.common.teacher import load_teacher
from dit_pipeline.dit.flow import FlowMatching
from dit_pipeline.train import merge_config
from tests._util import FP32_EPS, assert_close_at_scale, make_tiny_teacher

WIDTHS = [4, 4, 6, 6, 8, 8, 8, 8, 8, 8, 8, 8, 8]  # VGG16's 13 convolutions, tiny
CONV_AT = [0, 2, 5, 7, 10, 12, 14, 17, 19, 21, 24, 26, 28]  # their indices in torchvision's vgg16().features


def make_tiny_lpips(folder, seed=0):
    """torchvision-layout VGG16 features (features.N.*) and the lpips package's lin file (linK.model.1.weight)."""
    g = torch.Generator().manual_seed(seed)
    vgg, c_in = {}, 3
    for i, c in zip(CONV_AT, WIDTHS):
        vgg[f"features.{i}.weight"] = torch.randn(c, c_in, 3, 3, generator=g) * 0.4
        vgg[f"features.{i}.bias"] = torch.randn(c, generator=g) * 0.1
        c_in = c
    lin = {f"lin{k}.model.1.weight": torch.rand(1, WIDTHS[i], 1, 1, generator=g) for k, i in
           enumerate((1, 3, 6, 9, 12))}
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(vgg, folder / "vgg16.pth")
    torch.save(lin, folder / "vgg.pth")
    return f"{folder / 'vgg16.pth'},{folder / 'vgg.pth'}", vgg, lin


def nanogen_lpips(vgg, lin, x, y):
    """lpips.py's forward with reduction 'none', then perceptual_loss.py line 51's mean over (1, 2, 3)."""
    shift = torch.tensor([-.030, -.088, -.188])[None, :, None, None]
    scale = torch.tensor([.458, .448, .450])[None, :, None, None]

    def features(t):
        h, outs, convs = (t - shift) / scale, [], iter(CONV_AT)
        for stop in (4, 9, 16, 23, 30):  # the five slices, each ending after its last ReLU
            while True:
                i = next(convs)
                h = F.relu(F.conv2d(h, vgg[f"features.{i}.weight"], vgg[f"features.{i}.bias"], padding=1))
                if i + 2 == stop:
                    break
                if i + 3 == stop:  # the ReLU before a pool closes the slice; the pool opens the next one
                    break
            outs.append(h)
            h = F.max_pool2d(h, 2, 2) if stop < 30 else h
        return outs

    value = 0
    for k, (fx, fy) in enumerate(zip(features(x), features(y))):
        fx = fx / (torch.sqrt(torch.sum(fx ** 2, dim=1, keepdim=True)) + 1e-10)
        fy = fy / (torch.sqrt(torch.sum(fy ** 2, dim=1, keepdim=True)) + 1e-10)
        value = value + F.conv2d((fx - fy) ** 2, lin[f"lin{k}.model.1.weight"]).mean([2, 3], keepdim=True)
    return value.mean(dim=(1, 2, 3))


def test_lpips_from_files_is_nanogens(tmp_path):
    spec, vgg, lin = make_tiny_lpips(tmp_path / "lpips")
    model, identity = load_lpips(spec)
    g = torch.Generator().manual_seed(1)
    x, y = torch.rand(3, 3, 32, 32, generator=g) * 2 - 1, torch.rand(3, 3, 32, 32, generator=g) * 2 - 1
    got = model(x, y)
    assert_close_at_scale(got, nanogen_lpips(vgg, lin, x, y), rel=64 * FP32_EPS, what="LPIPS")
    assert got.shape == (3,) and (got > 0).all() and torch.equal(model(x, x), torch.zeros(3))
    assert identity["widths"] == WIDTHS and not any(p.requires_grad for p in model.parameters())
    with pytest.raises(UserError, match="expected VGG16's 13 convolutions"):
        load_lpips(str(tmp_path / "lpips" / "vgg.pth"))


def test_dino_distance_is_nanogens_affine_free_patch_tokens(tmp_path):
    teacher = load_teacher(str(make_tiny_teacher(tmp_path / "t.safetensors")), grid=4, autocast_dtype=None)
    dino = DinoDistance(teacher)
    g = torch.Generator().manual_seed(2)
    x, y = torch.rand(2, 3, 64, 64, generator=g) * 2 - 1, torch.rand(2, 3, 64, 64, generator=g) * 2 - 1

    def nanogen_tokens(img):
        p = (img + 1.0) * 127.5 / 255.0
        p = (p - torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)) / torch.tensor([0.229, 0.224, 0.225]).view(
            1, 3, 1, 1)
        p = F.interpolate(p, 14 * 4, mode="bicubic")
        norm, teacher.model.norm = teacher.model.norm, torch.nn.LayerNorm(32, elementwise_affine=False)
        try:
            out = teacher.model.forward_features(p)[:, teacher.num_prefix_tokens:]
        finally:
            teacher.model.norm = norm
        return out

    with torch.no_grad():
        want = ((nanogen_tokens(x) - nanogen_tokens(y)) ** 2).mean(dim=(1, 2))
        got = dino(x, y)
    assert_close_at_scale(got, want, rel=64 * FP32_EPS, what="DINO distance")
    assert (got > 0).all()


def test_terms_count_where_the_noise_level_is_below_the_threshold_and_add_to_the_loss():
    fm = FlowMatching(prediction="x")
    fm.add_x_terms([XTerm("lpips", lambda a, b: (a - b).abs().mean(dim=(1, 2, 3)), 0.1)], 0.7)
    x = torch.randn(4, 3, 4, 4)
    noise = torch.randn(4, 3, 4, 4)
    t = torch.tensor([0.2, 0.29, 0.31, 0.9])  # noise levels 0.8, 0.71, 0.69, 0.1: the last two count

    def net(x_t, tt):
        return torch.zeros_like(x_t)  # predicts the clean image 0

    terms = fm.training_losses(net, x, t, noise=noise)
    want = 0.1 * x.abs().mean(dim=(1, 2, 3)) * torch.tensor([0.0, 0.0, 1.0, 1.0])
    assert torch.equal(terms["lpips"], want) and torch.equal(terms["loss"], terms["mse"] + want)


def test_perceptual_terms_need_x_prediction():
    with pytest.raises(ConfigError) as e:
        merge_config({}, {"shards": "s", "run_dir": "r", "objective": "flow", "lpips": "a,b",
                          "percep_t_thresh": 0.0}).validate()
    msg = str(e.value)
    assert ("--lpips and --pdino compare the predicted clean image with the true one: add --objective flow "
            "--prediction x") in msg
    assert "--percep-t-thresh must be in (0, 1], got 0.0" in msg
