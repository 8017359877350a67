"""The model families against their releases' facts (float64 re-computations in _releases_reference.py): the
RoPE layouts on known inputs, widths and names, and each family's answers to the shared interface."""
from __future__ import annotations

import math

import pytest
import torch

from dit_pipeline import dit
from dit_pipeline.dit.family import create_model, lookup_preset, model_from_config
from dit_pipeline.dit.jit import JiT
from dit_pipeline.dit.rope import DDTRope, EvaRope
from tests.dit import _releases_reference as ref

TINY = {
    "LightningDiT": dict(name="LightningDiT-B/2", input_size=8, in_channels=4, depth=2, hidden_size=64, num_heads=4),
    "DDT": dict(name="DDT-XL/2", input_size=8, in_channels=4, depth=2, encoder_depth=1, hidden_size=64, num_heads=4),
    "DiT-DH": dict(name="DiT-DH-S", input_size=4, in_channels=8, depth=2, hidden_size=32, num_heads=2, head_depth=1,
                   head_hidden_size=64, head_num_heads=4),
    "JiT": dict(name="JiT-B/16", input_size=8, in_channels=3, patch_size=2, depth=3, hidden_size=32, num_heads=2,
                bottleneck_dim=5, in_context_len=3, in_context_start=1),
}
FORWARD = {"LightningDiT": ref.lightningdit_forward, "DDT": ref.ddt_forward, "DiT-DH": ref.ditdh_forward,
           "JiT": ref.jit_forward}


def build(family: str, seed: int = 0, **over):
    """A tiny model of `family` with every trained tensor perturbed, so each path matters (adaLN-Zero starts at 0)."""
    torch.manual_seed(seed)
    model = create_model(**{**TINY[family], "num_classes": 5, **over})
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


def inputs(model, n=2, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, model.in_channels, model.input_size, model.input_size, generator=g)
    return x, torch.tensor([0.13, 0.81][:n]), torch.tensor([1, 5][:n])


@pytest.mark.parametrize("family,over", [("LightningDiT", {}), ("LightningDiT", {"qk_norm": True, "wo_shift": True}),
                                         ("LightningDiT", {"rms_norm": False, "swiglu": False, "rope": False}),
                                         ("DDT", {}), ("DiT-DH", {}), ("DiT-DH", {"learn_sigma": True}), ("JiT", {})])
def test_forward_is_the_release_definition(family, over):
    """Our float32 forward equals the float64 re-computation from the release's facts: the norms and MLPs, the RoPE
    layout, the conditioning (DiT-DH's head and DDT's decoder modulated token by token by the encoder's output),
    DDT's unfolded patches and max_period 10, RAE's Fourier features."""
    model = build(family, **over)
    x, t, y = inputs(model)
    with torch.no_grad():
        got = model(x, t, y).double()
    want = FORWARD[family](model.state_dict(), model.config, x, t, y)
    assert got.shape == want.shape == (2, model.out_channels, model.input_size, model.input_size)
    assert want.abs().max() > 0.5
    # float32 against float64 through the whole network: the error grows with depth and the output's scale (2e-5
    # was seen on one machine); a wrong layout or formula is off by O(1)
    assert (got - want).abs().max() / want.abs().max() < 1e-4


def test_rope_layouts_on_a_known_input():
    """EVA (LightningDiT, DiT-DH): first half of a head turns with the row, second with the column, freq
    10000^(-k/(hd/4)); DDT: positions 0..16, pairs alternate column and row, freq 10000^(-4k/hd)."""
    x = torch.ones(1, 1, 4, 8)  # grid 2, head width 8: tokens (0,0) (0,1) (1,0) (1,1)
    eva = EvaRope(2, 8)
    assert eva.freqs_cos.shape == (4, 8) and torch.equal(eva.freqs_cos[:, 0], eva.freqs_cos[:, 1])

    def turned(w):  # the pair (1, 1) turned by w
        return [math.cos(w) - math.sin(w), math.sin(w) + math.cos(w)]

    got = eva(x)[0, 0]
    # token 1 = row 0, column 1: pairs 0, 1 (row) stay, pairs 2, 3 (column) turn by 1 and 0.01
    assert got[1].tolist() == pytest.approx([1, 1, 1, 1, *turned(1.0), *turned(0.01)], abs=1e-6)
    assert got[2].tolist() == pytest.approx([*turned(1.0), *turned(0.01), 1, 1, 1, 1], abs=1e-6)
    ddt = DDTRope(2, 8)(x)[0, 0]
    # token 2 = row 1 (y = 16), column 0 (x = 0): pairs 1 and 3 turn with y: by 16 and 16 x 0.01
    assert ddt[2].tolist() == pytest.approx([1, 1, *turned(16.0), 1, 1, *turned(0.16)], abs=1e-5)
    assert ddt[1].tolist() == pytest.approx([*turned(16.0), 1, 1, *turned(0.16), 1, 1], abs=1e-5)
    assert ddt[0].tolist() == [1.0] * 8


def test_the_releases_names_widths_and_sizes():
    with torch.device("meta"):
        l2 = create_model("LightningDiT-L/2", input_size=16, in_channels=32)
        xl1 = create_model("LightningDiT-XL/1", input_size=16, in_channels=32)
        ddt = create_model("DDT-XL/2", input_size=32)
        dh = create_model("DiT-DH-XL", input_size=16, in_channels=768)
    sd = l2.state_dict()  # SwiGLU width int(2/3 x 4 x 1024) = 2730, not rounded; learned norm scales; RoPE buffers
    assert sd["blocks.0.mlp.w3.weight"].shape == (1024, 2730) and sd["blocks.0.mlp.w12.weight"].shape == (5460, 1024)
    assert {"blocks.0.norm1.weight", "final_layer.norm_final.weight", "feat_rope.freqs_cos"} <= set(sd)
    assert xl1.state_dict()["feat_rope.freqs_sin"].shape == (256, 72)
    assert sum(p.numel() for p in xl1.parameters()) // 10**6 == 675  # the paper's 675M
    sd = ddt.state_dict()  # LLaMA FFN without biases, Linear patch embedding, adaLN without SiLU, no position table
    assert sd["blocks.0.mlp.w1.weight"].shape == (3072, 1152) and "blocks.0.mlp.w1.bias" not in sd
    assert sd["x_embedder.proj.weight"].shape == (1152, 16) and "blocks.0.attn.qkv.bias" not in sd
    assert "blocks.0.adaLN_modulation.0.weight" in sd and "pos_embed" not in sd
    assert sd["y_embedder.embedding_table.weight"].shape == (1001, 1152)
    assert sum(p.numel() for p in ddt.parameters()) // 10**6 == 674  # DDT's README: 675M
    sd = dh.state_dict()  # encoder 28 x 1152, head 2 x 2048 (SwiGLU 5461), Fourier time W, the encoder's table
    assert sd["blocks.27.mlp.w3.weight"].shape == (1152, 3072) and sd["blocks.29.mlp.w3.weight"].shape == (2048, 5461)
    assert sd["t_embedder.W"].shape == (256,) and sd["t_embedder.mlp.0.weight"].shape == (1152, 512)
    assert sd["s_projector.weight"].shape == (2048, 1152) and sd["pos_embed"].shape == (1, 256, 1152)
    assert sd["dec_feat_rope.freqs_cos"].shape == (256, 128) and sd["final_layer.linear.weight"].shape == (768, 2048)
    assert not dh.t_embedder.W.requires_grad
    assert lookup_preset("DiTDH-XL")[1] == "DiT-DH-XL" and lookup_preset("lightningdit-xl-1")[1] == "LightningDiT-XL/1"
    with torch.device("meta"):  # JiT (LTH14/JiT model_jit.py JiT_models): bottleneck 128, 32 in-context tokens at 4
        jb = create_model("JiT-B/16", input_size=256, in_channels=3)
        pix = create_model("DiT-DH-XL/16", input_size=256, in_channels=3)
    sd = jb.state_dict()
    assert sd["x_embedder.proj1.weight"].shape == (128, 3, 16, 16) and "x_embedder.proj1.bias" not in sd
    assert sd["x_embedder.proj2.weight"].shape == (768, 128, 1, 1) and sd["in_context_posemb"].shape == (1, 32, 768)
    assert sd["blocks.0.attn.q_norm.weight"].shape == (64,) and sd["blocks.11.mlp.w3.weight"].shape == (768, 2048)
    assert sd["feat_rope_incontext.freqs_cos"].shape == (32 + 256, 64) and jb.in_context_start == 4
    rope = JiT.fixed_tensors(jb.config)  # the class tokens are not rotated: identity rows in front
    assert torch.equal(rope["feat_rope_incontext.freqs_cos"][:32], torch.ones(32, 64))
    assert torch.equal(rope["feat_rope_incontext.freqs_sin"][32:], rope["feat_rope.freqs_sin"])
    assert (lookup_preset("jit-h-32")[1], create_model("JiT-H/32", input_size=64, depth=11).bottleneck_dim) == \
        ("JiT-H/32", 256)
    sd = pix.state_dict()  # NanoGen's jit-ddt: DiT-DH-XL in 16 x 16 patches of pixels
    assert sd["s_embedder.proj.weight"].shape == (1152, 3, 16, 16) and sd["final_layer.linear.weight"].shape == (768, 2048)


@pytest.mark.parametrize("family", list(TINY))
def test_each_family_answers_the_interface(family):
    model = build(family)
    config = model.config
    assert config["family"] == family and config["model"] is None  # a custom (tiny) size
    rebuilt = model_from_config(config)
    assert rebuilt.config == config and list(rebuilt.state_dict()) == list(model.state_dict())
    rebuilt.load_state_dict(model.state_dict(), strict=True)
    x, t, y = inputs(model)
    plain = model(x, t, y)
    assert torch.equal(rebuilt.eval()(x, t, y), plain)
    assert dit.forward_macs(config) > 0 and dit.train_flops_per_image(config) == 6 * dit.forward_macs(config)
    assert len(model.compile_units()) == model.num_blocks + 1
    for k in range(1, model.num_blocks + 1):  # the same pass, the tokens after block k at their width
        out, hidden = model(x, t, y, return_hidden=k)
        assert torch.equal(out, plain) and hidden.shape == (2, model.grid_size ** 2, model.hidden_size_at(k))
    with pytest.raises(ValueError, match=f"return_hidden must be a block count in 1..{model.num_blocks}"):
        model(x, t, y, return_hidden=model.num_blocks + 1)
    model.train()

    def grads():
        model.zero_grad()
        model(x, t, y, force_drop_ids=torch.tensor([0, 1])).square().sum().backward()
        return [p.grad.clone() for p in model.parameters() if p.requires_grad]

    before = grads()
    model.set_grad_checkpointing(True)
    assert all(b.grad_checkpointing for b in model.blocks)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(before, grads()))
    model.set_grad_checkpointing(False)
    with torch.no_grad():  # classifier-free guidance is the shared code: on all channels here
        both = model.eval().forward_with_cfg(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, torch.tensor([5, 5])]),
                                             3.0, guide_channels="all")
        cond, uncond = model(x, t, y), model(x, t, torch.tensor([5, 5]))
    want = uncond + 3.0 * (cond - uncond)  # batch 4 vs 2 runs other kernels: relative to the values' magnitude
    assert (both[:2] - want).abs().max() / want.abs().max() < 1e-4


def test_ddt_encoder_state_is_what_the_decoder_reads():
    model = build("DDT")
    x, t, y = inputs(model)
    with torch.no_grad():
        s = model.encode(x, t, y)
        assert s.shape == (2, 16, 64) and torch.equal(model.decode(x, s), model(x, t, y))
        later = model.decode(x, s)  # reused at another step: the decoder alone
        assert not torch.equal(model.decode(x, model.encode(x, t + 0.2, y)), later)


def test_unsupported_options_are_refused():
    with pytest.raises(ValueError, match=r"unknown DDT options \['swiglu'\]"):
        create_model("DDT-XL/2", swiglu=True)
    with pytest.raises(TypeError, match="DiT has no option wo_shift"):
        dit.DiT(wo_shift=True)
    with pytest.raises(ValueError, match="encoder_depth 2 must be below depth 2"):
        create_model("DDT-XL/2", depth=2, encoder_depth=2, hidden_size=64, num_heads=4)


def test_ddt_encoder_reuse_across_neighbouring_calls():
    """dit.reuse.EncoderReuse: the encoder runs on every k-th call, the calls between decode with its state; every
    other attribute is the model's, so samplers run it as the model."""
    model = build("DDT")
    x, t, y = inputs(model)
    with torch.no_grad():
        once = dit.reuse.EncoderReuse(model, 1)
        assert torch.equal(once(x, t, y), model(x, t, y)) and once.num_classes == 5
        shared = dit.reuse.EncoderReuse(model, 2)
        x2, t2 = x + 0.1, t + 0.1
        outs = [shared(x, t, y), shared(x2, t2, y), shared(x2, t2, y)]
        assert torch.equal(outs[0], model(x, t, y))
        assert torch.equal(outs[1], model.decode(x2, model.encode(x, t, y)))  # the first call's state
        assert torch.equal(outs[2], model(x2, t2, y)) and shared.computed == 2  # recomputed on the third
        # a state belongs to its batch: another batch shape before the next recompute is an error, after reset()
        # the new batch is encoded afresh
        with pytest.raises(ValueError, match=r"call 3 has a batch of shape \(1, 4, 8, 8\) but the encoder state was "
                                             r"computed on \(2, 4, 8, 8\)"):
            shared(x[:1], t[:1], y[:1])
        shared.reset()
        assert torch.equal(shared(x[:1], t[:1], y[:1]), model(x[:1], t[:1], y[:1])) and shared.steps == [0]
    with pytest.raises(ValueError, match="LightningDiT has no encoder/decoder split"):
        dit.reuse.EncoderReuse(build("LightningDiT"), 2)
