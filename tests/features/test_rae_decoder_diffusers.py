"""RAE's decoder against diffusers' AutoencoderRAE (issue 44 item 2), and NanoGen's decoders, fitted to [0, 1]:
- the same weights give the same images in our decoder and in AutoencoderRAE's (renamed to diffusers' attention
  names), so ours stays for the reasons its module states, one of which this file shows: AutoencoderRAE cannot
  decode an already-unnormalized latent unchanged;
- a NanoGen feature space decodes with the raw decoder output (`fit_decoder` from the space's record), equal to
  NanoGen's RAE.decode and image conversion transcribed; an RAE space still adds ImageNet's std and mean;
- one extraction with `--encoder dinov2-vit-b` and NanoGen's statistics file runs end to end."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dit_pipeline.common.rae_decoder import fit_decoder
from dit_pipeline.common.vae import load_vae
from tests._util import FP32_EPS, assert_close_at_scale, make_image_tree
from tests.features._tiny import make_tiny_decoder


def _diffusers_has_rae() -> bool:
    import diffusers

    return getattr(diffusers, "AutoencoderRAE", None) is not None


needs_rae = pytest.mark.skipif(not _diffusers_has_rae(), reason="diffusers < 0.37.0 has no AutoencoderRAE (the "
                                                                 "comparison needs it; the project's floor is 0.29.2)")


def tiny_autoencoder_rae():
    from diffusers import AutoencoderRAE

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ae = AutoencoderRAE(encoder_type="dinov2", encoder_hidden_size=64, encoder_patch_size=14,
                            encoder_num_hidden_layers=1, encoder_input_size=56, decoder_hidden_size=48,
                            decoder_num_hidden_layers=2, decoder_num_attention_heads=3, decoder_intermediate_size=96,
                            patch_size=8)
        with torch.no_grad():
            for p in ae.decoder.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    return ae.eval()


def rae_layout(ae) -> dict[str, torch.Tensor]:
    """AutoencoderRAE's decoder state_dict in RAE's released names (diffusers' Attention -> ViT-MAE's)."""
    names = {"attention.to_q.": "attention.attention.query.", "attention.to_k.": "attention.attention.key.",
             "attention.to_v.": "attention.attention.value.", "attention.to_out.0.": "attention.output.dense."}
    out = {}
    for k, v in ae.decoder.state_dict().items():
        for a, b in names.items():
            k = k.replace(a, b)
        out[k] = v.clone()
    out["decoder_pos_embed"] = ae.decoder.decoder_pos_embed.clone()  # a buffer there, a stored tensor in RAE's files
    return out


@needs_rae
def test_autoencoder_rae_decodes_what_our_decoder_decodes(tmp_path):
    ae = tiny_autoencoder_rae()
    path = tmp_path / "decoder.pt"
    torch.save(rae_layout(ae), path)
    (tmp_path / "config.json").write_text(json.dumps({"decoder_num_attention_heads": 3}))
    ours, ident = load_vae(f"{path},{tmp_path / 'config.json'}")
    assert (ident["latent_channels"], ident["grid"], ident["downsample_factor"]) == (64, 4, 8)
    z = torch.randn(2, 64, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tokens = z.flatten(2).transpose(1, 2)
        theirs = ae._denormalize_image(ae.decoder.unpatchify(ae.decoder(tokens).logits))  # [0, 1]
        got = ours.decode(z)
    assert_close_at_scale(got.unit, theirs, rel=64 * FP32_EPS)
    assert_close_at_scale(got.sample, theirs * 2 - 1, rel=64 * FP32_EPS)
    # why not AutoencoderRAE.decode: with no statistics it still scales the latent by 1 + 1e-5 before decoding
    with torch.no_grad():
        via_decode = ae.decode(z).sample
        scaled = ae._denormalize_image(ae.decoder.unpatchify(ae.decoder((z * (1 + 1e-5)).flatten(2).transpose(1, 2))
                                                                        .logits))
    assert_close_at_scale(via_decode, scaled, rel=64 * FP32_EPS)
    assert float((via_decode - theirs).abs().max()) > 0  # not the identity our inverted latents need


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    return make_tiny_decoder(tmp_path_factory.mktemp("dec") / "model.pt")


def test_nanogen_spaces_decode_to_the_raw_output(decoder):
    vae, ident = load_vae(f"{decoder},{decoder.parent / 'config.json'}")
    z = torch.randn(1, 32, 4, 4, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        rae = vae.decode(z).unit.clone()
        fit_decoder(vae, ident, {"encoder": {"decoder_output": "unit", "latent_space": "dinov2-vit-b"}}, 4, "--vae")
        raw = vae.decode(z).unit
        # NanoGen's RAE.decode (src/stage1/rae.py l.91-95): tokens -> decoder -> unpatchify, nothing added
        direct = vae.unpatchify(vae(z.flatten(2).transpose(1, 2)), 4)
    assert ident["output"] == "unit" and torch.equal(raw, direct)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    assert_close_at_scale(rae, raw * std + mean, rel=8 * FP32_EPS)  # RAE's: ImageNet's std and mean added
    fit_decoder(vae, ident, {"encoder": {"model": "vit_base_patch14_reg4_dinov2"}}, 4, "--vae")  # RAE's space
    assert vae.output == "imagenet" and ident["output"] == "imagenet"


def test_extract_nanogen_features_with_their_statistics_and_decode_them(tmp_path):
    """--encoder dinov2-vit-b (tiny, JSON file), --latent-stats NanoGen's stats.pt {mean, var} [C, 16, 16]; the
    set's latents decoded by a tiny NanoGen decoder as NanoGen samples them (src/stage1/rae.py l.86-95,
    src/eval/generation.py l.167-168: decode, clamp(0, 1), * 255, to uint8)."""
    import timm

    from dit_pipeline.extract import ExtractConfig, run_extract
    from dit_pipeline.sample.generate import decode_latents
    from dit_pipeline.shards import read_manifest
    from tests.extract.conftest import read_samples

    tiny = {"embed_dim": 32, "depth": 2, "num_heads": 2}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        torch.save(timm.create_model("vit_base_patch14_reg4_dinov2", pretrained=False, num_classes=0,
                                     **tiny).state_dict(), tmp_path / "enc.pth")
    (tmp_path / "enc.json").write_text(json.dumps({"preset": "dinov2-vit-b", "model_args": tiny,
                                                   "weights": "enc.pth"}))
    g = torch.Generator().manual_seed(6)
    stats = {"mean": torch.randn(32, 16, 16, generator=g) * 0.1, "var": torch.rand(32, 16, 16, generator=g) + 0.5}
    torch.save(stats, tmp_path / "stats.pt")
    tree = make_image_tree(tmp_path / "img", counts=(2, 1))
    out = tmp_path / "out"
    run_extract(ExtractConfig(data_path=str(tree), out=str(out), encoder=str(tmp_path / "enc.json"), image_size=256,
                              latent_stats=str(tmp_path / "stats.pt"), dtype="float32", batch_size=3, num_workers=0,
                              quiet=True))
    m = read_manifest(out)
    enc = m.extraction["encoder"]
    assert (m.latent_shape, enc["latent_space"], enc["decoder_output"], m.norm.per_channel["form"]) == \
        ([32, 16, 16], "dinov2-vit-b", "unit", "mean_var")
    from dit_pipeline.shards.info import format_info, info_dict

    assert "encoder:  vit_base_patch14_reg4_dinov2 (NanoGen's dinov2-vit-b) (nanogen's formula, 224 px, patch 14" \
        in format_info(info_dict(out))
    samples = read_samples(out)
    s = samples[sorted(samples)[0]]
    x = m.norm.apply(torch.from_numpy(s.latent).clone())  # [2, 32, 16, 16]: (z - mean) / sqrt(var + eps)
    want = (torch.from_numpy(s.latent) - stats["mean"]) / torch.sqrt(stats["var"] + 1e-5)  # rae.py l.80-83
    assert_close_at_scale(x, want, rel=8 * FP32_EPS)
    path = make_tiny_decoder(tmp_path / "dec" / "model.pt", in_channels=32, grid=16)
    vae, ident = load_vae(f"{path},{path.parent / 'config.json'}")
    fit_decoder(vae, ident, {"encoder": enc}, 16, "--vae")
    img = decode_latents(vae, x, norm=m.norm, conversion="nanogen")
    with torch.no_grad():
        z = want * torch.sqrt(stats["var"] + 1e-5) + stats["mean"]                          # rae.py l.87-90
        raw = vae.unpatchify(vae(z.flatten(2).transpose(1, 2)), 16)                          # l.91-95
    expect = raw.clamp(0, 1).mul(255).permute(0, 2, 3, 1).to(torch.uint8)                   # generation.py
    assert img.shape == (2, 128, 128, 3)
    assert int((img.int() - expect.int()).abs().max()) <= 1 and float((img.int() - expect.int()).abs().float()
                                                                      .mean()) < 0.01
    assert np.isfinite(s.latent).all()
