"""`dit-sample --protocol NAME` reproduces each release's sampler on the same network and noise: every release's
sampling loop is written out here from its code (file and line at each rule; its own time direction, grid, guidance
rule, interval ends, doubled batch and image conversion), run on a tiny random network of the release's family with
the noise dit-sample draws for each sample (sample/plan.py), and decoded with the release's image conversion; the
.npz equals it to one uint8 level on float32-noise latents. Also: DDT's encoder sharing with a guidance interval,
AutoGuidance's second network and its cost, one-step defaults of a MeanFlow model, and the refusals.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from dit_pipeline import dit
from dit_pipeline.common.errors import ConfigError, UserError
from dit_pipeline.common.vae import load_vae
from dit_pipeline.dit.family import create_model
from dit_pipeline.dit.meanflow import time_input
from dit_pipeline.sample import SampleConfig, run_sampling
from dit_pipeline.sample.plan import noise_generators
from tests.dit.test_families import TINY
from tests.features._tiny import make_tiny_decoder
from tests.sample.conftest import random_dit
from tests.sample.test_repa_sample import repa_sampler

SD_LATENT = {"scaling_factor": 0.5, "shift_factor": None}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny networks: one intra-op thread is several times faster on the shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny(family: str, seed: int, std: float = 0.05, **over):
    """A tiny random network of `family` (tests/dit/test_families.py's sizes), every trained tensor perturbed by
    N(0, std): small enough that the sampled latents stay O(1), so float32 rounding of a release's grid stays float32
    noise in them (at 0.2 the random network amplifies a 1e-8 change of one time by 1e5)."""
    torch.manual_seed(seed)
    model = create_model(**{**TINY[family], "num_classes": 5, **over})
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(std * torch.randn(p.shape, generator=g))
    return model.eval()


def own_checkpoint(path, model, *, objective="flow", convention=None, latent=None):
    """A checkpoint of ours holding `model` (its family, objective and time convention recorded)."""
    ckpt = {"format": "dit-pipeline.checkpoint", "version": 1, "model_config": model.config,
            "ema": model.state_dict(), "objective": objective, "latent": dict(latent or SD_LATENT)}
    if convention:
        ckpt["flow_convention"] = convention
    torch.save(ckpt, path)
    return path


def sample(tmp_path, name, ckpt, vae, *, n=3, seed=5, **kw):
    """dit-sample --protocol NAME (in-process): (uint8 images [n, H, W, 3], classes, the record)."""
    npz = tmp_path / f"{name}-{seed}.npz"
    run_sampling(SampleConfig(ckpt=str(ckpt), vae=str(vae), protocol=name, num_samples=n, seed=seed, batch_size=n,
                              quiet=True, npz=str(npz), **kw))
    with np.load(npz) as z:
        images, labels = z["arr_0"].astype(int), torch.as_tensor(z["arr_1"])
    return images, labels, json.loads((tmp_path / f"{npz.name}.json").read_text())


def noise_of(seed, n, shape):
    """The initial noise dit-sample draws for samples 0..n-1 of `seed`, and their generators, which then give the
    SDE samplers' step noise in order (sample/plan.py)."""
    gens = noise_generators(seed, range(n))
    return torch.stack([torch.randn(shape, generator=g) for g in gens]), gens


def same_pixels(got, want):
    """float32-noise latents decoded: at most one uint8 level apart, on a tiny fraction of the values."""
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1 and (got == want).mean() > 0.99


def dit_pixels(images):  # facebookresearch/DiT sample_ddp.py l.132 (SiT, LightningDiT's vavae.py l.81, MeanFlow: same)
    return torch.clamp(127.5 * images + 128.0, 0, 255).permute(0, 2, 3, 1).to(torch.uint8).numpy().astype(int)


@pytest.fixture(scope="module")
def sd_vae(tiny_vae_dir):
    return load_vae(str(tiny_vae_dir))[0]


def decode(vae, latents, scale=0.5):
    with torch.no_grad():
        return torch.cat([vae.decode(z[None] / scale).sample for z in latents])


# ---- SiT ---------------------------------------------------------------------------------------------------------

def sit_release(net, noise, y, gens, *, num_steps, cfg):
    """willisma/SiT: transport/integrators.py l.22-37 (t = linspace(0, 1 - 0.04, num_steps) in float32, dt = t[1] -
    t[0]; x += drift dt + sqrt(2 D) sqrt(dt) w), transport/transport.py (drift v + D s, sigma form D = 1 - t, score
    s = (t v - x) / (1 - t); l.260-262 the Mean last step x + drift(t1) 0.04), models.py l.250-265 forward_with_cfg on
    the doubled [x; x] with [y; null]: the first 3 channels guided."""
    n, null = noise.shape[0], torch.full_like(y, net.num_classes)
    t = torch.linspace(0, 1 - 0.04, num_steps)
    dt = float(t[1] - t[0])

    def drift(x, ti):
        out = net(torch.cat([x, x]), torch.full((2 * n,), ti), torch.cat([y, null]))
        cond, uncond = out[:n, :3], out[n:, :3]
        v = torch.cat([uncond + cfg * (cond - uncond), out[:n, 3:4]], 1)  # learn_sigma: velocity = first 4
        return v + (1 - ti) * (ti * v - x) / (1 - ti)

    x = noise.clone()
    with torch.no_grad():
        for ti in t[:-1].tolist():
            w = torch.stack([torch.randn(x.shape[1:], generator=g) for g in gens])
            x = x + drift(x, ti) * dt + math.sqrt(2 * (1 - ti)) * w * math.sqrt(dt)
        return x + drift(x, float(t[-1])) * 0.04


def test_sit(tmp_path, tiny_vae_dir, sd_vae):
    net = random_dit(61, learn_sigma=True, std=0.05)
    ckpt = own_checkpoint(tmp_path / "sit.pt", net)
    got, y, record = sample(tmp_path, "sit", ckpt, tiny_vae_dir)  # SiT's 250 steps
    noise, gens = noise_of(5, 3, (4, 4, 4))
    want = dit_pixels(decode(sd_vae, sit_release(net, noise, y, gens, num_steps=250, cfg=1.5)))
    same_pixels(got, want)
    assert record["fingerprint"]["protocol"] == "sit" and record["protocol"]["overrides"] == []


# ---- REPA ----------------------------------------------------------------------------------------------------------

def test_repa(tmp_path, tiny_vae_dir, sd_vae):
    net = random_dit(62, learn_sigma=False, std=0.05)
    ckpt = own_checkpoint(tmp_path / "repa.pt", net, convention="repa")
    got, y, record = sample(tmp_path, "repa", ckpt, tiny_vae_dir)  # REPA's 250
    noise, gens = noise_of(5, 3, (4, 4, 4))
    latents = repa_sampler(net, noise, y, gens, steps=250, cfg=1.8, low=0.0, high=0.7)  # samplers.py l.105-183
    images = decode(sd_vae, latents)
    # sihyun-yu/REPA generate.py l.151-154: (x + 1) / 2, clamp(255 x, 0, 255), truncated
    want = torch.clamp(255.0 * ((images + 1) / 2.0), 0, 255).permute(0, 2, 3, 1).to(torch.uint8).numpy().astype(int)
    same_pixels(got, want)
    assert np.abs(got - dit_pixels(images)).max() == 1  # DiT's conversion would be another file
    assert record["protocol"]["conversion"] == "repa" and record["fingerprint"]["cfg_channels"] == "all"


# ---- LightningDiT --------------------------------------------------------------------------------------------------

def lightningdit_release(net, noise, y, *, num_steps, cfg, start=0.125, a=0.3):
    """hustvl/LightningDiT: transport/integrators.py l.94-101 (t = linspace(0, 1, num_steps) float32, then
    a t / (1 + (a - 1) t)), torchdiffeq's fixed-grid Euler x += (t1 - t0) f(t0, x); inference.py l.205-218 (the
    doubled batch at every step, null 1000); models/lightningdit.py l.420-442 (the first 3 channels guided; the
    conditional half where t < cfg_interval_start)."""
    n, null = noise.shape[0], torch.full_like(y, net.num_classes)
    t = torch.linspace(0, 1, num_steps)
    t = torch.tensor([a * tn / (1 + (a - 1) * tn) for tn in t])
    x = noise.clone()
    with torch.no_grad():
        for t0, t1 in zip(t[:-1].tolist(), t[1:].tolist()):
            out = net(torch.cat([x, x]), torch.full((2 * n,), t0), torch.cat([y, null]))
            cond, uncond = out[:n, :3], out[n:, :3]
            half = cond if t0 < start else uncond + cfg * (cond - uncond)
            x = x + (t1 - t0) * torch.cat([half, out[:n, 3:]], 1)
    return x


def test_lightningdit(tmp_path, tiny_vae_dir, sd_vae):
    net = tiny("LightningDiT", seed=4)
    ckpt = own_checkpoint(tmp_path / "ldit.pt", net)
    got, y, record = sample(tmp_path, "lightningdit", ckpt, tiny_vae_dir)  # its 250 points
    noise, _ = noise_of(5, 3, (4, 8, 8))
    want = dit_pixels(decode(sd_vae, lightningdit_release(net, noise, y, num_steps=250, cfg=6.7)))
    same_pixels(got, want)
    assert record["fingerprint"]["cfg_channels"] == "3" and record["protocol"]["guidance"]["ends"] == "[]"


# ---- DDT -------------------------------------------------------------------------------------------------------------

def ddt_release(net, noise, y, *, num_steps, cfg, refresh=1, low=0.3, high=1.0, last_step=0.04, calls=None):
    """MCG-NJU/DDT src/diffusion/stateful_flow_matching/sampling.py: l.53-58 timesteps = cat(linspace(0, 1 -
    last_step, num_steps), [1]) (shift 1), l.72-102: the doubled [uncond; cond] batch at every step; the state reset
    where i % state_refresh_rate == 0, else the decoder runs on the state kept (the network returns (out, state));
    guidance_fn(out, cfg) where low < t < high, guidance_fn(out, 1.0) elsewhere (simple_guidance_fn,
    src/diffusion/base/guidance.py l.3-6: uncond + s (cond - uncond), every channel); x += v dt (ode_step_fn)."""
    n = noise.shape[0]
    steps = torch.cat([torch.linspace(0.0, 1 - last_step, num_steps), torch.tensor([1.0])])
    cond_y = torch.cat([torch.full_like(y, net.num_classes), y])
    x, state = noise.clone(), None
    with torch.no_grad():
        for i, (t_cur, t_next) in enumerate(zip(steps[:-1].tolist(), steps[1:].tolist())):
            cfg_x, cfg_t = torch.cat([x, x]), torch.full((2 * n,), t_cur)
            if i % refresh == 0:
                state = None
            if state is None:
                state = net.encode(cfg_x, cfg_t, cond_y)
                if calls is not None:
                    calls.append(i)
            out = net.decode(cfg_x, state)
            uncond, cond = out.chunk(2)
            s = cfg if low < t_cur < high else 1.0
            x = x + (uncond + s * (cond - uncond)) * (t_next - t_cur)
    return x


@pytest.mark.parametrize("refresh,steps", [(1, 250), (2, 10)])
def test_ddt(tmp_path, tiny_vae_dir, sd_vae, refresh, steps):
    net = tiny("DDT", seed=5)
    ckpt = own_checkpoint(tmp_path / "ddt.pt", net)
    got, y, record = sample(tmp_path, "ddt", ckpt, tiny_vae_dir, steps=steps, encoder_refresh=refresh)
    noise, _ = noise_of(5, 3, (4, 8, 8))
    images = decode(sd_vae, ddt_release(net, noise, y, num_steps=steps, cfg=2.0, refresh=refresh))
    # DDT src/models/vae.py l.78-80 fp2uint8: clip((x + 1) 127.5 + 0.5, 0, 255) truncated
    want = torch.clip((images + 1) * 127.5 + 0.5, 0, 255).permute(0, 2, 3, 1).to(torch.uint8).numpy().astype(int)
    same_pixels(got, want)
    assert record["label_sampling"] == "equal" and record["protocol"]["conversion"] == "ddt"


def test_ddts_encoder_sharing_keeps_the_doubled_batch_and_its_steps():
    """With K = 2 and DDT's interval (guidance switching on at t > 0.3): the encoder recomputes at i % 2 == 0,
    [0, 2, 4, 6, 8], as the release; before, the batch's change of shape recomputed it at [0, 2, 3, 5, 7, 9]."""
    from dit_pipeline.dit import protocols
    from dit_pipeline.sample.generate import protocol_loop, protocol_model_fn, sample_latents

    net = tiny("DDT", seed=5)
    p = protocols.protocol("ddt").with_overrides(count=10)
    reuse = dit.reuse.EncoderReuse(net, 2)
    fn = protocol_model_fn(p, reuse, objective="flow", doubled=True)
    y = torch.tensor([1, 3])
    got = sample_latents(reuse, protocol_loop(p, latent_shape=(4, 8, 8)), y, noise_generators(2, range(2)),
                         sampler="euler", model_fn=fn)
    calls: list[int] = []
    noise, _ = noise_of(2, 2, (4, 8, 8))
    want = ddt_release(net, noise, y, num_steps=10, cfg=2.0, refresh=2, calls=calls)
    assert reuse.steps == calls == [0, 2, 4, 6, 8]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    with pytest.raises(ValueError, match=r"encoder reuse: call 1 has a batch of shape \(2, 4, 8, 8\) but the encoder "
                                         r"state was computed on \(4, 4, 8, 8\)"):
        reuse.reset()
        reuse(torch.zeros(4, 4, 8, 8), torch.zeros(4), torch.zeros(4, dtype=torch.long))
        reuse(torch.zeros(2, 4, 8, 8), torch.zeros(2), torch.zeros(2, dtype=torch.long))


# ---- RAE and its AutoGuidance -------------------------------------------------------------------------------------

def rae_release(net, noise, y, *, num_steps=50, guide=None, scale=1.0):
    """bytetriper/RAE: transport.py l.136-137 (t0 = 0, t1 = 1 - 1/1000), integrators.py l.100-101 (t = 1 -
    linspace(t0, t1, num_steps), then s t / (1 + (s - 1) t), RAE's t = noise level; s = sqrt(C H W / 4096) of
    sample_ddp.py l.134-137), torchdiffeq's Euler x += (t_next - t) v(x, t) with the network's own velocity
    (noise - data); with AutoGuidance (sample_ddp.py l.255-272, DDT.py l.391-408) both networks on the doubled
    [x; x] with [y; null], v = v_weak + scale (v - v_weak) on every channel, the conditional half kept."""
    c, h, w = noise.shape[1:]
    s = math.sqrt(c * h * w / 4096)
    t = 1 - torch.linspace(0, 1 - 1 / 1000, num_steps)
    t = s * t / (1 + (s - 1) * t)
    n = noise.shape[0]
    doubled = guide is not None and scale > 1.0
    x = torch.cat([noise, noise]) if doubled else noise.clone()
    labels = torch.cat([y, torch.full_like(y, net.num_classes)]) if doubled else y
    with torch.no_grad():
        for t0, t1 in zip(t[:-1].tolist(), t[1:].tolist()):
            tt = torch.full((x.shape[0],), t0)
            v = net(x, tt, labels)
            if doubled:
                weak = guide(x, tt, labels)
                v = weak[:, :c] + scale * (v[:, :c] - weak[:, :c])
            x = x + (t1 - t0) * v
    return x[:n]


@pytest.fixture(scope="module")
def rae_decoder(tmp_path_factory):
    path = make_tiny_decoder(tmp_path_factory.mktemp("rae") / "model.pt", in_channels=8, grid=4)
    return path, load_vae(f"{path},{path.parent / 'config.json'}")[0]


def rae_pixels(decoder, latents):
    """RAE's decode gives [0, 1] images (x std + mean); src/sample_ddp.py l.276-277: clamp(0, 1).mul(255), uint8."""
    with torch.no_grad():
        unit = torch.cat([decoder.decode(z[None]).unit for z in latents])
    return unit.clamp(0, 1).mul(255).permute(0, 2, 3, 1).to(torch.uint8).numpy().astype(int)


def test_rae(tmp_path, rae_decoder):
    path, decoder = rae_decoder
    net = tiny("DiT-DH", seed=6)
    ckpt = own_checkpoint(tmp_path / "rae.pt", net, convention="repa", latent={"scaling_factor": 1.0,
                                                                                "shift_factor": None})
    got, y, record = sample(tmp_path, "rae", ckpt, f"{path},{path.parent / 'config.json'}", n=2)
    noise, _ = noise_of(5, 2, (8, 4, 4))
    want = rae_latents = rae_release(net, noise, y)
    same_pixels(got, rae_pixels(decoder, want))
    assert record["protocol"]["grid"]["resolved_shift"] == pytest.approx(math.sqrt(8 * 16 / 4096))
    # integrating on to t = 0 (our grid before this issue) is another sample
    from dit_pipeline.dit import protocols
    from dit_pipeline.sample.generate import protocol_loop, protocol_model_fn, sample_latents
    old = protocols.custom(solver="euler", steps=49, time_shift=math.sqrt(8 * 16 / 4096))
    to_zero = sample_latents(net, protocol_loop(old, latent_shape=(8, 4, 4), convention="repa"), y,
                             noise_generators(5, range(2)), sampler="euler",
                             model_fn=protocol_model_fn(old, net, objective="flow", convention="repa"))
    # (RAE's s for these tiny 8 x 4 x 4 latents is 0.18, so its last noise level 1.8e-4 is small: 4.2e-2 apart at
    # RAE's own shape, the issue measured; here well above float32 noise still)
    assert (to_zero - rae_latents).abs().max() > 1e-5 * rae_latents.abs().max()


def test_rae_autoguidance(tmp_path, rae_decoder, monkeypatch):
    path, decoder = rae_decoder
    net, weak = tiny("DiT-DH", seed=6), tiny("DiT-DH", seed=7, depth=1)
    latent = {"scaling_factor": 1.0, "shift_factor": None}
    ckpt = own_checkpoint(tmp_path / "rae.pt", net, convention="repa", latent=latent)
    guide = own_checkpoint(tmp_path / "rae-s.pt", weak, convention="repa", latent=latent)
    vae = f"{path},{path.parent / 'config.json'}"
    with pytest.raises(ConfigError, match=r"--protocol rae-ag guides with a second, weaker network \(DiT-DH-S in the "
                                          r"release\): pass it as --guidance-model FILE"):
        sample(tmp_path, "rae-ag", ckpt, vae, n=2)
    got, y, record = sample(tmp_path, "rae-ag", ckpt, vae, n=2, guidance_model=str(guide))
    noise, _ = noise_of(5, 2, (8, 4, 4))
    want = rae_release(net, noise, y, guide=weak, scale=1.42)
    same_pixels(got, rae_pixels(decoder, want))
    assert record["fingerprint"]["guidance_model_sha256"] and record["guidance_model"]["model_config"]["depth"] == 1
    unguided = rae_release(net, noise, y)
    assert (unguided - want).abs().max() > 1e-2  # the weaker network matters
    # without --protocol: AutoGuidance on the flags' own grid
    run_sampling(SampleConfig(ckpt=str(ckpt), vae=vae, guidance_model=str(guide), cfg_scale=1.42, sampler="euler",
                              steps=5, num_samples=2, quiet=True, npz=str(tmp_path / "custom.npz")))
    custom = json.loads((tmp_path / "custom.npz.json").read_text())["protocol"]
    assert (custom["name"], custom["guidance"]["rule"], custom["guidance"]["guide_model"]) == (
        "custom", "autoguidance", "rae-s.pt")
    # the cost: two network evaluations per step and sample (one of each network), no null-label pass
    from dit_pipeline.dit import protocols
    from dit_pipeline.sample.generate import protocol_model_fn
    seen: list[tuple[str, int]] = []
    for name, m in (("main", net), ("weak", weak)):
        forward = m.forward
        monkeypatch.setattr(m, "forward", lambda x, *a, _f=forward, _n=name, **k: seen.append((_n, x.shape[0]))
                            or _f(x, *a, **k))
    fn = protocol_model_fn(protocols.protocol("rae-ag"), net, objective="flow", convention="repa", guide_model=weak)
    fn(torch.zeros(2, 8, 4, 4), torch.full((2,), 0.5, dtype=torch.float64), torch.tensor([1, 2]))
    assert seen == [("main", 2), ("weak", 2)] and protocols.protocol("rae-ag").evaluations_per_step == 2


def test_guidance_model_must_match(tmp_path, rae_decoder):
    path, _ = rae_decoder
    latent = {"scaling_factor": 1.0, "shift_factor": None}
    ckpt = own_checkpoint(tmp_path / "rae.pt", tiny("DiT-DH", seed=6), convention="repa", latent=latent)
    other = own_checkpoint(tmp_path / "sit.pt", tiny("DiT-DH", seed=7, depth=1), latent=latent)  # SiT's time
    with pytest.raises(UserError, match=r"--guidance-model .*sit.pt: sit's time convention \(the model: repa's\); "
                                        r"AutoGuidance needs a weaker network of the same latents, classes and time"):
        sample(tmp_path, "rae-ag", ckpt, f"{path},{path.parent / 'config.json'}", n=2, guidance_model=str(other))
    assert not list(tmp_path.glob("*.npz"))


# ---- MeanFlow and iMF -----------------------------------------------------------------------------------------------

def meanflow_net(conditions, seed):
    torch.manual_seed(seed)
    m = create_model("DiT-S/2", input_size=8, depth=2, hidden_size=32, num_heads=2, in_channels=4, num_classes=5,
                     learn_sigma=False, conditions=conditions)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in m.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return m.eval()


def test_meanflow_samples_in_one_step_by_default(tmp_path, tiny_vae_dir, sd_vae):
    net = meanflow_net("meanflow", 8)
    ckpt = own_checkpoint(tmp_path / "mf.pt", net, objective="meanflow")
    # Gsunshine/meanflow meanflow.py l.111-124: z_0 = z_1 - (t - r) u(z_1, t, h = t - r) on [1.0, 0.0];
    # train.py l.165-166: 127.5 x + 128, clip, uint8
    noise, _ = noise_of(5, 3, (4, 8, 8))
    with torch.no_grad():
        want = lambda y: noise - 1.0 * net(noise, torch.stack([torch.ones(3), torch.ones(3)], 1), y)  # noqa: E731
    got, y, record = sample(tmp_path, "meanflow", ckpt, tiny_vae_dir)
    same_pixels(got, dit_pixels(decode(sd_vae, want(y))))
    # without --protocol and without --steps a one-step model takes one step (it took 250 before)
    npz = tmp_path / "plain.npz"
    run_sampling(SampleConfig(ckpt=str(ckpt), vae=str(tiny_vae_dir), num_samples=3, seed=5, batch_size=3,
                              quiet=True, npz=str(npz)))
    fp = json.loads((tmp_path / "plain.npz.json").read_text())["fingerprint"]
    assert (fp["sampler"], fp["steps"]) == ("meanflow", 1)
    with np.load(npz) as z:
        same_pixels(z["arr_0"].astype(int), dit_pixels(decode(sd_vae, want(torch.as_tensor(z["arr_1"])))))


@pytest.mark.parametrize("steps", [1, 2])
def test_imf(tmp_path, tiny_vae_dir, sd_vae, steps):
    net = meanflow_net("imf", 9)
    ckpt = own_checkpoint(tmp_path / "imf.pt", net, objective="imf")
    got, y, record = sample(tmp_path, "imf", ckpt, tiny_vae_dir, steps=steps)
    # Lyy-iiis/imeanflow imf.py l.42 t_steps = linspace(1, 0, num_steps + 1), l.90-114: u(z, t, t - r, omega, t_min,
    # t_max) with eval_config.yml's omega 8.0 and interval [0.4, 0.65], z -= (t - r) u; sample_util.py l.28-29
    t_steps = torch.linspace(1.0, 0.0, steps + 1)
    z, _ = noise_of(5, 3, (4, 8, 8))
    with torch.no_grad():
        for i in range(steps):
            t, r = torch.full((3,), float(t_steps[i])), torch.full((3,), float(t_steps[i + 1]))
            u = net(z, time_input("imf", t, r, torch.full((3,), 8.0), torch.full((3,), 0.4), torch.full((3,), 0.65)), y)
            z = z - (t - r).view(-1, 1, 1, 1) * u
    same_pixels(got, dit_pixels(decode(sd_vae, z)))
    assert record["label_sampling"] == "equal"  # imf.py l.36-39: (arange(n) + sample_idx n) % num_classes


# ---- NanoGen ---------------------------------------------------------------------------------------------------------

def nanogen_release(net, noise, y, *, num_steps=50, scale=1.6, t_max=0.9, shift=1.0, x_pred=False):
    """End2End-Diffusion/diffusion-bench: src/stage2/transport/sampler.py l.10-34 sample_ode (t_grid = linspace(1, 0,
    num_steps + 1) in float32, then shift t / (1 + (shift - 1) t), NanoGen's t = noise level; x = x - h drift at
    t_grid[i] as a float32 batch); transport.py l.105-111 convert_model_pred (velocity: the output; prediction 'x':
    (x_t - out) / t.clamp_min(0.05)) after src/utils/guidance_utils.py l.14-39 forward_with_cfg (the doubled [x; x]
    with [y; null = num_classes], uncond + s (cond - uncond) on in_channels where t_min <= t <= t_max, the
    conditional half elsewhere); configs/stage2.py use_cfg: scale > 1; src/eval/generation.py l.163-168 (the first
    half)."""
    n = noise.shape[0]
    grid = torch.linspace(1.0, 0.0, num_steps + 1)
    grid = shift * grid / (1 + (shift - 1) * grid)
    guided = scale > 1.0
    x = torch.cat([noise, noise]) if guided else noise.clone()
    context = torch.cat([y, torch.full_like(y, net.num_classes)]) if guided else y
    with torch.no_grad():
        for i in range(num_steps):
            h = grid[i] - grid[i + 1]
            tb = torch.full((x.shape[0],), grid[i].item())
            if guided:
                half = x[:n]
                out = net(torch.cat([half, half]), tb, context)
                cond, uncond = out[:n], out[n:]
                th = tb[:n]
                g = torch.where(((th >= 0.0) & (th <= t_max)).view(-1, 1, 1, 1), uncond + scale * (cond - uncond),
                                cond)
                out = torch.cat([g, g])
            else:
                out = net(x, tb, context)
            drift = (x - out) / tb.view(-1, 1, 1, 1).clamp_min(0.05) if x_pred else out
            x = x - h * drift
    return x[:n]


def nanogen_pixels(images):
    """src/stage1/vae.py l.239 ((x + 1) / 2).clamp(0, 1); src/eval/generation.py l.167-168 clamp(0, 1), mul(255),
    uint8."""
    return ((images + 1) / 2).clamp(0, 1).mul(255).permute(0, 2, 3, 1).to(torch.uint8).numpy().astype(int)


@pytest.mark.parametrize("name", ["nanogen", "nanogen-pixels"])
def test_nanogen(tmp_path, tiny_vae_dir, sd_vae, name):
    """NanoGen's in-context DiT-DH (its own network, called in its own time: the "repa" convention) with the
    velocity on latents (nanogen: the grid shifted by sqrt(C H W / 4096), here sqrt(64 / 4096)) and x-prediction on
    pixels (nanogen-pixels: unshifted, scale 2.6; the identity decoder, common/pixels.py)."""
    from dit_pipeline.common.pixels import pixel_identity
    from tests.dit.test_incontext import TINY as IC

    x_pred = name == "nanogen-pixels"
    channels = 3 if x_pred else 4
    torch.manual_seed(11)
    net = create_model("ddt-en28d1152hd72-dn2d2048hd128", **{**IC, "input_size": 4, "in_channels": channels})
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    net.eval()
    pixels = {"scaling_factor": 1.0, "shift_factor": None, "vae": pixel_identity(4)}
    ckpt = own_checkpoint(tmp_path / f"{name}.pt", net, convention="repa", latent=pixels if x_pred else None)
    if x_pred:
        saved = torch.load(ckpt, weights_only=False)
        torch.save({**saved, "prediction": {"kind": "x", "t_eps": 0.05}}, ckpt)
    got, y, record = sample(tmp_path, name, ckpt, "pixels" if x_pred else tiny_vae_dir, n=4)
    noise, _ = noise_of(5, 4, (channels, 4, 4))
    shift, scale = (1.0, 2.6) if x_pred else (math.sqrt(64 / 4096), 1.6)
    want = nanogen_release(net, noise, y, shift=shift, scale=scale, x_pred=x_pred)
    images = want if x_pred else decode(sd_vae, want)
    same_pixels(got, nanogen_pixels(images))
    assert record["protocol"]["grid"]["resolved_shift"] == pytest.approx(shift)
    assert record["label_sampling"] == "equal" and record["protocol"]["conversion"] == "nanogen"
    # DiT's conversion (dit-sample's flags) rounds where NanoGen truncates: other pixels from the same latents
    assert not np.array_equal(dit_pixels(images), nanogen_pixels(images))


# ---- DiT, and the refusals ------------------------------------------------------------------------------------------

def test_dit_is_the_reference_ddpm_path(tmp_path, tiny_vae_dir):
    """DiT's protocol is DDPM on create_diffusion("250") (sample_ddp.py l.78), guidance 1.5 on the first 3 channels
    of the doubled batch (models.py l.250-265): the sampler tests/dit/test_diffusion.py checks against the reference.
    Its respacing: one section of 250 of the 1000 steps at round(i 999 / 249) (diffusion/respace.py)."""
    net = random_dit(64, learn_sigma=True)
    ckpt = own_checkpoint(tmp_path / "dit.pt", net, objective="ddpm")
    got, _, record = sample(tmp_path, "dit", ckpt, tiny_vae_dir, steps=25)
    npz = tmp_path / "flags.npz"
    run_sampling(SampleConfig(ckpt=str(ckpt), vae=str(tiny_vae_dir), num_samples=3, seed=5, batch_size=3, quiet=True,
                              npz=str(npz), sampler="ddpm", steps=25, cfg_scale=1.5, cfg_channels="3"))
    with np.load(npz) as z:
        assert np.array_equal(z["arr_0"].astype(int), got)
    stride = 999 / 249
    taken, cur = [], 0.0
    for _ in range(250):
        taken.append(round(cur))
        cur += stride
    assert sorted(dit.create_diffusion("250").timestep_map) == taken


def test_protocol_refusals(tmp_path, tiny_vae_dir):
    base = dict(ckpt="x.pt", num_samples=2, npz=str(tmp_path / "x.npz"))
    with pytest.raises(ConfigError, match=r"--sampler heun: --protocol rae sets these \(bytetriper/"
                                          r"RAE's euler sampler; docs/sampling.md\); drop them, or drop "
                                          r"--protocol to choose every setting"):
        SampleConfig(**base, protocol="rae", sampler="heun", time_shift=2.0).validate()  # --time-shift: an override
    with pytest.raises(ConfigError, match=r"--time-shift shifts the flow samplers' time grid \(euler, heun, "
                                          r"euler-maruyama\), not --protocol dit's ddpm; drop --time-shift"):
        SampleConfig(**base, protocol="dit", time_shift=2.0).validate()
    with pytest.raises(ConfigError, match=r"--protocol must be one of dit, sit, repa, .*, got 'adm'"):
        SampleConfig(**base, protocol="adm").validate()
    with pytest.raises(ConfigError, match=r"--guidance-model: --protocol ddt does not use AutoGuidance \(rae-ag does\)"):
        SampleConfig(**base, protocol="ddt", guidance_model="s.pt").validate()
    SampleConfig(**base, protocol="lightningdit", cfg_channels="3", sampler="euler", steps=10, cfg_scale=10.0).validate()
    net = random_dit(65, learn_sigma=True)
    ckpt = own_checkpoint(tmp_path / "ddpm.pt", net, objective="ddpm")
    with pytest.raises(UserError, match=r"--protocol ddt applies to class-conditional flow models on latents; this "
                                        r"is a class-conditional ddpm model on 4x4x4 latents \(objective ddpm \(the "
                                        r"protocol's: flow\)\). Protocols that fit it: dit; or drop --protocol"):
        run_sampling(SampleConfig(ckpt=str(ckpt), vae=str(tiny_vae_dir), protocol="ddt", num_samples=2, quiet=True,
                                  npz=str(tmp_path / "y.npz")))
    assert not (tmp_path / "y.npz").exists()
