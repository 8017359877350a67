"""dit.repa: REPA's projector (shapes, names, init), projection loss (against the formula written out here),
the combined loss, the DiT + projector module, and that module under DDP with 2 real gloo ranks."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from dit_pipeline import dit
from dit_pipeline.dit import repa
from dit_pipeline.dit.flow_predictions import interpolate
from tests._util import cli_env, free_port
from tests.dit._reference import tiny_model


def test_projector_names_shapes_and_repa_init():
    torch.manual_seed(0)
    proj = repa.Projector(1152)
    shapes = {k: list(v.shape) for k, v in proj.state_dict().items()}
    assert shapes == {"0.weight": [2048, 1152], "0.bias": [2048], "2.weight": [2048, 2048], "2.bias": [2048],
                      "4.weight": [768, 2048], "4.bias": [768]}
    assert [type(m).__name__ for m in proj] == ["Linear", "SiLU", "Linear", "SiLU", "Linear"]
    for i in (0, 2, 4):
        w, b = proj[i].weight, proj[i].bias
        fan_out, fan_in = w.shape
        # xavier-uniform, as REPA's SiT init. torch's default Linear init would fail both checks: random biases,
        # and weights bounded by 1/sqrt(fan_in) (0.029 and 0.022 here, below 0.999 x the xavier bounds 0.043, 0.038, 0.046)
        bound = math.sqrt(6 / (fan_in + fan_out))
        assert torch.equal(b, torch.zeros_like(b))
        assert w.abs().max() <= bound and w.abs().max() > 0.999 * bound
        var = w.double().var().item()  # uniform(-a, a) has variance a^2 / 3 = 2 / (fan_in + fan_out)
        assert abs(var / (2 / (fan_in + fan_out)) - 1) < 0.01, (i, var)


def test_repa_model_returns_the_dit_output_and_the_projected_hidden_state():
    model = tiny_model(depth=3, learn_sigma=False).eval()
    head = repa.REPAModel(model, encoder_depth=2, z_dims=(12, 7), projector_dim=16)
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([0.25, 0.75]), torch.tensor([1, 4])
    out, zs = head(x, t, y)
    assert torch.equal(out, model(x, t, y))
    _, hidden = model(x, t, y, return_hidden=2)
    assert [list(z.shape) for z in zs] == [[2, 16, 12], [2, 16, 7]]
    for z, projector in zip(zs, head.projectors):
        assert torch.equal(z, projector(hidden))
    assert head.config == {"encoder_depth": 2, "z_dims": [12, 7], "projector_dim": 16}
    keys = set(repa.repa_layout(head))
    assert keys == set(model.state_dict()) | {f"projectors.{i}.{j}.{w}" for i in (0, 1) for j in (0, 2, 4)
                                               for w in ("weight", "bias")}
    dit_part, proj_part = repa.split_repa_layout(repa.repa_layout(head))
    assert set(dit_part) == set(model.state_dict()) and set(proj_part) == set(head.projectors.state_dict())
    assert set(head.state_dict()) == {f"dit.{k}" for k in model.state_dict()} | {
        f"projectors.{k}" for k in head.projectors.state_dict()}
    for bad in (0, 4, True):
        with pytest.raises(ValueError, match=r"encoder_depth must be in 1..3 \(the DiT's depth\)"):
            repa.REPAModel(model, encoder_depth=bad)
    with pytest.raises(ValueError, match="z_dims must list one positive feature width per teacher"):
        repa.REPAModel(model, encoder_depth=1, z_dims=())


def _formula_loss(targets, predictions):
    """REPA's projection loss written out: for each teacher and sample, the mean over tokens of minus the
    cosine of the two vectors (each divided by its Euclidean norm); summed, then divided by teachers x N."""
    total, n = 0.0, targets[0].shape[0]
    for z, p in zip(targets, predictions):
        for j in range(n):
            cosines = []
            for a, b in zip(z[j].double().tolist(), p[j].double().tolist()):
                na, nb = math.sqrt(sum(v * v for v in a)), math.sqrt(sum(v * v for v in b))
                cosines.append(sum(u * v for u, v in zip(a, b)) / (na * nb))
            total += -sum(cosines) / len(cosines)
    return total / (len(targets) * n)


def test_projection_loss_on_fixed_inputs():
    z = torch.tensor([[[1.0, 0.0], [0.0, 2.0]]])       # one sample, two tokens
    p = torch.tensor([[[3.0, 0.0], [1.0, 1.0]]])
    want = -(1.0 + 1 / math.sqrt(2)) / 2
    assert repa.projection_loss([z], [p]).tolist() == pytest.approx([want], abs=1e-7)
    g = torch.Generator().manual_seed(0)
    targets = [torch.randn(3, 5, 6, generator=g), torch.randn(3, 5, 4, generator=g)]
    preds = [torch.randn(3, 5, 6, generator=g), torch.randn(3, 5, 4, generator=g)]
    per_sample = repa.projection_loss(targets, preds)
    assert per_sample.shape == (3,) and per_sample.dtype == torch.float32
    assert per_sample.mean().item() == pytest.approx(_formula_loss(targets, preds), abs=1e-6)
    scaled = repa.projection_loss([2.5 * targets[0], targets[1]], [preds[0], 0.1 * preds[1]])
    assert torch.allclose(scaled, per_sample, atol=1e-6)  # cosine: invariant to the scale of either side
    assert repa.projection_loss(preds, preds).tolist() == pytest.approx([-1.0] * 3, abs=1e-6)
    with pytest.raises(ValueError, match=r"teacher 1: features \[3, 5, 4\] and projection \[3, 4, 4\] must both"):
        repa.projection_loss(targets, [preds[0], preds[1][:, :4]])
    with pytest.raises(ValueError, match="2 teacher feature tensors, 1 projections"):
        repa.projection_loss(targets, preds[:1])


@pytest.mark.parametrize("objective", ["flow", "ddpm"])
def test_training_losses_add_half_the_projection_loss(objective):
    model = tiny_model(depth=3, learn_sigma=objective == "ddpm")
    head = repa.REPAModel(model, encoder_depth=1, z_dims=(10,), projector_dim=16)
    g = torch.Generator().manual_seed(1)
    x, noise = torch.randn(4, 4, 8, 8, generator=g), torch.randn(4, 4, 8, 8, generator=g)
    y, feats = torch.tensor([0, 1, 2, 3]), [torch.randn(4, 16, 10, generator=g)]
    if objective == "flow":
        obj, t = dit.create_flow(), torch.tensor([0.1, 0.4, 0.6, 0.9])
    else:
        obj, t = dit.create_diffusion(""), torch.tensor([0, 10, 500, 999])
    drop = torch.zeros(4)
    terms = repa.training_losses(obj, head, x, t, feats, {"y": y, "force_drop_ids": drop}, noise=noise)
    plain = obj.training_losses(model, x, t, {"y": y, "force_drop_ids": drop}, noise=noise)
    assert set(terms) == set(plain) | {"proj"}  # the objective's own terms (flow has no vb), and the alignment
    for key in plain:
        if key != "loss":
            assert torch.equal(terms[key], plain[key])
    _, hidden = model(noised(obj, x, noise, t), t, y, drop, return_hidden=1)  # identity timestep map
    assert torch.allclose(terms["proj"], repa.projection_loss(feats, [head.projectors[0](hidden)]), atol=1e-6)
    assert torch.allclose(terms["loss"], plain["loss"] + 0.5 * terms["proj"], atol=1e-6)
    assert repa.training_losses(obj, head, x, t, feats, {"y": y}, noise=noise, proj_coeff=0.0)["loss"].shape == (4,)
    terms["loss"].mean().backward()
    assert head.projectors[0][4].weight.grad.abs().sum() > 0
    assert model.blocks[0].attn.qkv.weight.grad.abs().sum() > 0


def noised(obj, x, noise, t):
    if isinstance(obj, dit.FlowMatching):
        return interpolate(x, noise, t)
    return obj.q_sample(x, t, noise)


def test_repa_model_under_ddp_matches_one_process_on_the_whole_batch(tmp_path):
    """2 gloo ranks, each half of the batch, one DDP-wrapped REPAModel: the averaged gradients equal the gradient
    of the mean loss over the whole batch in one process (DDP sees every parameter used: no unused-parameter
    error, projectors included)."""
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent("""
        import json, sys, torch
        from torch.nn.parallel import DistributedDataParallel
        from dit_pipeline import dit
        from dit_pipeline.common import distributed as dist
        from dit_pipeline.dit import repa
        sys.path.insert(0, sys.argv[2])
        from tests.dit.test_repa import ddp_case
        dist.init()
        with dist.leaving_group():
            r = dist.rank()
            head, obj, x, t, y, noise, feats = ddp_case()
            ddp = DistributedDataParallel(head)
            rows = slice(2 * r, 2 * r + 2)
            loss = repa.training_losses(obj, ddp, x[rows], t[rows], [feats[0][rows]], {"y": y[rows]},
                                        noise=noise[rows])["loss"].mean()
            loss.backward()
            grads = {k: p.grad.tolist() for k, p in head.named_parameters() if k in WATCH}
            with open(sys.argv[1] + f".{r}", "w") as f:
                json.dump(grads, f)
    """).replace("WATCH", repr(DDP_WATCH)))
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                          "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(script),
                          str(tmp_path / "grads"), str(_root())], capture_output=True, text=True, env=cli_env(),
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    head, obj, x, t, y, noise, feats = ddp_case()
    repa.training_losses(obj, head, x, t, feats, {"y": y}, noise=noise)["loss"].mean().backward()
    want = {k: p.grad for k, p in head.named_parameters() if k in DDP_WATCH}
    for r in range(2):
        got = json.loads((tmp_path / f"grads.{r}").read_text())
        assert set(got) == set(DDP_WATCH)
        for k, v in got.items():
            assert want[k].abs().max() > 0
            assert torch.allclose(torch.tensor(v), want[k], atol=1e-6, rtol=1e-5), k


DDP_WATCH = ("projectors.0.4.weight", "projectors.0.0.bias", "dit.blocks.0.attn.qkv.weight",
             "dit.final_layer.linear.weight")


def ddp_case():
    model = tiny_model(depth=2, learn_sigma=False).eval()  # eval: no random class dropout on either side
    head = repa.REPAModel(model, encoder_depth=1, z_dims=(8,), projector_dim=16)
    g = torch.Generator().manual_seed(3)
    x, noise = torch.randn(4, 4, 8, 8, generator=g), torch.randn(4, 4, 8, 8, generator=g)
    feats = [torch.randn(4, 16, 8, generator=g)]
    return head, dit.create_flow(), x, torch.tensor([0.2, 0.4, 0.6, 0.8]), torch.tensor([0, 1, 2, 3]), noise, feats


def _root():
    from pathlib import Path

    return Path(__file__).resolve().parents[2]
