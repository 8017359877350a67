"""x-prediction (dit.flow_predictions.CleanPrediction) against NanoGen's own rules, transcribed here from its code
(End2End-Diffusion/diffusion-bench at 4848f0c), independently of dit/flow*.py, and run on the same network and noise.

NanoGen's time t is the noise level (t = 1 noise; x1 the data, x0 the noise), ours SiT's (t = 1 data), so the same
network is called at t_ours = 1 - t_nano by NanoGen's side (`nano_net`).

- src/stage2/transport/transport.py lines 36-40 (`Transport.sample`): t = sigmoid(randn * sigma + mu), then
  t = shift t / (1 + (shift - 1) t); lines 49-50: xt = (1 - t) x1 + t x0, vt = (xt - x1) / t.clamp_min(t_eps);
  lines 105-115 (`convert_model_pred`, `compute_loss`): v = (xt - out) / t.clamp_min(t_eps), loss (v - vt)^2;
  src/stage2/engine.py line 151: `loss_dict["loss"].mean()`, the mean over all elements;
- src/stage2/transport/sampler.py lines 10-34 (`sample_ode`): t_grid = linspace(1, 0, num_steps + 1) shifted by
  time_dist_shift_eval (1 for jit-ddt: time_dist_shift_base_eval = time_dist_shift_dim), x = x - h drift with
  h = t_i - t_{i+1} and drift = convert_model_pred(model(x, t_i)) (transport.py lines 117-127);
- configs/stage2/training/imagenet/jit-ddt-en28d1152hd72-dn2d2048hd128-xpred-t4c8.yaml: prediction 'x',
  logit-normal_-1.1_0.8, 50 steps, time_dist_shift_dim 196608 over base 4096 (shift sqrt(48)); t_eps 0.05
  (src/configs/stage2.py line 39).
"""
from __future__ import annotations

import math

import torch

from dit_pipeline import dit
from dit_pipeline.dit import flow
from tests._util import FP32_EPS, assert_close_at_scale

T_EPS = 0.05
SHIFT = math.sqrt(196608 / 4096)


def _net():
    torch.manual_seed(0)
    net = dit.create_model("DiT-S/2", input_size=8, in_channels=3, hidden_size=32, depth=2, num_heads=2,
                           num_classes=4, learn_sigma=False).eval()
    with torch.no_grad():  # DiT zero-initialises its output: give every layer a value
        for p in net.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return net


def _nano_loss(nano_net, x1, x0, t, y):
    """transport.py lines 49-50, 105-115 and engine.py line 151, transcribed."""
    te = t.view(-1, 1, 1, 1)
    xt = (1 - te) * x1 + te * x0
    vt = (xt - x1) / te.clamp_min(T_EPS)
    out = nano_net(xt, t, y)
    v = (xt - out) / te.clamp_min(T_EPS)
    return ((v - vt) ** 2).mean()


def _nano_sample(nano_net, x, y, steps=50, shift=1.0):
    """sampler.py lines 10-34 with transport.py's drift for prediction 'x', transcribed."""
    grid = torch.linspace(1.0, 0.0, steps + 1)
    grid = shift * grid / (1 + (shift - 1) * grid)
    for i in range(steps):
        h = grid[i] - grid[i + 1]
        tb = torch.full((x.shape[0],), grid[i].item())
        out = nano_net(x, tb, y)
        d = (x - out) / tb.view(-1, 1, 1, 1).clamp_min(T_EPS)
        x = x - h * d
    return x


def test_xpred_loss_and_euler_sampler_match_nanogen_on_the_same_network_and_noise():
    net = _net()

    def nano_net(x, t_nano, y):  # NanoGen's time is our 1 - t
        return net(x, 1 - t_nano, y)

    g = torch.Generator().manual_seed(1)
    x1 = torch.rand(6, 3, 8, 8, generator=g) * 2 - 1                        # clean images in [-1, 1]
    x0 = torch.randn(6, 3, 8, 8, generator=g)
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    t_nano = torch.tensor([0.999, 0.97, 0.7, 0.3, 0.04, 0.01])  # the last two below t_eps: the clamp acts
    ours = flow.FlowMatching(prediction="x", t_eps=T_EPS)
    with torch.no_grad():
        loss = ours.training_losses(net, x1, 1 - t_nano, {"y": y}, noise=x0)
        want = _nano_loss(nano_net, x1, x0, t_nano, y)
    # per-sample means of equal-sized samples, averaged by the trainer: NanoGen's mean over all elements
    assert_close_at_scale(loss["loss"].mean(), want, rel=64 * FP32_EPS, what="x-prediction loss")
    assert loss["loss"].mean() > 0.1  # the weight 1 / max(t, 0.05)^2 makes it large: a wrong clamp would show
    with torch.no_grad():
        sampled = ours.sample_loop(net, x0, sampler="euler", steps=50, model_kwargs={"y": y}, time_shift=1.0)
        want_x = _nano_sample(nano_net, x0.clone(), y)
    assert_close_at_scale(sampled, want_x, rel=256 * FP32_EPS, what="50-step Euler from noise")
    assert not torch.allclose(sampled, flow.FlowMatching().sample_loop(net, x0, sampler="euler", steps=50,
                                                                       model_kwargs={"y": y}), atol=1e-2)


def test_training_times_are_nanogens_logit_normal_shifted_by_sqrt_48():
    """NanoGen: t_nano = shift(sigmoid(-1.1 + 0.8 n)); ours t = shift_time(sigmoid(1.1 + 0.8 n)) = 1 - t_nano at -n."""
    ours = flow.FlowMatching(t_sampling="logit-normal", t_mean=1.1, t_scale=0.8, time_shift=SHIFT, prediction="x")
    t = ours.draw_timesteps(1000, generator=torch.Generator().manual_seed(3))
    n = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    t_nano = (-n * 0.8 + -1.1).sigmoid()
    t_nano = SHIFT * t_nano / (1 + (SHIFT - 1) * t_nano)
    assert_close_at_scale(t, 1 - t_nano, rel=8 * FP32_EPS, what="training times")
    assert 0.6 < float((1 - t).median()) < 0.8  # mostly noisy: sigmoid(-1.1) = 0.25 shifted to about 0.7
