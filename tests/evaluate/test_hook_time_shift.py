"""FID during training samples a flow run with the run's time shift (its resolved --time-shift, as the sample
grids and dit-sample do), and with none when the run's config has none."""
from __future__ import annotations
from dit_pipeline.common.hooks import HookContext
import numpy as np
import pytest


@pytest.mark.parametrize("config_shift, want", [(2.5, 2.5), (None, 1.0)])
def test_fid_samples_with_the_runs_time_shift(tmp_path, tiny_vae_dir, monkeypatch, config_shift, want):
    from dit_pipeline.evaluate import hook as hook_module
    from dit_pipeline.evaluate.hook import FidHook
    from dit_pipeline.sample.generate import FlowLoop
    from tests.sample.conftest import random_dit

    np.savez(tmp_path / "ref.npz", arr_0=np.random.default_rng(0).integers(0, 256, (6, 32, 32, 3), dtype=np.uint8))
    loops: list = []
    real = hook_module.generate_images

    def recording(model, vae, diffusion, **kw):
        loops.append(diffusion)
        return real(model, vae, diffusion, **kw)

    monkeypatch.setattr(hook_module, "generate_images", recording)
    model = random_dit(1, learn_sigma=False)
    config = {"objective": "flow", **({"time_shift": config_shift} if config_shift is not None else {})}
    ctx = HookContext(epoch=0, model=model, ema=None, rank=0, world_size=1, model_config=dict(model.config),
                      config=config, num_classes=10, latent={"scaling_factor": 0.5}, device="cpu", step=2,
                      run_dir=tmp_path, metrics=None)
    hook = FidHook(every=2, ref=str(tmp_path / "ref.npz"), vae=str(tiny_vae_dir), num_samples=4, steps=2,
                   batch_size=4, seed=3, input_size=75, random_inception=0, sampler="euler")
    assert np.isfinite(hook(ctx)["fd_rand"])
    assert loops and all(isinstance(d, FlowLoop) and d.time_shift == want for d in loops)
