"""LatentEncoder: view layout, exact posterior, reduced-precision overflow fallback, per-image sample noise."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dit_pipeline.common.vae import load_vae
from dit_pipeline.extract.encode import LatentEncoder, to_model_input
from tests._util import FP32_EPS, assert_close_at_scale, draw_image


@pytest.fixture(scope="module")
def pixels():
    return torch.from_numpy(np.stack([np.asarray(draw_image(i, i, (32, 32))) for i in range(3)]))


def _encoder(tiny_vae_dir, **kw):
    vae, _ = load_vae(str(tiny_vae_dir))
    return LatentEncoder(vae, device=torch.device("cpu"), **{"precision": "fp32", "views": 2, **kw})


def test_views_and_posterior_as_the_vae_computes_it(tiny_vae_dir, pixels):
    enc = _encoder(tiny_vae_dir)
    mean, std = enc.submit(pixels, [10, 11, 12]).arrays()
    assert mean.shape == std.shape == (3, 2, 4, 4, 4) and mean.dtype == np.float32
    x = to_model_input(pixels, 2)
    with torch.no_grad():
        moments = enc.vae.quant_conv(enc.vae.encoder(x))
    m, logvar = moments.chunk(2, dim=1)
    s = torch.exp(0.5 * logvar.clamp(-30.0, 20.0))
    for i in range(3):
        for v in range(2):                          # view v of image i was row v * 3 + i of the batch
            assert_close_at_scale(mean[i, v], m[v * 3 + i], rel=16 * FP32_EPS)
            assert_close_at_scale(std[i, v], s[v * 3 + i], rel=16 * FP32_EPS)


def test_overflow_in_reduced_precision_is_encoded_again_in_fp32(tiny_vae_dir, pixels, monkeypatch):
    enc = _encoder(tiny_vae_dir, precision="bf16")
    ref_mean, ref_std = _encoder(tiny_vae_dir).submit(pixels, [0, 1, 2]).arrays()
    real = LatentEncoder._posterior

    def overflowing(self, x, precision):
        mean, std = real(self, x, precision)
        if precision != "fp32":
            mean = mean.clone()
            mean[0, 0, 0, 0] = float("inf")
        return mean, std

    monkeypatch.setattr(LatentEncoder, "_posterior", overflowing)
    mean, std = enc.submit(pixels, [0, 1, 2]).arrays()
    assert enc.fp32_retries == 1
    np.testing.assert_array_equal(mean, ref_mean)
    np.testing.assert_array_equal(std, ref_std)


def test_sample_noise_depends_on_the_image_index_only(tiny_vae_dir, pixels):
    enc = _encoder(tiny_vae_dir, store="sample", seed=3, views=1)
    post = _encoder(tiny_vae_dir, views=1)
    together, none_std = enc.submit(pixels, [7, 8, 9]).arrays()
    assert none_std is None
    mean, std = post.submit(pixels, [7, 8, 9]).arrays()
    noise_together = (together - mean) / std
    alone, _ = enc.submit(pixels[1:2], [8]).arrays()
    m1, s1 = post.submit(pixels[1:2], [8]).arrays()
    assert_close_at_scale((alone - m1) / s1, noise_together[1:2], rel=256 * FP32_EPS)  # / std amplifies
    other_seed, _ = _encoder(tiny_vae_dir, store="sample", seed=4, views=1).submit(pixels, [7, 8, 9]).arrays()
    assert not np.allclose(other_seed, together)


def test_compile_option_compiles_the_encoder_in_place(tiny_vae_dir):
    plain, compiled = _encoder(tiny_vae_dir), _encoder(tiny_vae_dir, compile=True)
    assert getattr(plain.vae.encoder, "_compiled_call_impl", None) is None
    assert compiled.vae.encoder._compiled_call_impl is not None  # compiled lazily, at the first batch
    assert list(compiled.vae.state_dict()) == list(plain.vae.state_dict())  # names unchanged
