"""Which latent channels classifier-free guidance guides (issue #34, defect 1): the first 3 only where that
reproduces a reference sampler (DiT's and SiT's on SD-VAE's 4 channels, LightningDiT's release), every channel
otherwise; the same rule in dit-sample (--cfg-channels auto), the trainer's grids and its FID, a training setting
to override it, and the value used recorded. A 16-channel model guided on 3 channels left 13 unguided."""
from __future__ import annotations

import json
import numpy as np
import pytest
import torch

from dit_pipeline.common.hooks import HookContext
from dit_pipeline import dit
from dit_pipeline.sample import SampleConfig, run_sampling
from dit_pipeline.sample.generate import cfg_channels_for, resolve_cfg_channels
from dit_pipeline.sample.grid import sample_grid
from tests._util import TINY_KL16_F8, make_tiny_vae
from tests.sample.conftest import our_checkpoint, random_dit


def test_the_rule():
    four, sixteen = {"family": "DiT", "in_channels": 4}, {"family": "DiT", "in_channels": 16}
    assert cfg_channels_for(four, "ddpm") == "3"  # DiT's reference sampler
    assert cfg_channels_for(four, "flow", "sit") == "3"  # SiT's (a copy of DiT's forward_with_cfg)
    assert cfg_channels_for(four, "flow", "repa") == "all"  # REPA's sampler guides every channel
    assert cfg_channels_for(sixteen, "ddpm") == cfg_channels_for(sixteen, "flow") == "all"
    assert cfg_channels_for({"family": "LightningDiT", "in_channels": 32}, "flow", release="LightningDiT") == "3"
    assert cfg_channels_for({"family": "LightningDiT", "in_channels": 32}, "flow") == "all"  # our own runs
    assert cfg_channels_for({"family": "DDT", "in_channels": 4}, "flow") == "all"
    assert resolve_cfg_channels("5", sixteen) == "5" and resolve_cfg_channels("16", sixteen) == "all"
    assert resolve_cfg_channels("all", four) == "all" and resolve_cfg_channels("auto", sixteen) == "all"
    with pytest.raises(ValueError, match=r"--cfg-channels 17: the model has 16 latent channels"):
        resolve_cfg_channels("17", sixteen)


@pytest.fixture
def guided_channels(monkeypatch):
    """The guide_channels of every guided network call (forward_with_cfg of any family)."""
    seen = []
    real = dit.family.DiffusionTransformer.forward_with_cfg

    def spy(self, *args, guide_channels=3, **kw):
        seen.append(guide_channels)
        return real(self, *args, guide_channels=guide_channels, **kw)

    monkeypatch.setattr(dit.family.DiffusionTransformer, "forward_with_cfg", spy)
    return seen


@pytest.fixture(scope="module")
def vae16(tmp_path_factory):
    return make_tiny_vae(tmp_path_factory.mktemp("vae16"), **TINY_KL16_F8)


def test_a_16_channel_model_is_guided_on_every_channel_by_dit_sample(tmp_path, vae16, guided_channels):
    model = random_dit(3, in_channels=16)
    torch.save(our_checkpoint(model, model, latent={"scaling_factor": 0.3611, "shift_factor": 0.1159}),
               tmp_path / "c.pt")
    npz = tmp_path / "s.npz"
    run_sampling(SampleConfig(ckpt=str(tmp_path / "c.pt"), vae=str(vae16), num_samples=2, steps=2, sampler="ddim",
                              cfg_scale=4.0, npz=str(npz), quiet=True))
    assert guided_channels and set(guided_channels) == {"all"}
    assert json.loads((tmp_path / "s.npz.json").read_text())["fingerprint"]["cfg_channels"] == "all"
    guided_channels.clear()
    run_sampling(SampleConfig(ckpt=str(tmp_path / "c.pt"), vae=str(vae16), num_samples=2, steps=2, sampler="ddim",
                              cfg_scale=4.0, cfg_channels="3", npz=str(tmp_path / "three.npz"), quiet=True))
    assert set(guided_channels) == {3}  # the override
    assert json.loads((tmp_path / "three.npz.json").read_text())["fingerprint"]["cfg_channels"] == "3"


def test_a_16_channel_models_grid_and_fid_guide_every_channel(tmp_path, vae16, guided_channels):
    from dit_pipeline.common.vae import load_vae
    from dit_pipeline.evaluate.hook import FidHook

    model = random_dit(4, in_channels=16)
    vae, _ = load_vae(str(vae16))
    sample_grid(model, vae=vae, scaling_factor=0.3611, class_labels=[1, 2], seed=0, steps=2, cfg_scale=4.0)
    assert guided_channels and set(guided_channels) == {"all"}
    guided_channels.clear()
    four = random_dit(5)  # SD-VAE's 4 channels: the reference's 3
    from tests._util import make_tiny_vae as tiny
    vae4, _ = load_vae(str(tiny(tmp_path / "vae4")))
    sample_grid(four, vae=vae4, scaling_factor=0.5, class_labels=[1], seed=0, steps=2, cfg_scale=4.0)
    assert set(guided_channels) == {3}

    guided_channels.clear()
    np.savez(tmp_path / "ref.npz", arr_0=np.random.default_rng(0).integers(0, 256, (6, 32, 32, 3), dtype=np.uint8))
    ctx = HookContext(epoch=0, model=model, ema=None, rank=0, world_size=1, model_config=dict(model.config),
                      config={"objective": "ddpm"}, num_classes=10, latent={"scaling_factor": 0.3611}, device="cpu",
                      step=2, run_dir=tmp_path, metrics=None)
    hook = FidHook(every=2, ref=str(tmp_path / "ref.npz"), vae=str(vae16), num_samples=4, steps=2, batch_size=4,
                   input_size=75, random_inception=0)
    record = hook(ctx)
    assert guided_channels and set(guided_channels) == {"all"} and record["fid_cfg_channels"] == "all"


def test_the_training_setting_reaches_grids_and_fid():
    from dit_pipeline.common.errors import ConfigError
    from dit_pipeline.train.config import TrainConfig
    from dit_pipeline.sample.grid import SampleGridHook
    from dit_pipeline.train.hooks import build_hooks

    cfg = TrainConfig(shards="s", run_dir="r", fid_every=2, fid_ref="R", vae="V", cfg_channels="3")
    (fid,) = build_hooks(cfg)  # (build_hooks would load a grid hook's VAE: that one is built alone)
    grid = SampleGridHook.from_settings(TrainConfig(shards="s", run_dir="r", sample_every=2, cfg_channels="3"),
                                        vae="V", vae_config=None, seed=0, objective="flow")
    assert (fid.cfg_channels, grid.cfg_channels) == ("3", "3")
    assert TrainConfig(shards="s", run_dir="r").cfg_channels == "auto"
    with pytest.raises(ConfigError, match=r"--cfg-channels must be auto, all or a channel count N >= 1, got 'some'"):
        TrainConfig(shards="s", run_dir="r", cfg_channels="some").validate()
