"""sample/generate.py: the sampling core equals the reference's doubled-batch CFG loop, pixels are
converted as the reference FID script does, and the trainer's grid API reproduces dit-sample."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from dit_pipeline.common.hooks import HookContext
from dit_pipeline.common.vae import load_vae
from dit_pipeline.sample import plan
from dit_pipeline.sample.generate import decode_latents, guided_model_fn, make_diffusion, sample_latents, to_uint8
from dit_pipeline.sample.grid import SampleGridHook, default_grid_labels, grid_shape, grid_size, sample_grid
from tests._util import assert_close_at_scale
from tests.sample.conftest import random_dit


def test_to_uint8_is_the_reference_rounding():
    x = torch.tensor([-1.5, -1.0, -0.0040, -0.0039, 0.0, 0.5, 0.99, 1.0, 2.0]).reshape(1, 1, 1, 9)
    got = to_uint8(x.expand(1, 3, 1, 9))[0, 0, :, 0].tolist()
    # clamp(127.5 * x + 128, 0, 255), then truncation by the uint8 cast
    assert got == [0, 0, 127, 127, 128, 191, 254, 255, 255]
    assert to_uint8(torch.zeros(2, 3, 4, 5)).shape == (2, 4, 5, 3)


@pytest.mark.determinism
@pytest.mark.parametrize("sampler,cfg_channels", [("ddpm", "3"), ("ddim", "all")])
def test_half_batch_loop_equals_reference_doubled_batch(sampler, cfg_channels):
    """The reference runs [z; z] with labels [y; null] through forward_with_cfg inside the loop and keeps
    the first half; our loop holds one half. Same noise for the kept half -> identical samples."""
    model = random_dit(7)
    diffusion = make_diffusion(sampler, 5)
    y = torch.tensor([3, 0, 9])
    seeds = [plan.noise_seed(11, i) for i in range(3)]
    ours = sample_latents(model, diffusion, y, [torch.Generator().manual_seed(s) for s in seeds],
                          sampler=sampler, cfg_scale=4.0, cfg_channels=cfg_channels)
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    z = torch.stack([torch.randn(4, 4, 4, generator=g) for g in gens])
    junk = [torch.Generator().manual_seed(1000 + i) for i in range(3)]  # the discarded half's noise
    z2, y2 = torch.cat([z, z]), torch.cat([y, torch.full_like(y, 10)])
    loop = diffusion.ddim_sample_loop if sampler == "ddim" else diffusion.p_sample_loop
    guide = "all" if cfg_channels == "all" else 3

    def ref_fn(x, t, y, cfg_scale):
        return model.forward_with_cfg(x, t, y, cfg_scale, guide_channels=guide)

    with torch.no_grad():
        ref = loop(ref_fn, z2.shape, noise=z2, clip_denoised=False,
                   model_kwargs={"y": y2, "cfg_scale": 4.0}, generator=gens + junk)[:3]
    assert torch.equal(ours, ref)
    assert ours.abs().max() > 0.1


# float32 rounding: the guided call runs the network on the doubled batch [x; x], whose kernels may split and
# order the sums differently from the call on x (measured here: at most 7 ulps of the largest output).
FP32_ULP = torch.finfo(torch.float32).eps


def test_cfg_scale_one_is_the_plain_conditional_model():
    model = random_dit(8)
    fn = guided_model_fn(model, cfg_scale=1.0)
    x, t, y = torch.randn(2, 4, 4, 4), torch.tensor([5, 500]), torch.tensor([1, 2])
    with torch.no_grad():
        plain = model(x, t, y)
        assert torch.equal(fn(x, t, y), plain)  # the very same call
        guided = guided_model_fn(model, cfg_scale=3.0)(x, t, y)
        assert guided.shape == (2, 8, 4, 4) and (guided[:, :3] - plain[:, :3]).abs().max() > 0.01
        # variance channels and channel 4 pass through unguided (reference behaviour), up to the rounding of
        # the doubled batch: 64 ulps of the largest output
        assert_close_at_scale(guided[:, 3:], plain[:, 3:], rel=64 * FP32_ULP, scale=plain.abs().max().item())


def test_bf16_autocast_stays_close_to_fp32():
    model = random_dit(9, std=0.05)
    x, t, y = torch.randn(2, 4, 4, 4), torch.tensor([5, 500]), torch.tensor([1, 2])
    with torch.no_grad():
        full = guided_model_fn(model, cfg_scale=2.0)(x, t, y)
        half = guided_model_fn(model, cfg_scale=2.0, autocast_dtype=torch.bfloat16)(x, t, y)
    assert half.dtype == torch.float32
    assert (half - full).abs().max() < 0.05 * full.abs().max()


def test_decode_divides_by_scale_and_adds_shift(tiny_vae_dir):
    vae, vae_id = load_vae(str(tiny_vae_dir))
    z = torch.randn(2, 4, 4, 4)
    with torch.no_grad():
        expected = to_uint8(torch.cat([vae.decode(z[i:i + 1] / 0.5 + 0.25).sample for i in range(2)]))
    got = decode_latents(vae, z, scaling_factor=0.5, shift_factor=0.25)
    assert got.dtype == torch.uint8 and got.shape == (2, 32, 32, 3) and torch.equal(got, expected)
    assert vae_id["scaling_factor"] == 0.5


@pytest.mark.determinism
def test_sample_grid_is_reproducible_and_restores_train_mode(tiny_vae_dir):
    model = random_dit(10).train()
    vae, _ = load_vae(str(tiny_vae_dir))
    kwargs = dict(vae=vae, scaling_factor=0.5, class_labels=[3, 1, 4], seed=5, steps=5, sampler="ddim")
    a = sample_grid(model, batch_size=2, **kwargs)
    assert model.training  # restored
    assert a.dtype == np.uint8 and a.shape == (3, 32, 32, 3) and np.array_equal(a, sample_grid(model, batch_size=2,
                                                                                               **kwargs))
    assert not np.array_equal(a[0], a[1])
    # image i uses the noise of (seed, i): the first chunk of a longer grid is the same computation
    c = sample_grid(model, batch_size=2, **{**kwargs, "class_labels": [3, 1, 7, 7]})
    assert np.array_equal(c[:2], a[:2])
    with pytest.raises(ValueError, match="sampler"):
        sample_grid(model, **{**kwargs, "sampler": "dpm++"})


def test_other_batch_sizes_agree_to_within_one_pixel_level(tiny_vae_dir):
    """Other batch shapes change the float rounding only: the truncating uint8 conversion (127.5 x + 128)
    then moves a value by at most one level, and rarely (measured: 2-6 of 61440 values at batch 1 vs 20)."""
    model = random_dit(10)
    vae, _ = load_vae(str(tiny_vae_dir))
    kwargs = dict(vae=vae, scaling_factor=0.5, class_labels=list(range(10)), seed=5, steps=5, sampler="ddpm")
    whole = sample_grid(model, **kwargs).astype(np.int16)
    for batch in (1, 3):
        diff = np.abs(sample_grid(model, batch_size=batch, **kwargs).astype(np.int16) - whole)
        assert diff.max() <= 1 and (diff > 0).mean() < 0.01


def test_learn_sigma_false_models_sample(tiny_vae_dir):
    model = random_dit(12, learn_sigma=False)
    vae, _ = load_vae(str(tiny_vae_dir))
    out = sample_grid(model, vae=vae, scaling_factor=0.5, class_labels=[0, 1], seed=0, steps=3, sampler="ddpm")
    assert out.shape == (2, 32, 32, 3) and not np.array_equal(out[0], out[1])


def test_default_grid_labels():
    assert default_grid_labels(1000) == [0, 125, 250, 375, 500, 625, 750, 875]
    assert default_grid_labels(10) == [0, 1, 2, 3, 5, 6, 7, 8] and default_grid_labels(3) == [0, 1, 2]


@pytest.mark.determinism
def test_trainer_hook_writes_step_grids_without_touching_the_global_rng(tiny_vae_dir, tmp_path):
    model = random_dit(13).train()
    ctx = HookContext(step=1000, epoch=0, rank=0, world_size=1, run_dir=tmp_path, device=torch.device("cpu"),
                      model=model, ema=random_dit(14), model_config=model.config,
                      latent={"scaling_factor": 0.5, "shift_factor": None}, num_classes=10, config={})
    hook = SampleGridHook(every=1000, vae=str(tiny_vae_dir), steps=3, seed=2)
    rng = torch.get_rng_state()
    path = hook(ctx)
    assert torch.equal(torch.get_rng_state(), rng)  # training stays exactly resumable
    assert path == tmp_path / "samples" / "step-0001000.png" and model.training
    vae, _ = load_vae(str(tiny_vae_dir))
    expected = sample_grid(ctx.ema, vae=vae, scaling_factor=0.5, class_labels=[0, 1, 2, 3, 5, 6, 7, 8], seed=2,
                           steps=3, sampler="ddim")
    with Image.open(path) as im:
        assert im.size[::-1] == grid_size(8, 32, 32)
        grid = np.asarray(im)
    _, cols = grid_shape(8)
    for k in range(8):  # lower half of every tile (the label sits in the top-left corner)
        y, x = 2 + (k // cols) * 34, 2 + (k % cols) * 34
        assert np.array_equal(grid[y + 16:y + 32, x:x + 32], expected[k, 16:])
    ctx.rank = 1
    assert hook(ctx) is None
