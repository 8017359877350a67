"""The DiT network against the published definitions: sizes, names, init, values, wrappers."""
from __future__ import annotations

import math

import pytest
import torch

from dit_pipeline import dit
from tests.dit._reference import (TINY, calm_model, ref_forward, ref_pos_embed,
                                  ref_timestep_embedding, tiny_model)

# docs/REFERENCE.md: parameter counts at 32x32x4 latents, 1000 classes, learned sigma
# (XL/2 exact; the others as rounded there, checked to the shown digits).
PARAMS_M = {"DiT-S/2": 32.96, "DiT-S/4": 32.95, "DiT-S/8": 33.15, "DiT-B/2": 130.51, "DiT-B/4": 130.48,
            "DiT-B/8": 130.88, "DiT-L/2": 458.10, "DiT-L/4": 458.05, "DiT-L/8": 458.59}


def meta_model(name: str, **kw) -> dit.DiT:
    with torch.device("meta"):
        return dit.create_model(name, **kw)


def test_xl2_has_exactly_the_published_parameter_count():
    model = meta_model("DiT-XL/2")
    assert sum(p.numel() for p in model.parameters()) == 675_129_632
    assert dit.MODEL_PRESETS["DiT-XL/2"] == (28, 1152, 16, 2)


@pytest.mark.parametrize("name", sorted(PARAMS_M))
def test_preset_parameter_counts(name):
    count = sum(p.numel() for p in meta_model(name).parameters())
    assert round(count / 1e6, 2) == PARAMS_M[name]


def test_presets_are_the_twelve_published_ones_then_patch_1():
    want = [f"DiT-{s}/{p}" for s in ("S", "B", "L", "XL") for p in (2, 4, 8)]
    assert list(dit.MODEL_PRESETS)[:12] == want  # names, order and dimensions of the paper's presets unchanged
    assert list(dit.MODEL_PRESETS)[12:] == ["DiT-S/1", "DiT-B/1", "DiT-L/1", "DiT-XL/1"]
    for size in ("S", "B", "L", "XL"):
        assert dit.MODEL_PRESETS[f"DiT-{size}/1"] == dit.MODEL_PRESETS[f"DiT-{size}/2"][:3] + (1,)
    # LightningDiT's XL/1 on VA-VAE latents (32x16x16): 256 tokens, the sequence of DiT-XL/2 on 4x32x32
    with torch.device("meta"):
        xl1 = dit.create_model("SiT-XL/1", input_size=16, in_channels=32)
    assert xl1.pos_embed.shape == (1, 256, 1152) and xl1.x_embedder.proj.weight.shape == (1152, 32, 1, 1)
    assert xl1.config["model"] == "DiT-XL/1" and xl1.final_layer.linear.weight.shape == (64, 1152)
    assert dit.canonical_model_name("DiT-XL-2") == "DiT-XL/2"
    with pytest.raises(ValueError, match="unknown DiT model 'DiT-M/2'.*DiT-S/2"):
        dit.create_model("DiT-M/2")


def expected_shapes(d: int, depth: int, p: int, tokens: int, classes: int, cout: int) -> dict:
    shapes = {
        "pos_embed": [1, tokens, d], "x_embedder.proj.weight": [d, 4, p, p], "x_embedder.proj.bias": [d],
        "t_embedder.mlp.0.weight": [d, 256], "t_embedder.mlp.0.bias": [d],
        "t_embedder.mlp.2.weight": [d, d], "t_embedder.mlp.2.bias": [d],
        "y_embedder.embedding_table.weight": [classes, d],
        "final_layer.adaLN_modulation.1.weight": [2 * d, d], "final_layer.adaLN_modulation.1.bias": [2 * d],
        "final_layer.linear.weight": [p * p * cout, d], "final_layer.linear.bias": [p * p * cout],
    }
    for i in range(depth):
        for name, shape in (("attn.qkv", [3 * d, d]), ("attn.proj", [d, d]), ("mlp.fc1", [4 * d, d]),
                            ("mlp.fc2", [d, 4 * d]), ("adaLN_modulation.1", [6 * d, d])):
            shapes[f"blocks.{i}.{name}.weight"] = shape
            shapes[f"blocks.{i}.{name}.bias"] = shape[:1]
    return shapes


@pytest.mark.parametrize("name,input_size,classes,learn_sigma,dropout", [
    ("DiT-XL/2", 32, 1000, True, 0.1), ("DiT-S/4", 64, 10, False, 0.1), ("DiT-B/8", 16, 7, True, 0.0),
])
def test_state_dict_names_and_shapes(name, input_size, classes, learn_sigma, dropout):
    depth, d, _, p = dit.MODEL_PRESETS[name]
    model = meta_model(name, input_size=input_size, num_classes=classes, learn_sigma=learn_sigma,
                       class_dropout_prob=dropout)
    got = {k: list(v.shape) for k, v in model.state_dict().items()}
    want = expected_shapes(d, depth, p, (input_size // p) ** 2, classes + (dropout > 0),
                           8 if learn_sigma else 4)
    assert got == want
    assert model.pos_embed.requires_grad is False
    assert [n for n, q in model.named_parameters() if not q.requires_grad] == ["pos_embed"]


def test_config_is_the_checkpoint_model_config():
    model = meta_model("DiT-XL/2")
    assert model.config == {"model": "DiT-XL/2", "input_size": 32, "num_classes": 1000, "learn_sigma": True,
                            "in_channels": 4, "depth": 28, "hidden_size": 1152, "num_heads": 16,
                            "patch_size": 2, "class_dropout_prob": 0.1}
    tiny = tiny_model(randomize=False)
    assert tiny.config["model"] is None
    rebuilt = dit.model_from_config(tiny.config)
    assert rebuilt.config == tiny.config


def test_fresh_model_outputs_exact_zeros():
    model = tiny_model(randomize=False)
    x = torch.randn(3, 4, 8, 8)
    out = model(x, torch.tensor([0, 500, 999]), torch.tensor([0, 4, 5]))
    assert out.shape == (3, 8, 8, 8)
    assert torch.equal(out, torch.zeros_like(out))


def test_pos_embed_hand_computed():
    # hidden 8, grid 2: omega = [1, 1/100]; token 1 is (row 0, col 1)
    table = dit.pos_embed_2d(8, 2)
    s1, s01, c1, c01 = math.sin(1), math.sin(0.01), math.cos(1), math.cos(0.01)
    assert table[1].tolist() == pytest.approx([s1, s01, c1, c01, 0, 0, 1, 1], abs=1e-15)
    assert table[2].tolist() == pytest.approx([0, 0, 1, 1, s1, s01, c1, c01], abs=1e-15)
    assert torch.allclose(torch.from_numpy(dit.pos_embed_2d(32, 4)), ref_pos_embed(32, 4), atol=1e-14)
    model = tiny_model(randomize=False)
    assert torch.equal(model.pos_embed[0], ref_pos_embed(32, 4).float())


def test_timestep_embedding_hand_computed():
    # dim 4: freqs [1, 0.01]
    emb = dit.timestep_embedding(torch.tensor([2]), dim=4)[0].tolist()
    assert emb == pytest.approx([math.cos(2), math.cos(0.02), math.sin(2), math.sin(0.02)], abs=1e-7)
    t = torch.tensor([0, 1, 37, 999])
    got = dit.timestep_embedding(t).double()
    want = torch.tensor([ref_timestep_embedding(float(v)) for v in t], dtype=torch.float64)
    assert (got - want).abs().max() < 2e-4  # float32 args at t = 999: |t * f| rounding ~ 6e-5


def test_forward_matches_independent_float64_definition():
    model = tiny_model()
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    t, y = torch.tensor([3, 871]), torch.tensor([1, 5])
    got = model.eval()(x, t, y).double()
    want = ref_forward(model, x, t, y)
    assert want.abs().max() > 1.0
    assert (got - want).abs().max() / want.abs().max() < 1e-5


def test_cfg_scale_one_is_conditional_and_guidance_formula():
    model = tiny_model().eval()
    z = torch.randn(2, 4, 8, 8)
    x, t = torch.cat([z, z]), torch.tensor([10, 700, 10, 700])
    y = torch.tensor([1, 2, 5, 5])  # cond labels, then the null id
    cond = model(z, t[:2], y[:2])
    uncond = model(z, t[2:], y[2:])
    out1 = model.forward_with_cfg(x, t, y, 1.0)
    assert torch.allclose(out1[:2, :4], cond[:, :4], atol=1e-6)
    out4 = model.forward_with_cfg(x, t, y, 4.0)
    guided3 = uncond[:, :3] + 4.0 * (cond[:, :3] - uncond[:, :3])
    assert torch.allclose(out4[:2, :3], guided3, atol=1e-5)
    assert torch.allclose(out4[2:, :3], guided3, atol=1e-5)
    assert torch.allclose(out4[:2, 3:], cond[:, 3:], atol=1e-6)  # channel 4 + variance unguided
    assert torch.allclose(out4[2:, 3:], uncond[:, 3:], atol=1e-6)
    out_all = model.forward_with_cfg(x, t, y, 4.0, guide_channels="all")
    assert torch.allclose(out_all[:2, :4], uncond[:, :4] + 4.0 * (cond[:, :4] - uncond[:, :4]), atol=1e-5)
    assert torch.allclose(out_all[:2, 4:], cond[:, 4:], atol=1e-6)
    assert torch.equal(model.forward_with_cfg(x, t, y, 4.0, guide_channels=None), out_all)
    with pytest.raises(ValueError, match="even batch"):
        model.forward_with_cfg(x[:3], t[:3], y[:3], 4.0)
    with pytest.raises(ValueError, match="guide_channels must be 1..4"):
        model.forward_with_cfg(x, t, y, 4.0, guide_channels=5)


def test_class_dropout_is_reproducible_and_forcible():
    model = tiny_model(class_dropout_prob=0.5).train()
    x, t, y = torch.randn(8, 4, 8, 8), torch.full((8,), 5), torch.arange(8) % 5
    a = model(x, t, y, generator=torch.Generator().manual_seed(7))
    b = model(x, t, y, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    drop = torch.tensor([1, 0, 1, 0, 0, 0, 1, 1])
    forced = model(x, t, y, force_drop_ids=drop)
    by_hand = model.eval()(x, t, torch.where(drop == 1, 5, y))
    assert torch.allclose(forced, by_hand, atol=1e-6)
    assert torch.allclose(model(x, t, y, force_drop_ids=drop), by_hand, atol=1e-6)  # also in eval
    no_null = tiny_model(class_dropout_prob=0.0)
    assert no_null.y_embedder.embedding_table.weight.shape[0] == 5
    with pytest.raises(ValueError, match="class_dropout_prob > 0"):
        no_null(x, t, y, force_drop_ids=drop)


def test_grad_checkpointing_changes_nothing_but_memory():
    torch.manual_seed(0)
    model = tiny_model()
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([1, 2]), torch.tensor([0, 1])
    names = [n for n, _ in model.named_parameters()]

    def grads():
        model.zero_grad()
        model(x, t, y, force_drop_ids=torch.zeros(2)).square().sum().backward()
        return [p.grad.clone() for p in model.parameters() if p.requires_grad]

    plain = grads()
    for setting, flags in ((True, [True, True]), (1, [True, False]), ([1], [False, True])):
        model.set_grad_checkpointing(setting)
        assert [b.grad_checkpointing for b in model.blocks] == flags
        assert [n for n, _ in model.named_parameters()] == names
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(plain, grads()))
    model.set_grad_checkpointing(False)
    assert not any(b.grad_checkpointing for b in model.blocks)
    with pytest.raises(ValueError, match="0..2"):
        model.set_grad_checkpointing(3)


def test_compiles_fullgraph_forward_and_backward():
    model = tiny_model()
    model.set_grad_checkpointing(1)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([1, 900]), torch.tensor([0, 3])
    out = compiled(x, t, y, force_drop_ids=torch.tensor([0, 1]))
    out.square().mean().backward()
    ref = model(x, t, y, force_drop_ids=torch.tensor([0, 1]))
    assert torch.allclose(out, ref, atol=1e-5)
    assert model.blocks[0].attn.qkv.weight.grad is not None


def test_return_hidden_is_the_tokens_after_block_k_and_changes_nothing_else():
    model = tiny_model(depth=3).eval()
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(5))
    t, y = torch.tensor([3, 871]), torch.tensor([1, 5])
    plain = model(x, t, y)
    for k in (1, 2, 3):
        out, hidden = model(x, t, y, return_hidden=k)
        assert torch.equal(out, plain)  # the same computation, bit for bit
        want_out, want_hidden = ref_forward(model, x, t, y, hidden_after=k)
        assert hidden.shape == (2, 16, 32)
        assert (hidden.double() - want_hidden).abs().max() / want_hidden.abs().max() < 1e-5
        assert (out.double() - want_out).abs().max() / want_out.abs().max() < 1e-5
    for bad in (0, 4, -1, 1.0, True):
        with pytest.raises(ValueError, match=r"return_hidden must be a block count in 1..3"):
            model(x, t, y, return_hidden=bad)


def test_return_hidden_under_grad_checkpointing_and_regional_compile():
    torch.manual_seed(0)
    model = tiny_model(depth=3)
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([1, 2]), torch.tensor([0, 1])

    def grads():
        model.zero_grad()
        out, hidden = model(x, t, y, force_drop_ids=torch.zeros(2), return_hidden=2)
        (out.square().sum() + hidden.sin().sum()).backward()  # gradients reach the blocks through both
        return hidden.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]

    hidden, plain = grads()
    model.set_grad_checkpointing(True)
    h2, ckpt = grads()
    assert torch.equal(h2, hidden)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(plain, ckpt))
    model.set_grad_checkpointing(False)
    for block in [*model.blocks, model.final_layer]:  # the trainer's per-block compile, in place
        block.compile(backend="aot_eager")
    h3, compiled = grads()
    assert torch.allclose(h3, hidden, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(plain, compiled))


def test_bf16_autocast_is_finite_and_close():
    model = calm_model()
    x, t, y = torch.randn(4, 4, 8, 8), torch.tensor([0, 10, 500, 999]), torch.tensor([0, 1, 2, 5])
    with torch.no_grad():
        fp32 = model(x, t, y)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = model(x, t, y)
    assert torch.isfinite(bf16).all()
    rel = ((bf16.float() - fp32).norm() / fp32.norm()).item()
    assert 0 < rel < 1.5e-2, rel  # measured 3.8e-3 (BENCHMARKS.md)


def test_bad_inputs_are_refused_with_the_shapes():
    model = tiny_model(randomize=False)
    with pytest.raises(ValueError, match=r"x of shape \[N, 4, 8, 8\], got \[2, 4, 16, 16\]"):
        model(torch.zeros(2, 4, 16, 16), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="t and y must have shape"):
        model(torch.zeros(2, 4, 8, 8), torch.zeros(3, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="not divisible by patch_size"):
        dit.DiT(**{**TINY, "input_size": 9})
    with pytest.raises(ValueError, match="unknown DiT options"):
        dit.create_model("DiT-S/2", mlp_ratio=2)


def test_forward_macs_match_the_published_cost():
    config = meta_model("DiT-XL/2").config
    assert round(dit.forward_macs(config) / 1e9, 1) == 118.6
    assert dit.train_flops_per_image(config) == 6 * dit.forward_macs(config)
    # doubling the latent side quadruples tokens: the 512px model costs > 4x (attention is quadratic)
    assert dit.forward_macs({**config, "input_size": 64}) > 4 * dit.forward_macs(config)
