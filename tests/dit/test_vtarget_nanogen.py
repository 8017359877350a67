"""Velocity prediction with NanoGen's clamped target (dit.flow_predictions.ClampedVelocityPrediction,
`--v-target clamped`) against NanoGen's own v-pred loss, transcribed here from its code
(End2End-Diffusion/diffusion-bench at 4848f0c), independently of dit/flow.py and dit/flow_predictions.py, and run
on the same network, noise and times.

NanoGen's time t is the noise level (t = 1 noise; x1 the data, x0 the noise) and its velocity d xt / dt = x0 - x1;
ours is SiT's (t = 1 data, velocity data - noise). The same network seen from NanoGen's side is therefore called at
1 - t and its output negated (`nano_net`).

- src/stage2/transport/transport.py lines 49-50 (`Transport.training_losses`): xt = (1 - t) x1 + t x0,
  vt = (xt - x1) / t.clamp_min(self.t_eps); lines 105-108 (`convert_model_pred`): prediction 'velocity' returns
  the output unchanged; lines 113-115 (`compute_loss`): (output - vt) ** 2; src/stage2/engine.py line 151:
  `loss_dict["loss"].mean()`, the mean over all elements;
- src/configs/stage2.py line 39: t_eps 0.05; every `*-vpred-*` config trains `transport.prediction: velocity`.
"""
from __future__ import annotations

import json

import pytest

import torch

from dit_pipeline import dit
from dit_pipeline.dit import flow, flow_predictions, flow_samplers
from dit_pipeline.dit.objectives import build_objective, spec
from dit_pipeline.sample.export import export_safetensors
from dit_pipeline.sample.generate import FlowLoop
from tests._util import FP32_EPS, assert_close_at_scale

T_EPS = 0.05  # src/configs/stage2.py line 39
# noise levels t_nano, four below t_eps (the clamp acts), one at it; most exact in float32 so both sides build the
# same xt bit for bit, the others (0.3, 0.05, 0.04, 0.01) drawn as a trainer draws them
T_NANO = torch.tensor([0.999, 0.75, 0.3, 0.0625, 0.05, 0.04, 0.03125, 0.01, 2.0 ** -10])
CLAMPED = T_NANO < T_EPS


def _net():
    torch.manual_seed(0)
    net = dit.create_model("DiT-S/2", input_size=8, in_channels=4, hidden_size=32, depth=2, num_heads=2,
                           num_classes=4, learn_sigma=False).eval()
    with torch.no_grad():  # DiT zero-initialises its output: give every layer a value
        for p in net.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return net


def _nano_vpred_loss(nano_net, x1, x0, t, y):
    """transport.py lines 49-50, 105-108, 113-115, transcribed: the elementwise loss [B, C, H, W]."""
    te = t.view(t.size(0), *([1] * (x1.dim() - 1)))
    xt = (1 - te) * x1 + te * x0
    vt = (xt - x1) / te.clamp_min(T_EPS)
    output = nano_net(xt, t, y)  # convert_model_pred, prediction 'velocity': the output as it is
    return (output - vt) ** 2


def _batch():
    g = torch.Generator().manual_seed(1)
    n = len(T_NANO)
    x1 = torch.randn(n, 4, 8, 8, generator=g) * 1.5          # latents
    x0 = torch.randn(n, 4, 8, 8, generator=g)
    y = torch.arange(n) % 4
    return x1, x0, y


def test_the_clamped_velocity_loss_is_nanogens_vpred_loss_and_the_plain_one_differs_below_t_eps():
    net = _net()

    def nano_net(x, t_nano, y):  # NanoGen's time is our 1 - t, its velocity (noise - data) our negated one
        return -net(x, 1 - t_nano, y)

    x1, x0, y = _batch()
    with torch.no_grad():
        want = _nano_vpred_loss(nano_net, x1, x0, T_NANO, y)
        clamped = flow.FlowMatching(v_target="clamped", t_eps=T_EPS).training_losses(net, x1, 1 - T_NANO, {"y": y},
                                                                                     noise=x0)
        plain = flow.FlowMatching().training_losses(net, x1, 1 - T_NANO, {"y": y}, noise=x0)
    per_sample = want.mean(dim=(1, 2, 3))
    # the engine's mean over all elements == the trainer's mean of equal-sized samples' means
    assert_close_at_scale(clamped["loss"].mean(), want.mean(), rel=16 * FP32_EPS, what="v-pred loss")
    assert_close_at_scale(clamped["loss"], per_sample, rel=32 * FP32_EPS, what="per-sample v-pred loss")
    assert torch.equal(clamped["loss"], clamped["mse"])
    # the plain target x - eps is NanoGen's wherever the noise level is at least t_eps ...
    assert_close_at_scale(plain["loss"][~CLAMPED], per_sample[~CLAMPED], rel=32 * FP32_EPS, what="plain above t_eps")
    # ... and below it NanoGen's is scaled by t / t_eps: the plain loss is larger there by a visible amount
    gap = plain["loss"][CLAMPED] - per_sample[CLAMPED]
    assert (gap > 0.1 * per_sample[CLAMPED]).all(), (plain["loss"], per_sample)


def test_the_clamped_target_is_the_velocity_scaled_by_the_noise_level_over_t_eps_below_it():
    """In NanoGen's terms: vt = x0 - x1 where t >= t_eps, (t / t_eps)(x0 - x1) below; ours is its negation."""
    x1, x0, _ = _batch()
    t = 1 - T_NANO
    x_t = flow_predictions.interpolate(x1, x0, t)
    got = flow_predictions.make_prediction("v", T_EPS, "clamped").target(x1, x0, x_t, t)
    scale = (T_NANO / T_EPS).clamp_max(1.0).view(-1, 1, 1, 1)
    # x - x_t cancels where x_t is near x, and the clamp divides that rounding by t_eps
    assert_close_at_scale(got, scale * (x1 - x0), rel=128 * FP32_EPS, what="clamped target")
    assert torch.equal(flow_predictions.make_prediction("v").target(x1, x0, x_t, t), x1 - x0)


def test_sampling_ignores_the_target_the_output_is_the_velocity():
    net = _net()
    x0 = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    y = torch.tensor([1, 3])
    record = {"kind": "v", "t_eps": T_EPS}
    with torch.no_grad():
        plain = flow.FlowMatching().sample_loop(net, x0, sampler="euler", steps=4, model_kwargs={"y": y})
        ours = flow.FlowMatching(v_target="clamped").sample_loop(net, x0, sampler="euler", steps=4,
                                                                 model_kwargs={"y": y})
        # dit-sample's loop for a file recording the clamped target (sample/generate.py)
        gens = [torch.Generator().manual_seed(i) for i in range(2)]
        loop = FlowLoop("euler", 4, prediction=record)(net, x0, y, gens)
        field = flow_samplers.velocity_field(net, 4, {"y": y},
                                             prediction=flow_predictions.prediction_from_record(record))
        v = field(x0, 0.3)
    assert torch.equal(ours, plain) and torch.equal(loop, plain)
    assert torch.equal(v, net(x0, torch.full((2,), 0.3), y))
    assert not torch.allclose(plain, x0)  # the network moved the samples


def test_the_record_round_trips_through_the_objective_sidecar_and_export(tmp_path):
    settings = {"prediction": "v", "v_target": "clamped", "t_eps": T_EPS}
    record = spec("flow").record(settings)
    assert record == {"time_shift": 1.0, "prediction": {"kind": "v", "t_eps": 0.05}}
    pred = flow_predictions.prediction_from_record(json.loads(json.dumps(record["prediction"])))
    assert type(pred) is flow_predictions.ClampedVelocityPrediction and pred.t_eps == 0.05
    assert pred.record() == record["prediction"]
    assert type(build_objective("flow", settings).prediction) is flow_predictions.ClampedVelocityPrediction
    # files without a record (every plain velocity model, before and after) read as the plain target
    assert spec("flow").record({"prediction": "v"}) == {"time_shift": 1.0}
    assert spec("flow").record({"prediction": "v", "v_target": "plain", "t_eps": 0.1}) == {"time_shift": 1.0}
    for old in (None, {"kind": "v"}):
        assert type(flow_predictions.prediction_from_record(old)) is flow_predictions.VelocityPrediction
    plain = build_objective("flow", {"prediction": "v", "t_eps": 0.05}).prediction
    assert type(plain) is flow_predictions.VelocityPrediction
    # the EMA sidecar and the safetensors export keep it
    net = dit.create_model("DiT-S/2", input_size=8, in_channels=4, hidden_size=32, depth=2, num_heads=2,
                           num_classes=4, learn_sigma=False)
    path = tmp_path / "step-0000010-ema.pt"
    torch.save(net.state_dict(), path)
    side = dit.make_sidecar(net.config, None, 10, objective="flow", time_shift=1.0, prediction=record["prediction"])
    (tmp_path / "step-0000010-ema.json").write_text(json.dumps(side))
    sd, info = dit.load_dit_weights(path)
    assert info["prediction"] == {"kind": "v", "t_eps": 0.05}
    out = export_safetensors(sd, info, tmp_path / "model.safetensors")
    _, back = dit.load_dit_weights(out)
    assert back["objective"] == "flow" and back["prediction"] == {"kind": "v", "t_eps": 0.05}


def test_the_dit_level_refusals_name_the_fix():
    with pytest.raises(ValueError, match=r"^unknown velocity target 'nano'; choose one of: plain, clamped$"):
        flow_predictions.make_prediction("v", T_EPS, "nano")
    with pytest.raises(ValueError, match=r"^the velocity target 'clamped' is a velocity prediction's; an "
                                         r"x-prediction's target is always \(x - x_t\) / max\(1 - t, t_eps\)$"):
        flow.FlowMatching(prediction="x", v_target="clamped")
    with pytest.raises(ValueError, match=r"^t_eps must be in \(0, 1\), got 0.0$"):
        flow_predictions.prediction_from_record({"kind": "v", "t_eps": 0.0})
