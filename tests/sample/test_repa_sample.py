"""REPA's checkpoints in dit-sample: the release format (a bare SiT state_dict with projector keys, `last.pt`) and
REPA's train.py checkpoints load unchanged, projector keys dropped, in REPA's time convention; with docs/repa.md's
REPA flags our samplers equal REPA's samplers written out here from their formulas (time running from 1 = noise
to 0, velocity noise - data, Euler-Maruyama with diffusion 2t and the score from the velocity, CFG on the drift of
every channel only where REPA's t <= 0.7, a noise-free last step); the guidance interval for DDPM against a
formula-level guided model; and SiT's SDE step count (num_steps grid points) against SiT's sampler written out."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from dit_pipeline import dit
from dit_pipeline.common.errors import UserError
from dit_pipeline.common.vae import load_vae
from dit_pipeline.sample import SampleConfig
from dit_pipeline.sample.config import ExportConfig
from dit_pipeline.sample.export import export
from dit_pipeline.sample.generate import (decode_latents, guided_model_fn, make_diffusion, noise_level_fn,
                                          sample_latents)
from dit_pipeline.sample.load import load_model, resolve_flow_convention
from dit_pipeline.sample.plan import noise_generators
from tests._util import FP32_EPS, assert_close_at_scale, run_cli
from tests.sample.conftest import our_checkpoint, random_dit

NAME, LATENT_SIZE = "DiT-S/4", 8  # a preset (bare files carry no head count), 2x2 tokens


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """DiT-S runs here at full size: one intra-op thread is several times faster on the shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def projector_keys(seed: int, hidden: int, z_dim: int = 768, width: int = 64) -> dict[str, torch.Tensor]:
    """REPA's `projectors.0.*` (Linear - SiLU - Linear - SiLU - Linear; REPA's width is 2048, here 64)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"0": (width, hidden), "2": (width, width), "4": (z_dim, width)}
    out = {}
    for j, (o, i) in shapes.items():
        out[f"projectors.0.{j}.weight"] = torch.randn(o, i, generator=g) * 0.05
        out[f"projectors.0.{j}.bias"] = torch.zeros(o)
    return out


@pytest.fixture(scope="module")
def repa_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("repa")
    model = random_dit(21, name=NAME, input_size=LATENT_SIZE, std=0.05, tiny=False, learn_sigma=False)
    sd = {**model.state_dict(), **projector_keys(0, model.hidden_size)}
    files = {"release": root / "last.pt", "train": root / "0400000.pt", "cosine": root / "cosine.pt",
             "ours": root / "ours-repa.pt", "stripped": root / "stripped.pt"}
    torch.save(sd, files["release"])
    args = argparse.Namespace(model="SiT-S/4", num_classes=10, enc_type="dinov2-vit-b", proj_coeff=0.5,
                              encoder_depth=8, path_type="linear", prediction="v", resolution=64)
    torch.save({"model": sd, "ema": sd, "opt": {}, "args": args, "steps": 400000}, files["train"])
    cosine = argparse.Namespace(**{**vars(args), "path_type": "cosine"})
    torch.save({"model": sd, "ema": sd, "opt": {}, "args": cosine, "steps": 1}, files["cosine"])
    ours = random_dit(22, learn_sigma=False)  # a REPA run of our trainer: SiT's time, projectors in the weights
    ours_sd = {**ours.state_dict(), **projector_keys(1, ours.hidden_size)}
    torch.save({**our_checkpoint(ours, ours), "model": ours_sd, "ema": ours_sd, "objective": "flow"}, files["ours"])
    torch.save(model.state_dict(), files["stripped"])
    return files


def test_repa_files_load_without_projectors_in_repas_time(repa_files):
    for kind in ("release", "train"):
        sd, info = dit.load_dit_weights(repa_files[kind])
        assert not any(k.startswith("projectors.") for k in sd)
        assert info["objective"] == "flow" and info["flow_convention"] == "repa"
        assert info["model_config"]["learn_sigma"] is False and info["model_config"]["model"] == NAME
        assert info["repa"]["z_dims"] == [768] and info["repa"]["projectors"] == 1
        assert resolve_flow_convention(info, repa_files[kind], None) == "repa"
        assert resolve_flow_convention(info, repa_files[kind], "sit") == "sit"  # an explicit override
    assert dit.load_dit_weights(repa_files["release"])[1]["flow_convention_from"] == "REPA's projector keys"
    assert dit.load_dit_weights(repa_files["train"])[1]["repa"]["enc_type"] == "dinov2-vit-b"
    sd, info = dit.load_dit_weights(repa_files["ours"])  # ours records its objective: SiT's time
    assert (info["flow_convention"], info["flow_convention_from"]) == ("sit", "recorded")
    assert not any(k.startswith("projectors.") for k in sd)
    with pytest.raises(UserError, match=r"--flow-convention repa, but .*ours-repa.pt records a flow model in sit's "
                                        r"time; drop --flow-convention"):
        resolve_flow_convention(info, repa_files["ours"], "repa")
    _, info = dit.load_dit_weights(repa_files["stripped"])  # no projectors, no record: SiT's unless told
    assert (info["flow_convention"], info["flow_convention_from"]) == ("sit", "default")
    assert resolve_flow_convention(info, repa_files["stripped"], "repa") == "repa"
    with pytest.raises(dit.WeightsError, match=r"REPA trained with path_type='cosine', prediction='v'; only its "
                                               r"linear path with velocity prediction is supported"):
        dit.load_dit_weights(repa_files["cosine"])


def test_repas_layernorm_qk_norm_is_refused(repa_files, tmp_path):
    sd = torch.load(repa_files["release"], weights_only=True)
    for b in range(12):  # REPA's --qk-norm: timm's LayerNorm (weight and bias) on q and k
        for name in ("q_norm", "k_norm"):
            sd[f"blocks.{b}.attn.{name}.weight"], sd[f"blocks.{b}.attn.{name}.bias"] = torch.ones(64), torch.zeros(64)
    torch.save(sd, tmp_path / "qk.pt")
    with pytest.raises(dit.WeightsError, match=r"qk.pt: REPA's --qk-norm \(a LayerNorm with bias per head\) is not "
                                               r"this project's qk_norm \(RMSNorm\)"):
        dit.load_dit_weights(tmp_path / "qk.pt")


# ---- REPA's sampler, written out ----------------------------------------------------------------------------

def repa_sampler(model, noise, y, gens, *, steps, cfg, low, high, sde=True):
    """REPA's generate.py samplers from their formulas, state in float64, REPA's time t (1 = noise):
    SDE: grid linspace(1, 0.04, steps) then 0; each step but the last: v = net(x, t); score
    s = -((1 - t) v + x) / t; drift d = v - (1/2) (2t) s; CFG on d where low <= t <= high; x += d dt +
    sqrt(2t) sqrt(|dt|) eps; the last step (0.04 -> 0) without noise. ODE: grid linspace(1, 0, steps + 1),
    x += (t_next - t) v (CFG on v). Noise eps from the per-sample generators, in our draw order."""
    null = torch.full_like(y, model.num_classes)
    grid = (torch.cat([torch.linspace(1.0, 0.04, steps, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)])
            if sde else torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64))
    x = noise.double()

    def drift(x, t):
        guided = cfg > 1 and low <= t <= high
        inp, lab = (torch.cat([x, x]), torch.cat([y, null])) if guided else (x, y)
        v = model(inp.float(), torch.full((inp.shape[0],), t, dtype=torch.float32), lab).double()
        d = v - 0.5 * (2 * t) * (-((1 - t) * v + inp) / t) if sde else v
        if guided:
            cond, uncond = d.chunk(2)
            d = uncond + cfg * (cond - uncond)
        return d

    for i, (t, t_next) in enumerate(zip(grid[:-1].tolist(), grid[1:].tolist())):
        dt = t_next - t
        last = sde and i == len(grid) - 2
        eps = None if (last or not sde) else torch.stack([torch.randn(x.shape[1:], generator=g) for g in gens])
        x = x + drift(x, t) * dt
        if eps is not None:
            x = x + (2 * t) ** 0.5 * abs(dt) ** 0.5 * eps.double()
    return x.float()


def ours(loaded, y, seed, *, sampler, steps, cfg, interval):
    convention = loaded.info["flow_convention"]
    fn = guided_model_fn(loaded.model, cfg_scale=cfg, cfg_channels="all", guidance_interval=interval,
                         noise_level=noise_level_fn("flow", convention))
    loop = make_diffusion(sampler, steps, learn_sigma=False, convention=convention)
    return sample_latents(loaded.model, loop, y, noise_generators(seed, range(len(y))), sampler=sampler, model_fn=fn)


@pytest.mark.parametrize("sampler,steps,high", [("euler-maruyama", 12, 0.7), ("euler-maruyama", 9, 1.0),
                                                ("euler", 10, 0.7)])
def test_our_sampler_on_a_repa_file_is_repas_sampler(repa_files, sampler, steps, high):
    loaded = load_model(repa_files["release"])
    y = torch.tensor([3, 1, 4, 1])
    got = ours(loaded, y, 7, sampler=sampler, steps=steps, cfg=1.8, interval=[0.0, high])
    gens = noise_generators(7, range(4))
    noise = torch.stack([torch.randn(4, LATENT_SIZE, LATENT_SIZE, generator=g) for g in gens])
    want = repa_sampler(loaded.model, noise, y, gens, steps=steps, cfg=1.8, low=0.0, high=high,
                        sde=sampler == "euler-maruyama")
    assert want.abs().max() > 0.5
    assert_close_at_scale(got, want, rel=64 * FP32_EPS)  # float32 network, float64 reference
    if high < 1.0:  # the interval matters: guidance everywhere is another result
        everywhere = ours(loaded, y, 7, sampler=sampler, steps=steps, cfg=1.8, interval=None)
        assert (everywhere - got).abs().max() > 1e-2


def test_guidance_interval_skips_the_unconditional_pass(repa_files, monkeypatch):
    loaded = load_model(repa_files["release"])
    sizes, forward = [], loaded.model.forward

    def counting(x, *args, **kwargs):  # forward_with_cfg calls self.forward, so this sees every pass
        sizes.append(x.shape[0])
        return forward(x, *args, **kwargs)

    monkeypatch.setattr(loaded.model, "forward", counting)
    ours(loaded, torch.tensor([1, 2]), 0, sampler="euler-maruyama", steps=12, cfg=1.8, interval=[0.0, 0.7])
    # REPA's grid: t = 1 - 0.96 i / 11 for i = 0..11: t <= 0.7 from i = 4 on (0.651), 8 of the 12 evaluations
    assert sizes == [2] * 4 + [4] * 8


def readme_repa_command() -> list[str]:
    """The dit-sample arguments of docs/repa.md's sampling block (after `$(which dit-sample)`)."""
    import shlex

    from tests._docs import block_after

    block = block_after("docs/repa.md", "## REPA's checkpoints and sampler").replace("\\\n", " ")
    words = shlex.split(block)
    return words[words.index("$(which") + 2:] if "$(which" in words else words[words.index("dit-sample") + 1:]


def test_dit_sample_with_the_readme_repa_flags(repa_files, tiny_vae_dir, tmp_path):
    """docs/repa.md's REPA sampling command as pasted, with a tiny file, VAE and sample count: it records REPA's time and
    the interval, and its pixels are the decoded latents of REPA's sampler written out above."""
    args = readme_repa_command()
    assert args[args.index("--steps") + 1] == "250" and args[args.index("--guidance-interval") + 1:][:2] == ["0", "0.7"]
    swap = {"--ckpt": repa_files["release"], "--vae": tiny_vae_dir, "--steps": 8, "--num-samples": 3,
            "--npz": tmp_path / "r.npz"}
    for flag, value in swap.items():
        args[args.index(flag) + 1] = str(value)
    res = run_cli("dit-sample", [*args, "--seed", "5", "--batch-size", "3", "--quiet"])
    assert res.returncode == 0, res.stderr[-2000:]
    fp = json.loads((tmp_path / "r.npz.json").read_text())["fingerprint"]
    assert (fp["flow_convention"], fp["guidance_interval"], fp["sde_steps"]) == ("repa", [0.0, 0.7], "sit-num-steps")
    assert (fp["diffusion_form"], fp["diffusion_norm"], fp["last_step_size"], fp["cfg_channels"], fp["cfg_scale"]) \
        == ("sigma", 1.0, 0.04, "all", 1.8)
    loaded = load_model(repa_files["release"])
    with np.load(tmp_path / "r.npz") as z:
        got, y = z["arr_0"].astype(int), torch.as_tensor(z["arr_1"])  # the classes the run drew
    gens = noise_generators(5, range(3))
    noise = torch.stack([torch.randn(4, LATENT_SIZE, LATENT_SIZE, generator=g) for g in gens])
    latents = repa_sampler(loaded.model, noise, y, gens, steps=8, cfg=1.8, low=0.0, high=0.7)
    vae, _ = load_vae(str(tiny_vae_dir))
    want = decode_latents(vae, latents, scaling_factor=0.5).numpy().astype(int)
    assert np.abs(got - want).max() <= 1 and (got == want).mean() > 0.99


def test_safetensors_export_keeps_repas_time(repa_files, tmp_path):
    out = export(ExportConfig(to="safetensors", output=str(tmp_path / "repa.safetensors"), ckpt=str(repa_files["release"])))
    sd, info = dit.load_dit_weights(out)
    assert (info["objective"], info["flow_convention"], info["flow_convention_from"]) == ("flow", "repa", "recorded")
    assert not any(k.startswith("projectors.") for k in sd)
    plain = export(ExportConfig(to="safetensors", output=str(tmp_path / "sit.safetensors"), ckpt=str(repa_files["ours"])))
    assert dit.load_dit_weights(plain)[1]["flow_convention"] == "sit"


def test_guidance_interval_is_validated():
    base = dict(ckpt="x.pt", num_samples=1, npz="x.npz")
    with pytest.raises(Exception, match=r"--guidance-interval takes LOW HIGH with 0 <= LOW <= HIGH <= 1 \(noise "
                                        r"levels\), got \[0.8, 0.2\]"):
        SampleConfig(**base, guidance_interval=[0.8, 0.2]).validate()
    with pytest.raises(Exception, match=r"--guidance-interval 0.0 0.7 limits classifier-free guidance, but "
                                        r"--cfg-scale is 1.0"):
        SampleConfig(**base, guidance_interval=[0.0, 0.7], cfg_scale=1.0).validate()
    with pytest.raises(Exception, match=r"--flow-convention applies to flow models"):
        SampleConfig(**base, sampler="ddpm", flow_convention="repa").validate()
    with pytest.raises(Exception, match=r"--steps 1: the SDE counts the points of SiT's time grid"):
        SampleConfig(**base, sampler="euler-maruyama", steps=1).validate()


# ---- DDPM with a guidance interval, against a formula-level guided model ---------------------------------------

def test_ddpm_guidance_interval_is_the_formula():
    model = random_dit(31)
    low, high, scale = 0.2, 0.6, 3.0

    def formula(x, t, y):  # timestep index / 1000 in [low, high]: eps of the first 3 channels guided
        cond = model(x, t, y)
        if not low <= int(t[0]) / 1000 <= high:
            return cond
        uncond = model(x, t, torch.full_like(y, model.num_classes))
        return torch.cat([uncond[:, :3] + scale * (cond[:, :3] - uncond[:, :3]), cond[:, 3:]], dim=1)

    y = torch.tensor([1, 5, 9])
    diffusion = make_diffusion("ddpm", 25)
    fn = guided_model_fn(model, cfg_scale=scale, guidance_interval=[low, high], noise_level=noise_level_fn("ddpm"))
    got = sample_latents(model, diffusion, y, noise_generators(3, range(3)), sampler="ddpm", model_fn=fn)
    want = sample_latents(model, diffusion, y, noise_generators(3, range(3)), sampler="ddpm", model_fn=formula)
    # latents of magnitude ~10^3 here: another CPU's float32 rounding is ~4e-7 of that (issue #34); a guidance
    # interval one DDPM step off changes them by >= 3e-4 of it
    assert_close_at_scale(got, want, rel=64 * FP32_EPS)
    everywhere = sample_latents(model, diffusion, y, noise_generators(3, range(3)), sampler="ddpm",
                                model_fn=guided_model_fn(model, cfg_scale=scale))
    assert (everywhere - got).abs().max() > 1e-2


# ---- SiT's step count ------------------------------------------------------------------------------------------

def sit_sde(model_fn, noise, y, gens, *, num_steps, last_step_size=0.04):
    """SiT's sample_sde (transport/integrators.py) from its formulas: t = linspace(0, 1 - last_step_size, num_steps)
    in float32 with the constant dt = t[1] - t[0]; Euler-Maruyama at t[0..num_steps-2] with drift v + D s,
    D = 1 - t (sigma form), s = (t v - x) / (1 - t), noise sqrt(2 D) sqrt(dt) w; then x + drift(t1) *
    last_step_size. num_steps network evaluations."""
    t = torch.linspace(0.0, 1.0 - last_step_size, num_steps)
    dt = float(t[1] - t[0])
    x = noise.clone()

    def drift(x, ti):
        v = model_fn(x, torch.full((x.shape[0],), ti), y)[:, :4]
        return v + (1 - ti) * (ti * v - x) / (1 - ti)

    for ti in t[:-1].tolist():
        w = torch.stack([torch.randn(x.shape[1:], generator=g) for g in gens])
        x = x + drift(x, ti) * dt + (2 * (1 - ti)) ** 0.5 * w * dt ** 0.5
    return x + drift(x, float(t[-1])) * last_step_size


def test_sde_steps_count_sits_num_steps():
    model = random_dit(41, learn_sigma=True)  # SiT's release keeps the 2C output; the velocity is the first C
    y = torch.tensor([2, 7])
    calls = []
    base = guided_model_fn(model, cfg_scale=1.5)

    def fn(x, t, y):
        calls.append(float(t[0]))
        return base(x, t, y)

    got = sample_latents(model, make_diffusion("euler-maruyama", 10), y, noise_generators(1, [0, 1]),
                         sampler="euler-maruyama", model_fn=fn)
    assert len(calls) == 10  # SiT's num_steps = 10: 9 SDE steps and the last step
    gens = noise_generators(1, [0, 1])
    noise = torch.stack([torch.randn(4, 4, 4, generator=g) for g in gens])
    want = sit_sde(base, noise, y, gens, num_steps=10)
    assert_close_at_scale(got, want, rel=64 * FP32_EPS)
    one_more = sample_latents(model, make_diffusion("euler-maruyama", 11), y, noise_generators(1, [0, 1]),
                              sampler="euler-maruyama", model_fn=base)
    assert (one_more - want).abs().max() > 1e-2  # the old count (one step more) is another sampler
