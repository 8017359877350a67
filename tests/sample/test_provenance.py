"""Issue 41, item 11: what dit-sample decodes with is the run's own, and a different VAE is said."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from dit_pipeline.common.errors import UserError
from dit_pipeline.sample import SampleConfig
from dit_pipeline.sample.resolve import compare_vae, with_vae


def _loaded(latent, config=None):
    return SimpleNamespace(latent=latent, info={"config": config, "path": "m.pt", "source": "dit-pipeline"})


def test_a_feature_space_model_decodes_with_its_runs_decoder_never_the_sd_vae():
    """It fell back to the hub SD-VAE; now the decoder its run's grids and FID used, or a refusal naming --decoder."""
    enc = {"kind": "features", "model": "vit_base_patch14_reg4_dinov2"}
    cfg = SampleConfig(ckpt="m.pt", npz="s.npz", num_samples=1)
    got = with_vae(cfg, _loaded({"vae": None, "encoder": enc}, {"vae": "rae-decoder.pt", "vae_config": "cfg"}),
                    logging.getLogger("t"))
    assert (got.vae, got.vae_config) == ("rae-decoder.pt", "cfg")
    with pytest.raises(UserError) as e:
        with_vae(cfg, _loaded({"vae": None, "encoder": enc}, {"vae": None}), logging.getLogger("t"))
    assert str(e.value) == ("--ckpt m.pt was trained on the features of vit_base_patch14_reg4_dinov2 (a feature "
                            "space), which only a decoder turns into pixels, and its run records none; pass --decoder "
                            "(RAE's decoder: FILE or FILE,config.json)")


def test_the_decoding_vae_is_compared_with_the_shards():
    shards = {"source": "/data/vae", "weights_sha256": "a" * 64}
    assert compare_vae({"source": "/other/copy", "weights_sha256": "a" * 64}, shards) is None  # same weights
    note = compare_vae({"source": "/x/vae-mse", "weights_sha256": "b" * 64}, shards)
    assert note == ("the VAE decoding these samples is not the one the shards were extracted with (sha256 "
                    "bbbbbbbbbbbb... where the shards' VAE has aaaaaaaaaaaa...; the shards': /data/vae): the model's "
                    "latents are decoded by another VAE")
    hub = {"source": "stabilityai/sd-vae-ft-ema", "commit": "c1"}
    assert compare_vae({**hub, "commit": "c2"}, hub).startswith("the VAE decoding these samples is not the one")
    assert compare_vae({"source": "stabilityai/sd-vae-ft-ema"}, hub) is None  # nothing to compare
    assert compare_vae(hub, None) is None
