"""What the VAE decides, checked before anything is written (extract/tokenizer.py, common/vae.py): the store the
encoder can give, --image-size against the real downsampling factor, --latent-stats, encoders that are not
autoencoders of images, DC-AE on an older diffusers, and a rerun that must not undo a manifest revision."""
from __future__ import annotations

import json

import pytest
import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.vae import load_vae, vae_class
from dit_pipeline.extract import ExtractConfig, run_extract
from dit_pipeline.shards import read_manifest
from dit_pipeline.shards.revision import revise
from tests._util import TINY_KL16_F8, TINY_KL32_F16, has_autoencoder_dc, make_image_tree, make_tiny_dc, make_tiny_vae

NEEDS_DC = pytest.mark.skipif(not has_autoencoder_dc(), reason="AutoencoderDC needs diffusers >= 0.32")


@pytest.fixture(scope="module")
def vaes(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok-vaes")
    out = {"kl16": make_tiny_vae(root / "kl16", **TINY_KL16_F8), "kl32": make_tiny_vae(root / "kl32", **TINY_KL32_F16)}
    if has_autoencoder_dc():
        out["dc"] = make_tiny_dc(root / "dc")
    return out


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return make_image_tree(tmp_path_factory.mktemp("tok-tree") / "images", counts=(2, 2), size=(80, 72))


def _refused(cfg: ExtractConfig) -> str:
    with pytest.raises(UserError) as e:
        run_extract(cfg)
    return str(e.value)


@NEEDS_DC
def test_identity_of_autoencoder_dc(vaes):
    _, dc = load_vae(str(vaes["dc"]))
    assert {k: dc[k] for k in ("class", "latent_channels", "downsample_factor", "encoder_output", "scaling_factor",
                               "shift_factor")} == {"class": "AutoencoderDC", "latent_channels": 32,
                                                    "downsample_factor": 32, "encoder_output": "latent",
                                                    "scaling_factor": 0.41407, "shift_factor": None}


def test_identity_of_autoencoder_kl_with_and_without_statistics(vaes):
    _, kl = load_vae(str(vaes["kl32"]))
    assert (kl["downsample_factor"], kl["latent_channels"], kl["latents_std"][:2]) == (16, 32, [0.9, 0.91])
    _, kl16 = load_vae(str(vaes["kl16"]))  # an AutoencoderKL without statistics: no new keys in its identity
    assert "encoder_output" not in kl16 and "latents_mean" not in kl16 and kl16["shift_factor"] == 0.1159


@NEEDS_DC
def test_store_posterior_of_an_encoder_without_one_is_refused(vaes, tree, tmp_path):
    out = tmp_path / "out"
    msg = _refused(ExtractConfig(data_path=str(tree), out=str(out), vae=str(vaes["dc"]), image_size=64, quiet=True))
    assert msg == (f"--store posterior: the VAE {str(vaes['dc'])!r} (AutoencoderDC) encodes to a deterministic latent "
                   "(encode(x).latent), it has no posterior mean and std to store; pass --store sample, which stores "
                   "its latent as it is")
    assert not out.exists() or not any(out.iterdir())  # nothing written


def test_image_size_is_checked_against_the_real_factor(vaes, tree, tmp_path):
    msg = _refused(ExtractConfig(data_path=str(tree), out=str(tmp_path / "o"), vae=str(vaes["kl32"]), image_size=72,
                                 quiet=True))
    assert msg == ("--image-size 72 is not a multiple of the VAE's downsampling factor 16 (AutoencoderKL, 32 latent "
                   "channels); use 64 or 80")
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())  # nothing written
    if "dc" in vaes:
        msg = _refused(ExtractConfig(data_path=str(tree), out=str(tmp_path / "o"), vae=str(vaes["dc"]), image_size=48,
                                     store="sample", quiet=True))
        assert msg.endswith("factor 32 (AutoencoderDC, 32 latent channels); use 32 or 64")


def test_latent_stats_file_at_extraction(vaes, tree, tmp_path):
    stats = tmp_path / "latents_stats.pt"  # LightningDiT's layout: [1, C, 1, 1] tensors
    torch.save({"mean": torch.linspace(-0.5, 0.5, 16).view(1, 16, 1, 1),
                "std": torch.linspace(0.5, 2.0, 16).view(1, 16, 1, 1)}, stats)
    out = tmp_path / "out"
    run_extract(ExtractConfig(data_path=str(tree), out=str(out), vae=str(vaes["kl16"]), image_size=32,
                              latent_stats=str(stats), quiet=True))
    m = read_manifest(out)
    assert m.format_version == 3 and m.normalization["form"] == "mean_std"
    assert m.normalization["std"] == pytest.approx(torch.linspace(0.5, 2.0, 16).tolist())
    assert m.normalization["source"]["kind"] == "file" and m.normalization["source"]["path"] == str(stats.resolve())
    assert (m.scaling_factor, m.shift_factor) == (0.3611, 0.1159)  # the VAE's, kept for the record
    assert m.extraction["format_version"] == 1  # the shards themselves are version 1 shards
    bad = tmp_path / "bad.pt"
    torch.save({"mean": torch.zeros(4), "std": torch.ones(4)}, bad)
    msg = _refused(ExtractConfig(data_path=str(tree), out=str(tmp_path / "o2"), vae=str(vaes["kl16"]), image_size=32,
                                 latent_stats=str(bad), quiet=True))
    assert msg == (f"--latent-stats {bad}: normalization mean has 4 values for 16 latent channels; normalization "
                   "std has 4 values for 16 latent channels")
    assert not (tmp_path / "o2" / "manifest.json").exists()


def test_a_rerun_keeps_a_revision_and_overwrite_removes_it(vaes, tree, tmp_path, capfd):
    out = tmp_path / "out"
    cfg = ExtractConfig(data_path=str(tree), out=str(out), vae=str(vaes["kl32"]), image_size=64, quiet=True)
    run_extract(cfg)
    revise(out, mode="per-channel")
    revised = (out / "manifest.json").read_bytes()
    capfd.readouterr()
    run_extract(ExtractConfig(**{**cfg.to_dict(), "quiet": False}))  # again: every shard kept, the manifest rewritten
    assert (out / "manifest.json").read_bytes() == revised
    assert ("\nkeeping the normalization of manifest revision 2 (dit-shards stats --write per-channel "
            "--max-samples 10000 --seed 0): per-channel over 32 channels") in capfd.readouterr().err
    run_extract(ExtractConfig(data_path=str(tree), out=str(out), vae=str(vaes["kl32"]), image_size=64, flip=False,
                              overwrite=True, quiet=True))
    m = read_manifest(out)
    assert m.revision is None and m.normalization["source"] == {"kind": "vae_config"}
    assert not (out / "manifest.json.rev1").exists()


def test_other_encoders_and_old_diffusers_are_refused_with_reasons(tmp_path, monkeypatch):
    from diffusers import AutoencoderTiny

    tiny = tmp_path / "taesd"
    AutoencoderTiny(encoder_block_out_channels=(8,) * 4, decoder_block_out_channels=(8,) * 4,
                    num_encoder_blocks=(1,) * 4, num_decoder_blocks=(1,) * 4).save_pretrained(tiny)
    with pytest.raises(UserError) as e:
        load_vae(str(tiny))
    assert str(e.value) == (f"--vae {str(tiny)!r} (AutoencoderTiny): its encode returns neither .latent_dist (a "
                            "posterior) nor .latent; dit-extract cannot read its latents")
    config = tmp_path / "cfg"
    config.mkdir()
    (config / "config.json").write_text(json.dumps({"_class_name": "AutoencoderDC"}))
    weights = tmp_path / "dc.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(UserError, match="a single weight file loads as an AutoencoderKL only, but --vae-config names "
                                        "AutoencoderDC; pass the VAE's diffusers folder instead"):
        load_vae(str(weights), config=str(config))
    import diffusers

    monkeypatch.setattr(diffusers, "AutoencoderDC", None, raising=False)  # diffusers before 0.32
    with pytest.raises(UserError) as e:
        vae_class("AutoencoderDC", "mit-han-lab/dc-ae-f32c32-in-1.0-diffusers")
    assert str(e.value) == ("--vae 'mit-han-lab/dc-ae-f32c32-in-1.0-diffusers' is an AutoencoderDC (DC-AE), which "
                            f"diffusers provides from version 0.32 on; this environment has diffusers "
                            f"{diffusers.__version__}: pip install 'diffusers>=0.32'")


def test_pixels_with_a_per_channel_set(vaes, tree, tmp_path):
    """--pixels beside per-channel statistics: format version 3 with the pixels field, fully verified, and the
    crops read back at the VAE's input size."""
    from dit_pipeline.shards import iter_shard, verify_shards

    out = tmp_path / "out"
    run_extract(ExtractConfig(data_path=str(tree), out=str(out), vae=str(vaes["kl32"]), image_size=64, pixels=True,
                              quiet=True))
    m = read_manifest(out)
    assert (m.format_version, m.has_pixels, m.norm.is_per_channel, m.latent_shape) == (3, True, True, [32, 4, 4])
    assert m.extraction["format_version"] == 2  # shards with pixels members
    assert verify_shards(out).ok
    samples = list(iter_shard(str(out / m.shards[0].name), m, pixels="decoded"))
    assert len(samples) == 4 and all(s.pixels.shape == (64, 64, 3) for s in samples)
