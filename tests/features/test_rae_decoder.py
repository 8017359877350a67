"""RAE's decoder: its released key layout loads unchanged through `load_vae` (FILE or FILE,CONFIG), `decode`
equals the ViT-MAE decoder written out by hand, and bad decoders are refused by name (issue #32)."""
from __future__ import annotations

import math

import pytest
import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.vae import load_vae
from tests.features._tiny import make_tiny_decoder


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    return make_tiny_decoder(tmp_path_factory.mktemp("dec") / "model.pt")


def reference_decode(sd, z, heads, eps=1e-12):
    """RAE's decode by hand: tokens, embed, CLS, pos, pre-LN blocks (softmax attention), norm, head, drop CLS,
    'nhwpqc->nchpwq', times ImageNet std plus mean; then to [-1, 1]."""
    b, c, h, w = z.shape
    ln = lambda x, k: torch.nn.functional.layer_norm(x, x.shape[-1:], sd[k + ".weight"], sd[k + ".bias"], eps)
    lin = lambda x, k: x @ sd[k + ".weight"].T + sd[k + ".bias"]
    x = lin(z.flatten(2).transpose(1, 2), "decoder_embed")
    x = torch.cat([sd["trainable_cls_token"].expand(b, -1, -1), x], 1) + sd["decoder_pos_embed"]
    i = 0
    while f"decoder_layers.{i}.layernorm_before.weight" in sd:
        k = f"decoder_layers.{i}"
        y = ln(x, k + ".layernorm_before")
        q, kk, v = (lin(y, f"{k}.attention.attention.{n}") for n in ("query", "key", "value"))
        split = lambda t: t.view(b, -1, heads, t.shape[-1] // heads).transpose(1, 2)
        q, kk, v = split(q), split(kk), split(v)
        a = torch.softmax(q @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v
        x = x + lin(a.transpose(1, 2).reshape(b, -1, x.shape[-1]), f"{k}.attention.output.dense")
        x = x + lin(torch.nn.functional.gelu(lin(ln(x, k + ".layernorm_after"), f"{k}.intermediate.dense")),
                    f"{k}.output.dense")
        i += 1
    out = lin(ln(x, "decoder_norm"), "decoder_pred")[:, 1:]
    p = math.isqrt(out.shape[-1] // 3)
    img = torch.einsum("nhwpqc->nchpwq", out.reshape(b, h, w, p, p, 3)).reshape(b, 3, h * p, w * p)
    img = img * torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) + torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    return img * 2 - 1


def test_released_layout_loads_and_decodes_as_rae(decoder):
    sd = torch.load(decoder, weights_only=True)
    assert {"decoder_embed.weight", "decoder_pos_embed", "trainable_cls_token", "decoder_norm.bias",
            "decoder_pred.weight", "decoder_layers.1.attention.attention.query.weight",
            "decoder_layers.1.attention.output.dense.bias", "decoder_layers.0.intermediate.dense.weight",
            "decoder_layers.0.output.dense.weight", "decoder_layers.0.layernorm_after.weight"} <= set(sd)
    vae, ident = load_vae(f"{decoder},{decoder.parent / 'config.json'}")
    assert (ident["class"], ident["latent_channels"], ident["downsample_factor"], ident["grid"]) == \
        ("RAEDecoder", 32, 8, 4)
    z = torch.randn(2, 32, 4, 4, generator=torch.Generator().manual_seed(0))
    got = vae.decode(z).sample
    assert got.shape == (2, 3, 32, 32)
    torch.testing.assert_close(got, reference_decode(sd, z, heads=3), rtol=1e-5, atol=1e-5)
    # without the config the heads are guessed (width 48 -> 1 head): another decoder, so the config matters
    other, _ = load_vae(str(decoder))
    assert not torch.allclose(other.decode(z).sample, got, atol=1e-4)


def test_bad_decoders_are_refused_by_name(decoder, tmp_path):
    with pytest.raises(UserError, match="takes \\[32, 4, 4\\] features, got \\[16, 4, 4\\]"):
        load_vae(str(decoder))[0].decode(torch.zeros(1, 16, 4, 4))
    sd = torch.load(decoder, weights_only=True)
    del sd["decoder_layers.1.output.dense.bias"]
    torch.save(sd, tmp_path / "broken.pt")
    with pytest.raises(UserError, match="lacks 1 tensor\\(s\\): decoder_layers.1.output.dense.bias"):
        load_vae(str(tmp_path / "broken.pt"))
    (tmp_path / "c.json").write_text('{"decoder_hidden_size": 64, "decoder_num_attention_heads": 3}')
    with pytest.raises(UserError, match="decoder_hidden_size 64 \\(the tensors: 48\\)"):
        load_vae(f"{decoder},{tmp_path / 'c.json'}")


def test_raes_own_config_loads_a_decoder_of_another_encoder_width(tmp_path):
    """RAE's configs/decoder/*/config.json all say hidden_size 768: RAE overwrites that field with the encoder's
    width before building the decoder (bytetriper/RAE src/stage1/rae.py l.51). A decoder for a wider encoder (here
    64 wide, standing for DINOv2-L's 1024) with RAE's own config loads; the other fields are still checked."""
    import json

    path = make_tiny_decoder(tmp_path / "model.pt", in_channels=64)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 768}))  # as RAE's ViTXL/config.json
    vae, ident = load_vae(f"{path},{tmp_path / 'config.json'}")
    assert ident["latent_channels"] == 64
    assert vae.decode(torch.zeros(1, 64, 4, 4)).sample.shape == (1, 3, 32, 32)
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 768, "decoder_num_hidden_layers": 3}))
    with pytest.raises(UserError, match=r"decoder_num_hidden_layers 3 \(the tensors: 2\)"):
        load_vae(f"{path},{tmp_path / 'config.json'}")
