"""The protocol table (dit/protocols.py; the releases' rows: dit/release_protocols.py) against each release's
sampling code, transcribed here independently of ours in the release's own time and words (file and line named at
each rule): the time grids in float64 to 1e-12, the guidance intervals' open and closed ends, the image conversions
(dit/image_conversions.py), the AutoGuidance rule. The sampler-level reproductions (the same network and noise
through dit-sample --protocol) are tests/sample/test_protocols_sample.py.
"""
from __future__ import annotations

import math

import pytest
import torch

from dit_pipeline.dit import image_conversions, protocol_types, protocols
from dit_pipeline.dit.protocol_types import Guidance
from dit_pipeline.dit.protocols import PROTOCOLS

RAE_LATENT = (768, 16, 16)  # DINOv2-B features at 256 px: RAE's misc.latent_size
SD_LATENT = (4, 32, 32)


def close(ours: list[float], theirs: torch.Tensor | list[float], what: str) -> None:
    theirs = torch.as_tensor(theirs, dtype=torch.float64)
    assert len(ours) == len(theirs), f"{what}: {len(ours)} times vs the release's {len(theirs)}"
    assert (torch.tensor(ours, dtype=torch.float64) - theirs).abs().max() < 1e-12, what


# ---- time grids (SiT's time t: 0 = noise, 1 = data; a release with t = noise level is converted by 1 - t) ------

def test_raes_grid_stops_at_t_0_001_then_shifted():
    # bytetriper/RAE src/stage2/transport/transport.py l.136-137 check_interval: t0 = 0, t1 = 1 - 1/1000 (an ODE of
    # a velocity model keeps them); integrators.py l.100-101: t = 1 - linspace(t0, t1, num_steps), then
    # t = s t / (1 + (s - 1) t) in RAE's time (t = noise level); sample_ddp.py l.134-137: s = sqrt(768 16 16 / 4096)
    s = math.sqrt(768 * 16 * 16 / 4096)
    t = 1 - torch.linspace(0, 1 - 1 / 1000, 50, dtype=torch.float64)
    t = s * t / (1 + (s - 1) * t)
    for name in ("rae", "rae-ag"):
        close(PROTOCOLS[name].times(RAE_LATENT), 1 - t, name)
    assert 0.0068 < float(t[-1]) < 0.0070  # the last noise level: about 0.0069, not data
    # the grid before this issue (shift, then stretched onto [0, 1]: dit/shift.shifted_grid) integrates to data
    from dit_pipeline.dit.shift import shifted_grid
    assert shifted_grid(0.0, 1.0, 49, s)[-1] == 1.0 and abs(1 - float(t[-1]) - 1.0) > 6e-3


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_ddts_grid_ends_with_its_last_step(shift):
    # MCG-NJU/DDT src/diffusion/stateful_flow_matching/sampling.py l.10-11 shift_respace_fn t / (t + (1 - t) shift),
    # l.53-58: timesteps = cat(linspace(0, 1 - last_step, num_steps), [1.0]), shifted; the config's last_step 0.04,
    # num_steps 250, timeshift 1.0 (configs/repa_improved_ddt_xlen22de6_256.yaml l.71-80): 250 steps, the last 0.04
    t = torch.cat([torch.linspace(0.0, 1 - 0.04, 250, dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64)])
    t = t / (t + (1 - t) * shift)
    p = PROTOCOLS["ddt"]
    if shift != 1.0:
        import dataclasses
        p = dataclasses.replace(p, grid=dataclasses.replace(p.grid, shift=shift))
    close(p.times(SD_LATENT), t, f"ddt shift {shift}")
    if shift == 1.0:
        assert p.times(SD_LATENT)[-1] - p.times(SD_LATENT)[-2] == pytest.approx(0.04)  # not uniform: 0.96/249 else


@pytest.mark.parametrize("latent", [SD_LATENT, RAE_LATENT, (3, 256, 256)])
def test_nanogens_grids(latent):
    # End2End-Diffusion/diffusion-bench src/stage2/transport/sampler.py l.11-13: t = linspace(1, 0, num_steps + 1),
    # then s t / (1 + (s - 1) t), NanoGen's t = noise level; src/offline_eval.py l.119-124: s = sqrt(dim / base_eval),
    # dim = prod(latent_size), base_eval the training base 4096 unless the config sets it (the pixel configs: 196608,
    # the dim itself, so s = 1)
    for name, s in (("nanogen", math.sqrt(math.prod(latent) / 4096)), ("nanogen-pixels", 1.0),
                    ("nanogen-t2i", math.sqrt(math.prod(latent) / 4096)), ("nanogen-t2i-pixels", 1.0)):
        t = torch.linspace(1.0, 0.0, 51, dtype=torch.float64)
        t = s * t / (1 + (s - 1) * t)
        close(PROTOCOLS[name].times(latent), 1 - t, f"{name} {latent}")
    assert PROTOCOLS["nanogen"].grid.resolve_shift(SD_LATENT, None) == 1.0  # SD-VAE: 4096 / 4096


def test_lightningdits_grid():
    # hustvl/LightningDiT transport/transport.py l.95-96 (an ODE: t0 = 0, t1 = 1); transport/integrators.py l.94-101:
    # linspace(t0, t1, num_steps), then a t / (1 + (a - 1) t) with a = timestep_shift 0.3 (800ep config), in SiT's t
    a = 0.3
    t = torch.linspace(0, 1, 250, dtype=torch.float64)
    close(PROTOCOLS["lightningdit"].times((32, 16, 16)), a * t / (1 + (a - 1) * t), "lightningdit")


def test_sits_and_repas_sde_grids():
    # willisma/SiT transport/transport.py l.89-95 (SDE, sigma form: t0 = 0, t1 = 1 - last_step_size 0.04),
    # transport/integrators.py l.23 linspace(t0, t1, num_steps): SiT's t; then the Mean last step to 1
    sit = torch.cat([torch.linspace(0, 1 - 0.04, 250, dtype=torch.float64), torch.ones(1, dtype=torch.float64)])
    close(PROTOCOLS["sit"].times(SD_LATENT), sit, "sit")
    # sihyun-yu/REPA samplers.py l.122-123: t = cat(linspace(1, 0.04, num_steps), [0]) in REPA's t (noise level)
    repa = torch.cat([torch.linspace(1.0, 0.04, 250, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)])
    close(PROTOCOLS["repa"].times(SD_LATENT), 1 - repa, "repa")
    # REPA's Euler ODE (samplers.py l.61: linspace(1, 0, num_steps + 1)) is the uniform grid of the custom protocol
    close(protocols.custom(solver="euler", steps=50).times(SD_LATENT),
          1 - torch.linspace(1, 0, 51, dtype=torch.float64), "repa ode")


@pytest.mark.parametrize("steps", [1, 2])
def test_the_mean_flow_grids(steps):
    # Gsunshine/meanflow meanflow.py l.121-124 _default_schedule: [1.0, 0.0] (one step); Lyy-iiis/imeanflow imf.py
    # l.42: t_steps = linspace(1, 0, num_steps + 1); both with t = 1 noise
    imf = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    p = PROTOCOLS["imf"].with_overrides(count=steps)
    close(p.times(SD_LATENT), 1 - imf, f"imf {steps}")
    if steps == 1:
        close(PROTOCOLS["meanflow"].times(SD_LATENT), 1 - torch.tensor([1.0, 0.0], dtype=torch.float64), "meanflow")
    assert PROTOCOLS["meanflow"].count == PROTOCOLS["imf"].count == 1  # configs/default.py: sampling.num_steps 1


# ---- the guidance intervals' ends --------------------------------------------------------------------------------

def release_rules():
    """Each release's test for 'guide here', in its own time variable (SiT's t for DDT and LightningDiT, the noise
    level for REPA and RAE), as a function of SiT's t."""
    return {
        # DDT sampling.py l.93: t_cur > guidance_interval_min and t_cur < guidance_interval_max, (0.3, 1.0), SiT's t
        "ddt": lambda t: 0.3 < t < 1.0,
        # LightningDiT models/lightningdit.py l.436-439: the conditional half where t < cfg_interval_start (0.125)
        "lightningdit": lambda t: not t < 0.125,
        # REPA samplers.py l.131: t_cur <= guidance_high and t_cur >= guidance_low, REPA's t = 1 - SiT's
        "repa": lambda t: 0.0 <= 1 - t <= 0.7,
        # RAE DDT.py l.402-405: (t >= guid_t_min) & (t <= guid_t_max), RAE's t = noise level, t-min 0, t-max 1
        "rae-ag": lambda t: 0.0 <= 1 - t <= 1.0,
        # RAE DDT.py l.383-387 forward_with_cfg: the same test; DiTDHXL-DINOv2-B.yaml: t-min 0.0, t-max 1.0
        "rae": lambda t: 0.0 <= 1 - t <= 1.0,
        # NanoGen guidance_utils.py l.31-34: (t >= guid_t_min) & (t <= guid_t_max), NanoGen's t = noise level, the
        # sampling config's t_min 0.0, t_max 0.9
        "nanogen": lambda t: 0.0 <= 1 - t <= 0.9,
        "nanogen-pixels": lambda t: 0.0 <= 1 - t <= 0.9,
    }


@pytest.mark.parametrize("name", ["ddt", "lightningdit", "repa", "rae-ag", "rae", "nanogen", "nanogen-pixels"])
def test_interval_ends_are_each_releases(name):
    rule, g = release_rules()[name], PROTOCOLS[name].guidance
    # the ends themselves (computed as a grid computes them, 1 - t in float64) and points around them
    ends = [0.3, 0.125, 0.3 + 1e-6, 0.3 - 1e-6, 0.125 - 1e-6, 0.0, 1.0, 0.5, 0.96, 1e-6]
    for t in ends + torch.linspace(0, 1, 101, dtype=torch.float64).tolist():
        assert g.applies(1.0 - t) == rule(t), f"{name} at t = {t}"


def test_open_ends_are_not_closed_ones():
    closed, opened = Guidance("cfg", 2.0, (0.0, 0.7), "[]"), Guidance("cfg", 2.0, (0.0, 0.7), "()")
    level = 1.0 - 0.3  # DDT's t = 0.3 exactly: 0.7000000000000001 or 0.7 in float64, either way on the end
    assert closed.applies(level) and not opened.applies(level)
    assert closed.applies(0.0) and not opened.applies(0.0) and opened.applies(0.35)
    assert Guidance("cfg", 2.0, (0.2, 0.7), "[)").applies(0.2) and not Guidance("cfg", 2.0, (0.2, 0.7), "(]").applies(0.2)


# ---- image conversions ----------------------------------------------------------------------------------------

def images(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(2, 3, 16, 16, generator=g, dtype=torch.float32) * 2.4 - 1.2  # beyond [-1, 1] too
    x[0, 0, 0, :8] = torch.tensor([-1.0, 1.0, 0.0, -1 / 255, 1 / 255, 0.5, -0.5, 127 / 127.5 - 1])
    return x


def test_the_image_conversions_are_the_releases():
    x = images()
    hwc = lambda t: t.permute(0, 2, 3, 1)  # noqa: E731 (every release permutes to [B, H, W, 3] before the cast)
    # facebookresearch/DiT sample_ddp.py l.132; willisma/SiT sample_ddp.py l.178; LightningDiT vavae.py l.81
    dit = hwc(torch.clamp(127.5 * x + 128.0, 0, 255)).to(torch.uint8)
    # MCG-NJU/DDT src/models/vae.py l.79: clip_((x + 1) * 127.5 + 0.5, 0, 255).to(uint8)
    ddt = hwc(torch.clip((x + 1) * 127.5 + 0.5, 0, 255)).to(torch.uint8)
    # sihyun-yu/REPA generate.py l.151-154: (x + 1) / 2., clamp(255. * x, 0, 255)
    repa = hwc(torch.clamp(255.0 * ((x + 1) / 2.0), 0, 255)).to(torch.uint8)
    # bytetriper/RAE src/sample_ddp.py l.276-277: rae.decode(z).clamp(0, 1), .mul(255), .to(uint8) on [0, 1] images
    unit = (x + 1) / 2
    rae = hwc(unit.clamp(0, 1).mul(255)).to(torch.uint8)
    conv = image_conversions.CONVERSIONS
    assert torch.equal(conv["dit"](x), dit) and torch.equal(conv["ddt"](x), ddt)
    assert torch.equal(conv["repa"](x), repa) and torch.equal(conv["rae"](x, unit=unit), rae)
    assert torch.equal(conv["rae"](x), rae)  # without the decoder's own [0, 1] images: (x + 1) / 2
    # End2End-Diffusion/diffusion-bench src/stage1/vae.py l.239 ((x + 1) / 2).clamp(0, 1), src/eval/generation.py
    # l.167-168 .clamp(0, 1), .mul(255), .to(uint8)
    nanogen = hwc(((x + 1.0) / 2.0).clamp(0, 1).clamp(0, 1).mul(255)).to(torch.uint8)
    assert torch.equal(conv["nanogen"](x), nanogen)
    # the measured difference: truncating 255 u is DiT's rounding one level lower for about half the values
    differs = (rae.int() - dit.int()).abs()
    assert differs.max() == 1 and 0.3 < (differs == 1).float().mean() < 0.7
    assert {p.conversion for p in PROTOCOLS.values()} <= set(conv)
    with pytest.raises(ValueError, match="unknown image conversion 'x'; choose one of: dit, ddt, repa, rae, nanogen"):
        image_conversions.conversion("x")


# ---- AutoGuidance and the table -------------------------------------------------------------------------------

def test_autoguidance_is_raes_rule():
    g = torch.Generator().manual_seed(1)
    main, weak = torch.randn(2, 8, 4, 4, generator=g), torch.randn(2, 8, 4, 4, generator=g)
    # RAE src/stage2/models/DDT.py l.397-405: eps = model_out[:, :in_channels]; ag_eps + cfg_scale (eps - ag_eps)
    assert torch.equal(protocol_types.autoguidance_combine(main, weak, 1.42), weak + 1.42 * (main - weak))
    p = PROTOCOLS["rae-ag"]
    assert (p.guidance.rule, p.guidance.scale, p.guidance.channels, p.guidance.guide_model) == (
        "autoguidance", 1.42, "all", "DiT-DH-S")  # configs/stage2/sampling/ImageNet256/DiTDHXL-DINOv2-B_AG.yaml
    assert p.evaluations_per_step == 2 and PROTOCOLS["rae"].evaluations_per_step == 1


def test_every_row_names_its_release_files_and_resolves():
    assert set(protocols.RELEASE_ROWS) == {"dit", "sit", "repa", "lightningdit", "ddt", "rae", "rae-ag", "nanogen",
                                           "nanogen-pixels", "nanogen-t2i", "nanogen-t2i-pixels", "meanflow", "imf"}
    assert set(PROTOCOLS) - set(protocols.RELEASE_ROWS) == {n for n in PROTOCOLS if n.startswith("nanogen/")}
    for name, p in PROTOCOLS.items():
        assert "/" in p.release and p.sources and all(p.sources), name
        assert p.solver in protocol_types.SOLVERS and p.guidance.rule in protocol_types.GUIDANCE_RULES, name
        assert p.guidance.ends in protocol_types.ENDS and p.labels in ("uniform", "equal"), name
        assert p.record(SD_LATENT)["name"] == name
        a = p.applies_to  # every row says what it applies to (dit/protocol_fit.py)
        assert a.space and a.conditioning and a.objectives, name
    assert PROTOCOLS["dit"].times(SD_LATENT) is None and PROTOCOLS["dit"].count == 250
    over = PROTOCOLS["ddt"].with_overrides(count=10, scale=3.0, interval=(0.1, 0.6), labels="uniform")
    assert over.overrides == ("steps 10", "scale 3", "interval (0.1, 0.6)", "labels uniform")
    assert over.guidance.ends == "()" and PROTOCOLS["ddt"].with_overrides(count=250).overrides == ()
    with pytest.raises(ValueError, match="unknown sampling protocol 'adm'; choose one of: dit, sit, repa"):
        protocols.protocol("adm")
    with pytest.raises(ValueError, match=r"nanogen/<NanoGen sampling config> \(78 rows: docs/nanogen-protocols.md\), "
                                         r"got 'nanogen-t2i-pixel' \(did you mean nanogen-t2i-pixels"):
        raise ValueError(protocols.unknown("nanogen-t2i-pixel"))
    # --time-shift under a protocol replaces its grid's shift, recorded
    shifted = PROTOCOLS["nanogen-t2i"].with_overrides(shift=1.0)
    assert shifted.overrides == ("shift 1",) and shifted.grid.resolve_shift((3, 64, 64), None) == 1.0
    assert PROTOCOLS["nanogen-t2i"].grid.resolve_shift((3, 64, 64), None) == pytest.approx(math.sqrt(3))


def test_the_cost_of_raes_autoguidance():
    """docs/sampling.md, AutoGuidance: per step and sample, one DiT-DH-XL and one DiT-DH-S forward (RAE's _AG guidance
    model: hidden [384, 2048], depth [12, 2], heads [6, 16]), 1.30 DiT-DH-XL forwards in multiply-accumulates; CFG
    takes 2, and the release's AutoGuidance, both networks on its doubled batch, 2.60."""
    from dit_pipeline import dit
    from dit_pipeline.dit.family import create_model

    with torch.device("meta"):
        xl, s = (create_model(n, input_size=16, in_channels=768, num_classes=1000) for n in ("DiT-DH-XL", "DiT-DH-S"))
    assert (s.config["hidden_size"], s.config["depth"], s.config["head_hidden_size"], s.config["head_depth"],
            s.num_heads, s.config["head_num_heads"]) == (384, 12, 2048, 2, 6, 16)
    ratio = dit.forward_macs(s.config) / dit.forward_macs(xl.config)
    assert round(1 + ratio, 2) == 1.30 and round(2 * (1 + ratio), 2) == 2.60
