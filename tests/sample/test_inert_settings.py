"""Issue 41, item 4: a setting that does nothing is refused with the reason, never accepted, recorded and ignored.
On a MeanFlow model `dit-sample --cfg-scale 2.5 --guidance-interval 0 0.7` printed and recorded guidance and gave the
pixels of cfg 1.0; dit-train's grid and FID settings likewise."""
from __future__ import annotations

import pytest
import torch

from dit_pipeline.common.errors import ConfigError, UserError
from dit_pipeline.sample import SampleConfig, run_sampling
from dit_pipeline.train.config import TrainConfig
from tests.sample.conftest import our_checkpoint, random_dit


@pytest.fixture(scope="module")
def meanflow_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("mf") / "mf.pt"
    model = random_dit(5, conditions="meanflow")
    torch.save({**our_checkpoint(model, model), "objective": "meanflow"}, path)
    return path


def test_guidance_on_a_meanflow_model_is_refused_with_the_reason(meanflow_ckpt, tiny_vae_dir, tmp_path):
    base = dict(ckpt=str(meanflow_ckpt), vae=str(tiny_vae_dir), num_samples=2, steps=1, quiet=True,
                npz=str(tmp_path / "s.npz"))
    with pytest.raises(UserError) as e:
        run_sampling(SampleConfig(**base, cfg_scale=2.5, guidance_interval=[0.0, 0.7]))
    assert str(e.value) == ("--cfg-scale 2.5 does nothing here: a MeanFlow model trains its guidance in (omega, kappa "
                            "of its training); its sampler takes none; drop --cfg-scale (or pass 1)")
    with pytest.raises(UserError) as e:
        run_sampling(SampleConfig(**base, guidance_interval=[0.0, 0.7]))
    assert str(e.value) == ("--guidance-interval 0 0.7 does nothing here: a MeanFlow model trains its guidance in "
                            "(omega, kappa of its training); its sampler takes none; drop it")
    with pytest.raises(UserError, match=r"^--cfg-channels 3 does nothing on a MeanFlow model"):
        run_sampling(SampleConfig(**base, cfg_channels="3"))
    assert not (tmp_path / "s.npz").exists()
    run_sampling(SampleConfig(**base))  # no guidance given: none used, as recorded
    import json

    record = json.loads((tmp_path / "s.npz.json").read_text())
    assert record["fingerprint"]["cfg_scale"] == 1.0 and record["config"]["guidance_interval"] is None


def test_dit_train_refuses_grid_and_fid_guidance_that_does_nothing(tiny_vae_dir):
    base = dict(shards="s", run_dir="r", vae=str(tiny_vae_dir), sample_every=2, fid_every=2, fid_ref="R")
    with pytest.raises(ConfigError) as e:
        TrainConfig(**base, objective="meanflow", fid_cfg_scale=1.5, sample_cfg_scale=4.0).validate()
    msg = str(e.value)
    assert "--sample-cfg-scale 4 does nothing here: a MeanFlow model trains its guidance in" in msg
    assert "--fid-cfg-scale 1.5 does nothing here: a MeanFlow model trains its guidance in" in msg
    with pytest.raises(ConfigError, match=r"--fid-cfg-scale 2 does nothing here: the model has no null class"):
        TrainConfig(**base, class_dropout_prob=0.0, fid_cfg_scale=2.0).validate()
    with pytest.raises(ConfigError, match=r"--cfg-channels all does nothing on a MeanFlow model"):
        TrainConfig(**base, objective="meanflow", cfg_channels="all").validate()
    # not given: resolved to what acts (none on MeanFlow, none without a null class), recorded as used
    from dit_pipeline.train.hooks import build_hooks

    grid, fid = build_hooks(TrainConfig(**base, objective="meanflow"))
    assert (grid.cfg_scale, fid.cfg_scale) == (1.0, 1.0)
    grid, fid = build_hooks(TrainConfig(**base))
    assert (grid.cfg_scale, fid.cfg_scale) == (4.0, 1.5)


@pytest.fixture(scope="module")
def flow_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("flow") / "flow.pt"
    model = random_dit(6, learn_sigma=False)
    torch.save({**our_checkpoint(model, model), "objective": "flow"}, path)
    return path


@pytest.fixture
def unguided(monkeypatch):
    """A protocol row whose release samples without guidance (the rule "none"), for a class flow model: RAE's row
    with its guidance taken out (RAE's own config guides with cfg: tests/sample/test_protocol_fit.py)."""
    import dataclasses

    from dit_pipeline.dit.protocol_types import Guidance
    from dit_pipeline.dit.protocols import PROTOCOLS

    monkeypatch.setitem(PROTOCOLS, "unguided", dataclasses.replace(PROTOCOLS["rae"], name="unguided",
                                                                   guidance=Guidance("none", 1.0)))
    return "unguided"


def test_guidance_under_a_protocol_without_guidance_is_refused(flow_ckpt, meanflow_ckpt, tiny_vae_dir, tmp_path,
                                                               unguided):
    """The rule holds on the protocol path too (dit/protocols.py): under a protocol that samples without guidance, a
    --cfg-scale or --guidance-interval would be recorded as an override and do nothing; a protocol's own scale is the
    default where guidance acts, 1 where the model cannot take it (MeanFlow's reason first)."""
    base = dict(vae=str(tiny_vae_dir), num_samples=2, quiet=True, npz=str(tmp_path / "s.npz"))
    with pytest.raises(UserError) as e:
        run_sampling(SampleConfig(ckpt=str(flow_ckpt), **base, protocol=unguided, cfg_scale=1.5))
    assert str(e.value) == ("--cfg-scale 1.5 does nothing here: --protocol unguided samples without guidance "
                            "(bytetriper/RAE's sampler); drop --cfg-scale (or pass 1), or drop --protocol to choose "
                            "every setting")
    with pytest.raises(UserError) as e:
        run_sampling(SampleConfig(ckpt=str(flow_ckpt), **base, protocol=unguided, guidance_interval=[0.0, 0.5]))
    assert str(e.value) == ("--guidance-interval 0 0.5 does nothing here: --protocol unguided samples without "
                            "guidance (bytetriper/RAE's sampler); drop it, or drop --protocol to choose every setting")
    with pytest.raises(UserError, match=r"^--cfg-scale 2 does nothing here: a MeanFlow model trains its guidance in"):
        run_sampling(SampleConfig(ckpt=str(meanflow_ckpt), **base, protocol="meanflow", cfg_scale=2.0))
    assert not (tmp_path / "s.npz").exists()


def test_dit_train_fid_guidance_follows_the_protocol(tiny_vae_dir, unguided):
    """dit-train --protocol: the FID guidance defaults to the protocol's scale where guidance acts, and a
    --fid-cfg-scale under a protocol without guidance is refused with the same words as dit-sample's."""
    from dit_pipeline.train.hooks import build_hooks

    base = dict(shards="s", run_dir="r", vae=str(tiny_vae_dir), fid_every=2, fid_ref="R", objective="flow")
    with pytest.raises(ConfigError) as e:
        TrainConfig(**base, protocol=unguided, fid_cfg_scale=2.0).validate()
    assert ("--fid-cfg-scale 2 does nothing here: --protocol unguided samples without guidance (bytetriper/RAE's "
            "sampler); drop --fid-cfg-scale (or pass 1), or drop --protocol to choose every setting") in str(e.value)
    TrainConfig(**base, protocol="rae", fid_cfg_scale=2.0).validate()  # RAE's config guides with cfg (scale 1.0)
    scales = {name: build_hooks(TrainConfig(**base, protocol=name))[-1].cfg_scale for name in ("ddt", "rae", None)}
    assert scales == {"ddt": 2.0, "rae": 1.0, None: 1.5}
    assert TrainConfig(**base, protocol="ddt").resolved_guidance()["fid_cfg_scale"] == 2.0
    (fid,) = build_hooks(TrainConfig(**base, protocol="ddt", class_dropout_prob=0.0))
    assert fid.cfg_scale == 1.0  # no null class: none, whatever the protocol's scale
