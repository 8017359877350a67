"""Numerics under bf16 autocast (CPU autocast here): every normalization (LayerNorm / RMSNorm in the blocks,
QK-norm), REPA's cosine and the loss reductions run in float32 whatever the autocast (dit/blocks.py
`float32_norm`), checked by recording the dtype each norm kernel receives inside a real forward."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dit_pipeline import dit
from dit_pipeline.dit import repa
from dit_pipeline.dit.blocks import LayerNorm32, RMSNorm32, float32_norm

TINY = dict(input_size=8, depth=2, hidden_size=64, num_heads=4, patch_size=2, num_classes=5)


@pytest.fixture
def kernels(monkeypatch):
    """(kernel, input dtype, autocast on) of every layer_norm / rms_norm / normalize call."""
    seen: list[tuple[str, torch.dtype, bool]] = []
    for name in ("layer_norm", "rms_norm", "normalize"):
        real = getattr(F, name)

        def spy(x, *a, _real=real, _name=name, **k):
            seen.append((_name, x.dtype, torch.is_autocast_enabled("cpu")))
            return _real(x, *a, **k)
        monkeypatch.setattr(F, name, spy)
    return seen


@pytest.mark.parametrize("rms_norm", [False, True])
def test_block_norms_and_qk_norm_run_in_float32_inside_bf16_autocast(kernels, rms_norm):
    torch.manual_seed(0)
    model = dit.create_model("DiT-S/2", **TINY, qk_norm=True, rms_norm=rms_norm, learn_sigma=True)
    assert isinstance(model.blocks[0].attn.q_norm, RMSNorm32)
    assert isinstance(model.blocks[0].norm1, RMSNorm32 if rms_norm else LayerNorm32)
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([10, 900]), torch.tensor([1, 2])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        terms = dit.create_diffusion("").training_losses(model, x, t, {"y": y})
    per_forward = 2 * (2 + 2) + 1                          # per block norm1, norm2, q, k; the final norm
    assert len(kernels) == per_forward
    assert {(dtype, on) for _, dtype, on in kernels} == {(torch.float32, False)}
    assert {k: v.dtype for k, v in terms.items()} == {"loss": torch.float32, "mse": torch.float32,
                                                      "vb": torch.float32}


def test_float32_norm_returns_the_input_dtype_and_the_float32_values():
    norm = torch.nn.RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 16))
    x = (torch.randn(4, 16) * 300).bfloat16()               # a qkv output of large magnitude, in bf16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = float32_norm(norm, x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, norm(x.float()).bfloat16())    # the float32 result, rounded once


def test_repa_cosine_and_flow_loss_reduce_in_float32_inside_bf16_autocast(kernels):
    g = torch.Generator().manual_seed(0)
    z, p = torch.randn(2, 4, 8, generator=g), torch.randn(2, 4, 8, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = repa.projection_loss([z.bfloat16()], [p.bfloat16()])
    assert got.dtype == torch.float32 and {(d, on) for _, d, on in kernels} == {(torch.float32, False)}
    want = -(F.normalize(z.bfloat16().float(), dim=-1) * F.normalize(p.bfloat16().float(), dim=-1)).sum(-1).mean(1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.manual_seed(0)
    model = dit.create_model("DiT-S/2", **TINY, learn_sigma=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        terms = dit.create_flow().training_losses(model, torch.randn(2, 4, 8, 8), torch.tensor([0.2, 0.7]),
                                                  {"y": torch.tensor([0, 1])})
    assert terms["loss"].dtype == torch.float32
