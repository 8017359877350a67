"""dit-sample on release checkpoints of the other families: a LightningDiT `train.py` file samples as a flow model
in SiT's time once its per-channel latent statistics are given (refused naming --latent-stats without them, since
another normalization would decode wrong images silently), and records what it sampled."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.latent_norm import LatentNorm
from dit_pipeline.sample import SampleConfig, run_sampling
from dit_pipeline.sample.load import with_latent_stats
from tests.dit.test_families import build
from tests.dit.test_releases import LIGHTNING_CONFIG

LATENT_REQUIRED = {"what": "LightningDiT's per-channel latent statistics (latents_stats.pt)", "multiplier": 1.0}


def test_the_statistics_come_from_the_flag_or_the_vae_config(tmp_path):
    scalar = LatentNorm(1.0)
    info = {"latent_required": LATENT_REQUIRED}
    with pytest.raises(UserError, match=r"ckpt\.pt: it was trained on latents normalized per channel \(LightningDiT's "
                                        r"per-channel latent statistics .*; pass --latent-stats FILE"):
        with_latent_stats(scalar, info, None, 4, "ckpt.pt")
    stats = tmp_path / "latents_stats.json"
    stats.write_text(json.dumps({"mean": [0.0, 1.0, 2.0, 3.0], "std": [1.0, 2.0, 4.0, 8.0]}))
    norm = with_latent_stats(scalar, info, str(stats), 4, "ckpt.pt")
    assert norm.is_per_channel and norm.per_channel["std"] == [1.0, 2.0, 4.0, 8.0]
    per_channel = LatentNorm.of_vae({"scaling_factor": 1.0, "latents_mean": [0.0] * 4, "latents_std": [1.0] * 4})
    assert with_latent_stats(per_channel, info, None, 4, "ckpt.pt") is per_channel
    assert with_latent_stats(scalar, {}, None, 4, "ckpt.pt") is scalar  # nothing required: as before


def test_a_lightningdit_checkpoint_samples(tiny_vae_dir, tmp_path):
    ema = build("LightningDiT", seed=1)
    ckpt = tmp_path / "0080000.pt"
    torch.save({"model": ema.state_dict(), "ema": ema.state_dict(), "opt": {}, "config": LIGHTNING_CONFIG}, ckpt)
    base = dict(ckpt=str(ckpt), vae=str(tiny_vae_dir), steps=2, quiet=True, class_labels=[1, 4], sampler="euler",
                cfg_scale=2.0, cfg_channels="all", npz=str(tmp_path / "s.npz"))
    with pytest.raises(UserError, match="pass --latent-stats FILE"):
        run_sampling(SampleConfig(**base))
    assert not (tmp_path / "s.npz").exists()
    stats = tmp_path / "latents_stats.json"
    stats.write_text(json.dumps({"mean": [0.1, -0.2, 0.0, 0.3], "std": [1.5, 0.5, 1.0, 2.0]}))
    run_sampling(SampleConfig(**base, latent_stats=str(stats)))
    with np.load(tmp_path / "s.npz") as f:
        assert f["arr_0"].shape == (2, 64, 64, 3)
    fp = json.loads((tmp_path / "s.npz.json").read_text())["fingerprint"]
    assert fp["objective"] == "flow" and fp["model_config"]["family"] == "LightningDiT"
    assert fp["normalization"]["std"] == [1.5, 0.5, 1.0, 2.0]


def test_encoder_reuse_is_refused_for_a_model_without_an_encoder(tiny_vae_dir, tmp_path):
    ema = build("LightningDiT", seed=1)
    ckpt = tmp_path / "0080000.pt"
    torch.save({"ema": ema.state_dict(), "config": LIGHTNING_CONFIG}, ckpt)
    stats = tmp_path / "latents_stats.json"
    stats.write_text(json.dumps({"mean": [0.0] * 4, "std": [1.0] * 4}))
    with pytest.raises(UserError, match="--encoder-refresh 2: this model has no encoder/decoder split whose state "
                                        "could be reused \\(DDT has\\)"):
        run_sampling(SampleConfig(ckpt=str(ckpt), vae=str(tiny_vae_dir), latent_stats=str(stats), steps=2, quiet=True,
                                  class_labels=[1], sampler="euler", encoder_refresh=2, npz=str(tmp_path / "x.npz")))


def test_export_takes_every_family_to_safetensors_and_diffusers_only_dit(tmp_path):
    from dit_pipeline import dit
    from dit_pipeline.sample.config import ExportConfig
    from dit_pipeline.sample.export import check_diffusers_representable, export

    ema = build("DiT-DH", seed=1)
    ckpt = tmp_path / "0100000.pt"  # RAE's stage-2 layout
    torch.save({"step": 1, "epoch": 0, "model": ema.state_dict(), "ema": ema.state_dict(), "optimizer": {},
                "scheduler": {}}, ckpt)
    out = export(ExportConfig(to="safetensors", output=str(tmp_path / "dh.safetensors"), ckpt=str(ckpt)))
    sd, info = dit.load_dit_weights(out)
    assert info["model_config"] == ema.config and (info["objective"], info["flow_convention"]) == ("flow", "repa")
    assert info["flow_convention_from"] == "recorded" and all(torch.equal(sd[k], ema.state_dict()[k]) for k in sd)
    with pytest.raises(UserError, match="--to diffusers: diffusers has no LightningDiT transformer"):
        check_diffusers_representable({"objective": "ddpm", "model_config": build("LightningDiT").config})


def test_a_ddt_samples_with_its_encoder_shared_across_steps(tiny_vae_dir, tmp_path):
    """Our own DDT checkpoint (any family's records its model_config): --encoder-refresh 2 recomputes the encoder on
    every other network call, changes the samples, and is recorded in the fingerprint."""
    model = build("DDT", seed=3)
    ckpt = tmp_path / "ddt.pt"
    torch.save({"format": "dit-pipeline.checkpoint", "version": 1, "model_config": model.config,
                "ema": model.state_dict(), "objective": "flow",
                "latent": {"scaling_factor": 0.5, "shift_factor": None}}, ckpt)
    base = dict(ckpt=str(ckpt), vae=str(tiny_vae_dir), steps=4, quiet=True, class_labels=[1, 2], sampler="euler",
                cfg_scale=1.0)
    run_sampling(SampleConfig(**base, npz=str(tmp_path / "every.npz")))
    run_sampling(SampleConfig(**base, encoder_refresh=2, npz=str(tmp_path / "shared.npz")))
    with np.load(tmp_path / "every.npz") as a, np.load(tmp_path / "shared.npz") as b:
        assert a["arr_0"].shape == b["arr_0"].shape == (2, 64, 64, 3) and not np.array_equal(a["arr_0"], b["arr_0"])
    fps = [json.loads((tmp_path / f"{n}.npz.json").read_text())["fingerprint"] for n in ("every", "shared")]
    assert "encoder_refresh" not in fps[0] and fps[1]["encoder_refresh"] == 2


def test_a_ddt_lightning_file_of_a_custom_size_samples_with_encoder_depth(tiny_vae_dir, tmp_path):
    """dit-sample --encoder-depth (issue 40 item 11): a DDT file whose depth and width are no preset states neither
    its encoder split nor its latent side; --encoder-depth and --input-size give them (the patch: DDT's 2)."""
    ema = build("DDT", seed=1)
    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": {f"ema_denoiser.{k}": v for k, v in ema.state_dict().items()}}, ckpt)
    base = dict(ckpt=str(ckpt), vae=str(tiny_vae_dir), steps=2, quiet=True, class_labels=[1], sampler="euler",
                cfg_scale=1.0, npz=str(tmp_path / "d.npz"))
    with pytest.raises(UserError, match="its encoder_depth is unknown; pass --model with its preset, --encoder-depth"):
        run_sampling(SampleConfig(**base, input_size=8))
    run_sampling(SampleConfig(**base, input_size=8, encoder_depth=1))
    fp = json.loads((tmp_path / "d.npz.json").read_text())["fingerprint"]
    assert fp["model_config"] == ema.config and fp["objective"] == "flow"
