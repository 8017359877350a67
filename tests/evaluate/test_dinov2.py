"""FD_DINOv2 in dit-eval (evaluate/dinov2.py) with a tiny random DINOv2-architecture timm model saved as a weights
file (tests/_util.make_tiny_teacher): equal to a direct computation (timm model, DINOv2's position-table
resampling, EDM2's preprocessing, a Frechet distance by another formula) to float64 rounding, for both resize
variants; cached features are reused; every distance is labelled with its sample count and reference."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dit_pipeline.evaluate import EvalConfig, run_eval
from dit_pipeline.evaluate.run import format_names, format_result
from tests._util import TINY_TEACHER, make_tiny_teacher

MEAN, STD = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1), torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dinov2")
    rng = np.random.default_rng(0)
    # more images than the tiny model's 32 features: full-rank covariances (the direct formula's square roots of
    # the eigenvalues of S1 S2 are exact only away from zero)
    np.savez(tmp / "samples.npz", arr_0=rng.integers(0, 256, (40, 16, 16, 3), dtype=np.uint8))
    np.savez(tmp / "ref.npz", arr_0=rng.integers(0, 256, (48, 16, 16, 3), dtype=np.uint8))
    return tmp / "samples.npz", tmp / "ref.npz", make_tiny_teacher(tmp / "tiny-dinov2.safetensors", seed=3)


def _direct_features(images: np.ndarray, weights, resize: str) -> np.ndarray:
    """EDM2's DINOv2Detector, written out: 224 px bicubic (PIL rounded to uint8, or torch antialiased), / 255,
    ImageNet mean/std; the timm network at 224 px with the table resampled as DINOv2 does at run time."""
    import timm
    from PIL import Image
    from safetensors.torch import load_file

    sd = load_file(str(weights))
    table = sd["pos_embed"]                                  # [1, 1 + 4 * 4, 32]: a 56 px (4 x 4 patch) model
    grid = F.interpolate(table[:, 1:].reshape(1, 4, 4, -1).permute(0, 3, 1, 2), scale_factor=(16.1 / 4, 16.1 / 4),
                         mode="bicubic", antialias=False)
    sd["pos_embed"] = torch.cat([table[:, :1], grid.permute(0, 2, 3, 1).reshape(1, 256, -1)], dim=1)
    model = timm.create_model("vit_base_patch14_dinov2", pretrained=False, num_classes=0, img_size=224, **TINY_TEACHER)
    model.load_state_dict(sd)
    if resize == "pil":
        x = torch.from_numpy(np.stack([np.asarray(Image.fromarray(im).resize((224, 224), Image.BICUBIC))
                                       for im in images])).permute(0, 3, 1, 2).float()
    else:
        x = F.interpolate(torch.from_numpy(images).permute(0, 3, 1, 2).float(), size=(224, 224), mode="bicubic",
                          antialias=True)
    with torch.no_grad():
        return model.eval()((x / 255 - MEAN) / STD).numpy()


def _frechet(a: np.ndarray, b: np.ndarray) -> float:
    """|mu1 - mu2|^2 + tr S1 + tr S2 - 2 tr (S1 S2)^(1/2), float64, the last term as the sum of the singular
    values of A B^T / sqrt((n1 - 1)(n2 - 1)) for the centred features A, B (the square roots of the eigenvalues of
    S1 S2, without taking square roots of values near zero: a normed token's covariance is singular)."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    ca, cb = a - a.mean(0), b - b.mean(0)
    n1, n2 = len(a) - 1, len(b) - 1
    tr_sqrt = np.linalg.svd(ca @ cb.T, compute_uv=False).sum() / np.sqrt(n1 * n2)
    return float(((a.mean(0) - b.mean(0)) ** 2).sum() + (ca ** 2).sum() / n1 + (cb ** 2).sum() / n2 - 2 * tr_sqrt)


def _cfg(samples, ref, weights, resize):
    return EvalConfig(samples=str(samples), ref=str(ref), random_inception=0, input_size=75, batch_size=16, quiet=True,
                      device="cpu", fd_dinov2=True, dinov2=str(weights), dinov2_resize=resize)


@pytest.mark.parametrize("resize", ["torch", "pil"])
def test_fd_dinov2_equals_the_direct_computation_and_is_labelled(inputs, resize, monkeypatch):
    samples, ref, weights = inputs
    result = run_eval(_cfg(samples, ref, weights, resize))
    tag = result["dinov2_extractor"]["extractor"]
    cached = [np.load(next(p.parent.glob(f".{p.name}.*.{tag}-*.dinov2.npz")))["dinov2"] for p in (samples, ref)]
    direct = [_direct_features(np.load(p)["arr_0"], weights, resize) for p in (samples, ref)]
    for got, want in zip(cached, direct):  # float32 features; the batches differ in shape (16 vs all)
        torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # the distance of the same features, by another formula, to float64 rounding of its terms (tr S1 + tr S2)
    scale = sum(np.trace(np.cov(f.astype(np.float64), rowvar=False)) for f in cached)
    assert abs(result["fd_dinov2"] - _frechet(*cached)) <= 1e-10 * scale
    assert abs(result["fd_dinov2"] - _frechet(*direct)) <= 1e-5 * scale
    assert result["dinov2_extractor"]["resize"] == resize
    assert (result["fid_name"], result["proxy"], result["reference_file"]) == ("FD-rand0-40", True, "ref.npz")
    assert result["metric_names"] == {"fd_rand": "FD-rand0-40", "sfd_rand": "sFD-rand0-40",
                                      "fd_dinov2": "FD_DINOv2-40"}
    assert json.loads(samples.with_name("samples.npz.eval.json").read_text())["fd_dinov2"] == result["fd_dinov2"]
    assert format_result(result).splitlines()[-1] == f"FD_DINOv2: {round(result['fd_dinov2'], 6)!r}"
    assert format_names(result) == "names: FD-rand0-40, sFD-rand0-40, FD_DINOv2-40 (40 samples vs ref.npz, " \
        "protocol adm; a proxy: the Frechet distance of an Inception network with random weights (seed 0): a smoke " \
        "test, not FID, comparable with nothing published)"
    from dit_pipeline.evaluate import dinov2

    monkeypatch.setattr(dinov2.DINOv2Features, "forward", lambda *a: pytest.fail("features recomputed"))
    assert run_eval(_cfg(samples, ref, weights, resize))["fd_dinov2"] == result["fd_dinov2"]  # from the cache
