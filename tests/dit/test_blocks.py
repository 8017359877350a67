"""Optional block features: off = today's DiT exactly; each on is recorded, inferred on load, and computes
what its definition says (checked against independent formulas)."""
from __future__ import annotations

import pytest
import torch

from dit_pipeline import dit
from dit_pipeline.dit.blocks import apply_rope, rope_2d_tables, swiglu_hidden

TINY = dict(input_size=8, depth=2, hidden_size=64, num_heads=4, patch_size=2, num_classes=5)
OPTIONS = ("qk_norm", "rms_norm", "swiglu", "rope")


def build(seed: int = 0, **opts) -> dit.DiT:
    torch.manual_seed(seed)
    model = dit.create_model("DiT-S/2", **TINY, **opts).eval()
    with torch.no_grad():  # adaLN-Zero starts at output 0; perturb so every path matters
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return model


def inputs(n: int = 3):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, 8, 8, generator=g), torch.tensor([3.0, 500.0, 999.0][:n]), torch.arange(n)


def test_all_off_is_todays_dit():
    plain, off = build(), build(qk_norm=False, rms_norm=False, swiglu=False, rope=False)
    assert list(plain.state_dict()) == list(off.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), off.state_dict().values()))
    assert plain.config == off.config and not set(OPTIONS) & set(plain.config)
    assert torch.equal(plain(*inputs()), off(*inputs()))


@pytest.mark.parametrize("option", OPTIONS)
def test_each_option_is_recorded_and_inferred_on_load(option, tmp_path):
    model = build(**{option: True})
    assert model.config[option] is True
    out = model(*inputs())
    assert not torch.allclose(out, build()(*inputs()), atol=1e-3)  # the option changes the computation
    path = tmp_path / "w.pt"
    torch.save({"format": "dit-pipeline.checkpoint", "version": 1, "model_config": model.config,
                "ema": model.state_dict()}, path)
    sd, info = dit.load_dit_weights(path)
    assert info["model_config"][option] is True
    assert torch.equal(dit.build_model_from_weights(sd, info)(*inputs()), out)


@pytest.mark.parametrize("option,visible", [("qk_norm", True), ("swiglu", True), ("rms_norm", False),
                                            ("rope", False)])
def test_bare_state_dict_infers_options_with_parameters(option, visible):
    sd = build(**{option: True}).state_dict()
    config = dit.infer_model_config(sd, {k: v for k, v in TINY.items()})
    assert config.get(option, False) is visible
    assert "rms_norm" not in dit.infer_model_config(build().state_dict(), dict(TINY))


def test_rms_norm_and_qk_norm_match_the_formula():
    x = torch.randn(2, 16, 64)
    norm = build(rms_norm=True).blocks[0].norm1
    assert torch.allclose(norm(x), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), atol=1e-6)
    attn = build(qk_norm=True).blocks[0].attn
    q = torch.randn(2, 4, 16, 16)
    want = q / torch.sqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * attn.q_norm.weight
    assert torch.allclose(attn.q_norm(q), want, atol=1e-6)


def test_swiglu_matches_the_formula():
    mlp = build(swiglu=True).blocks[0].mlp
    hidden = swiglu_hidden(64, 4)
    assert hidden == 176 and swiglu_hidden(1152, 4) == 3072  # 2/3 of 4 x width, rounded up to 8
    x = torch.randn(5, 64)
    w, b = mlp.w12.weight, mlp.w12.bias
    a, g = x @ w[:hidden].T + b[:hidden], x @ w[hidden:].T + b[hidden:]
    want = (a * torch.sigmoid(a) * g) @ mlp.w3.weight.T + mlp.w3.bias
    assert torch.allclose(mlp(x), want, atol=1e-5)


def test_rope_scores_depend_only_on_the_2d_offset():
    grid, hd = 4, 16
    cos, sin = rope_2d_tables(grid, hd, torch.device("cpu"), torch.float64)
    q, k = torch.randn(hd, dtype=torch.float64), torch.randn(hd, dtype=torch.float64)
    qr = apply_rope(q.expand(1, 1, grid * grid, hd), cos, sin)[0, 0]  # the same q at every position
    kr = apply_rope(k.expand(1, 1, grid * grid, hd), cos, sin)[0, 0]
    assert torch.allclose(qr[0], q) and torch.allclose(qr.norm(dim=-1), q.norm().expand(grid * grid))
    scores = qr @ kr.T
    pos = [(i // grid, i % grid) for i in range(grid * grid)]
    by_offset: dict = {}
    for i, (ri, ci) in enumerate(pos):
        for j, (rj, cj) in enumerate(pos):
            by_offset.setdefault((ri - rj, ci - cj), []).append(scores[i, j])
    assert len(by_offset) == (2 * grid - 1) ** 2
    for values in by_offset.values():
        assert torch.allclose(torch.stack(values), values[0].expand(len(values)), atol=1e-12)
    # a column step rotates only the first half of the features, a row step only the second half
    assert torch.allclose(qr[1, hd // 2:], q[hd // 2:]) and not torch.allclose(qr[1, : hd // 2], q[: hd // 2])
    assert torch.allclose(qr[grid, : hd // 2], q[: hd // 2]) and not torch.allclose(qr[grid, hd // 2:], q[hd // 2:])


def test_rope_needs_head_dim_divisible_by_4():
    with pytest.raises(ValueError, match="rope needs a head dimension divisible by 4, got 6"):
        dit.create_model("DiT-S/2", input_size=8, depth=1, hidden_size=24, num_heads=4, rope=True)
