"""recipes/*.yaml against the papers: every recipe's settings, FID and sampling against a table written here from
the papers and their releases (each row names its source), its sampling settings valid for dit-sample, and
`dit-train --config recipes/X.yaml --dry-run` on a shard set of ImageNet-1k's size (a manifest of 1,281,167
samples in 1282 shards, read as a URL list, so no latents are needed): the plan shows the paper's global batch,
length in steps and epochs, optimizer, lr schedule and time shift. """
from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest

from dit_pipeline.common.errors import ConfigError
from dit_pipeline.sample.config import SampleConfig
from dit_pipeline.train import merge_config
from dit_pipeline.dit.protocols import PROTOCOLS
from dit_pipeline.train.config_file import load_config_file
from tests._util import REPO, make_tiny_teacher
from tests.train.conftest import invoke_train
from tests.train.helpers import IMAGENET, hub_vae, recipe_manifest

RECIPES = REPO / "recipes"
# the VAEs as the releases name them (DiT's and REPA's --vae ema, the MeanFlows' sd-vae-ft-mse, LightningDiT's VA-VAE)
EMA, MSE, VAVAE = "stabilityai/sd-vae-ft-ema", "stabilityai/sd-vae-ft-mse", "hustvl/vavae-imagenet256-f16d32-dinov2"
SD, VA, RAE = (4, 32, 32), (32, 16, 16), (768, 16, 16)  # SD-VAE, VA-VAE f16d32, DINOv2-B features at 256 px

# The papers' values. A row: model, objective, global batch, lr, (beta1, beta2), EMA decay, training length
# (steps or epochs as the source gives it), the FID the paper states and its sampling (sampler, steps, guidance,
# guidance interval as noise levels), and the extra settings. Sources per row.
PAPERS = {
    # Peebles & Xie 2023, arXiv:2212.09748, sec. 4 and Table 4; facebookresearch/DiT train.py (AdamW 1e-4, no
    # weight decay, batch 256, EMA 0.9999), sample_ddp.py (250 DDPM steps, cfg 1.5 on 3 channels): FID 2.27 at 7M steps
    "dit-xl2.yaml": dict(model="DiT-XL/2", objective="ddpm", batch=256, lr=1e-4, betas=(0.9, 0.999), ema=0.9999,
                         steps=7_000_000, epochs=1400, fid=2.27, sampler="ddpm", sample_steps=250, cfg=1.5,
                         channels="3", interval=None, latent=SD, extra={}),
    # Ma et al. 2024, arXiv:2401.08740, Table 3 (SDE 2.06 with cfg 1.5); willisma/SiT train.py (DiT's optimizer,
    # batch 256, 7M steps) and sample_ddp.py (Euler-Maruyama, diffusion form sigma, last step Mean 0.04)
    "sit-xl2.yaml": dict(model="SiT-XL/2", objective="flow", batch=256, lr=1e-4, betas=(0.9, 0.999), ema=0.9999,
                         steps=7_000_000, epochs=1400, fid=2.06, sampler="euler-maruyama", sample_steps=250, cfg=1.5,
                         channels="3", interval=None, latent=SD, extra={"t_sampling": "uniform"}),
    # Yu et al. 2024, arXiv:2410.06940, Table 2 (1.42 at 800 epochs); sihyun-yu/REPA train.py (DINOv2-B, depth 8,
    # coefficient 0.5, max grad norm 1.0, 4M steps at 256) and README (cfg 1.8, guidance_high 0.7, SDE 250 steps)
    "repa-sit-xl2.yaml": dict(model="SiT-XL/2", objective="flow", batch=256, lr=1e-4, betas=(0.9, 0.999), ema=0.9999,
                              steps=4_000_000, epochs=800, fid=1.42, sampler="euler-maruyama", sample_steps=250,
                              cfg=1.8, channels="all", interval=[0.0, 0.7], latent=SD,
                              extra={"repa": "dinov2_vitb14", "repa_depth": 8, "repa_coeff": 0.5, "grad_clip": 1.0}),
    # Yao et al. 2025, arXiv:2501.01423; hustvl/LightningDiT
    # configs/reproductions/lightningdit_xl_vavae_f16d32_64ep_cfg.yaml
    # (batch 1024, lr 2e-4, beta2 0.95, 80K steps, use_lognorm, use_cosine_loss; cfg 10.0, cfg_interval_start 0.10,
    # timestep_shift 0.3, 250 sampling points); train.py (update_ema 0.9999): FID 2.11 at 64 epochs
    "lightningdit-xl1-64ep.yaml": dict(model="LightningDiT-XL/1", objective="flow", batch=1024, lr=2e-4,
                                       betas=(0.9, 0.95), ema=0.9999, steps=80_000, epochs=64, fid=2.11,
                                       sampler="euler", sample_steps=249, cfg=10.0, channels="3", interval=[0.0, 0.9],
                                       time_shift=1 / 0.3, latent=VA,
                                       extra={"t_sampling": "logit-normal", "cosine_loss": True}),
    # the same release's _800ep_cfg.yaml (cfg 6.7, cfg_interval_start 0.125) and the paper: FID 1.35 at 800 epochs
    "lightningdit-xl1-800ep.yaml": dict(model="LightningDiT-XL/1", objective="flow", batch=1024, lr=2e-4,
                                        betas=(0.9, 0.95), ema=0.9999, steps=None, epochs=800, fid=1.35,
                                        sampler="euler", sample_steps=249, cfg=6.7, channels="3",
                                        interval=[0.0, 0.875], time_shift=1 / 0.3, latent=VA,
                                        extra={"t_sampling": "logit-normal", "cosine_loss": True}),
    # Wang et al. 2025, arXiv:2504.05741; MCG-NJU/DDT configs/repa_improved_ddt_xlen22de6_256.yaml (AdamW 1e-4,
    # betas (0.9, 0.95), EMA 0.9999, lognorm_t, REPA DINOv2-B at layer 8 weight 0.5, max_steps 4M; Euler 250 steps,
    # guidance 2.0 inside 0.3 < t < 1) and README (FID 1.26, DDT-XL/2 22en6de at 256 px)
    "ddt-xl2.yaml": dict(model="DDT-XL/2", objective="flow", batch=256, lr=1e-4, betas=(0.9, 0.95), ema=0.9999,
                         steps=4_000_000, epochs=800, fid=1.26, sampler="euler", sample_steps=250, cfg=2.0,
                         channels="all", interval=[0.0, 0.7], latent=SD, labels="equal",  # randn.py: 50 per class
                         extra={"t_sampling": "logit-normal", "repa": "dinov2_vitb14", "repa_depth": 8,
                                "repa_coeff": 0.5}),
    # Zheng et al. 2025, arXiv:2510.11690 (1.51 without guidance at 800 epochs); bytetriper/RAE
    # configs/stage2/training/ImageNet256/DiTDH-XL_DINOv2-B.yaml (batch 1024, lr 2e-4, betas (0.9, 0.95), EMA 0.9995,
    # clip 1.0, logit-normal(0, 1), linear schedule: warmup_epochs 40 without warmup_from_zero, decay_end_epoch 800,
    # final lr 2e-5, time_dist_shift sqrt(196608 / 4096); sampler Euler ODE num_steps 50 = 49 steps)
    "dit-dh-xl-rae.yaml": dict(model="DiT-DH-XL", objective="flow", batch=1024, lr=2e-4, betas=(0.9, 0.95),
                               ema=0.9995, steps=None, epochs=800, fid=1.51, sampler="euler", sample_steps=49,
                               cfg=1.0, channels=None, latent=RAE, time_shift=math.sqrt(48),
                               interval=[0.0, 1.0],  # the sampling config's method cfg, t-min 0.0, t-max 1.0
                               labels="equal",  # README: --label-sampling equal by default
                               extra={"t_sampling": "logit-normal", "time_shift": "auto", "time_shift_base": 4096,
                                      "final_lr": 2e-5, "lr_decay_start_epochs": 40, "lr_decay_end_epochs": 800,
                                      "grad_clip": 1.0}),
    # Leng et al. 2025, arXiv:2504.10483; End2End-Diffusion/REPA-E README: train_ldm_only.py --model SiT-XL/1
    # --batch-size 256 --learning-rate 1e-4 --max-train-steps 4000000 --proj-coeff 0.5 --encoder-depth 8
    # --enc-type dinov2-vit-b --weighting uniform; table B: E2E-VAVAE + SiT-XL/1 (REPA), 800 epochs, FID 1.12 with
    # cfg 2.4 in [0, 0.73], 50 images per class, SDE 250 steps
    "repae-sit-xl1-e2evae.yaml": dict(model="SiT-XL/1", objective="flow", batch=256, lr=1e-4, betas=(0.9, 0.999),
                                      ema=0.9999, steps=4_000_000, epochs=800, fid=1.12, sampler="euler-maruyama",
                                      sample_steps=250, cfg=2.4, channels="all", interval=[0.0, 0.73], latent=VA,
                                      labels="equal",
                                      extra={"repa": "dinov2_vitb14", "repa_depth": 8, "repa_coeff": 0.5,
                                             "t_sampling": "uniform"}),
    # Geng et al. 2025, arXiv:2505.13447; Gsunshine/meanflow configs/run_b4.yml (DiT_B_4, 240 epochs) over
    # configs/default.py (batch 256, lr 1e-4, adam_b2 0.95, ema 0.9999, P_mean -0.4, P_std 1.0, data_proportion 0.75,
    # class_dropout_prob 0.1, omega 1.0, kappa 0.5, t_start 0, t_end 1, norm_p 1, norm_eps 0.01; sampling num_steps 1);
    # no paper FID read for this run (the README's 11.4 is its own checkpoint's)
    "meanflow-b4.yaml": dict(model="DiT-B/4", objective="meanflow", batch=256, lr=1e-4, betas=(0.9, 0.95),
                             ema=0.9999, steps=None, epochs=240, fid=None, sampler="meanflow", sample_steps=1, cfg=None,
                             channels=None, interval=None, latent=SD, params_gb="0.49", unconfirmed={"fid"},
                             extra={"mf_t_mean": -0.4, "mf_t_scale": 1.0, "mf_data_proportion": 0.75, "mf_omega": 1.0,
                                    "mf_kappa": 0.5, "mf_t_start": 0.0, "mf_t_end": 1.0, "mf_norm_p": 1.0,
                                    "mf_norm_eps": 0.01}),
    # Geng et al. 2025, arXiv:2512.02012 (iMF-B/2 3.39 at 1 NFE); Lyy-iiis/imeanflow configs/train_config.yml
    # (imfDiT_B_2, 640 epochs, batch 1024, lr 1e-4, warmup_epochs 10 warmup_const, adam_b2 0.95) over
    # configs/default.py (ema_val 0.9999, P_mean -0.4, P_std 1.0, data_proportion 0.5, class_dropout_prob 0.1,
    # norm_p 1, norm_eps 0.01), imf.py (s_max 7.0); configs/eval_config.yml (omega 8.0, interval [0.4, 0.65], 1 step)
    "imf-b2.yaml": dict(model="iMF-B/2", objective="imf", batch=1024, lr=1e-4, betas=(0.9, 0.95), ema=0.9999,
                        steps=None, epochs=640, fid=3.39, sampler="meanflow", sample_steps=1, cfg=8.0, channels=None,
                        interval=[0.4, 0.65], latent=SD, params_gb="0.54", unconfirmed=set(), labels="equal",
                        extra={"warmup_epochs": 10, "mf_t_mean": -0.4, "mf_t_scale": 1.0, "mf_data_proportion": 0.5,
                               "mf_norm_p": 1.0, "mf_norm_eps": 0.01, "mf_s_max": 7.0}),
    # the same release: imfDiT_XL_2; eval_config.yml (omega 8.0, interval [0.42, 0.62] for the provided XL/2); its
    # torch branch's convert.py (commit a2ac5c55) names the checkpoint imf_xl_800ep/checkpoint_1000800 (800 epochs of
    # 1251 steps: batch 1024); lr, warm-up, beta2 and EMA are B/2's (train_config.yml), not stated for XL/2
    "imf-xl2.yaml": dict(model="iMF-XL/2", objective="imf", batch=1024, lr=1e-4, betas=(0.9, 0.95), ema=0.9999,
                         steps=None, epochs=800, fid=1.72, sampler="meanflow", sample_steps=1, cfg=8.0, channels=None,
                         interval=[0.42, 0.62], latent=SD, params_gb="2.65", labels="equal",
                         unconfirmed={"lr", "warmup_epochs", "adam_beta2", "ema_decay"},
                         extra={"warmup_epochs": 10, "mf_data_proportion": 0.5, "mf_s_max": 7.0}),
}


# The extraction each recipe requires (its `requires:`, compared with the shard set's manifest by dit-train): views
# (2: both flips), normalization, feature encoder, crops stored beside the latents (REPA's online teacher); the
# latent shape is the row's `latent`, the image size 256. Sources: the rows' above.
EXTRACTION = {
    "dit-xl2.yaml": (2, "scalar", None, False, EMA),  # DiT extract_features / train.py: horizontal flips, x 0.18215
    "sit-xl2.yaml": (2, "scalar", None, False, EMA),  # SiT: DiT's data pipeline
    "repa-sit-xl2.yaml": (1, "scalar", None, True, EMA),  # REPA: the encoder sees the crops themselves
    "lightningdit-xl1-64ep.yaml": (2, "per-channel", None, False, VAVAE),  # VA-VAE latents, latents_stats.pt
    "lightningdit-xl1-800ep.yaml": (2, "per-channel", None, False, VAVAE),
    "ddt-xl2.yaml": (1, "scalar", None, True, EMA),  # DDT: REPA's teacher on the crops
    "dit-dh-xl-rae.yaml": (2, "per-position", "vit_base_patch14_reg4_dinov2", False, None),  # RAE: DINOv2-B
    "repae-sit-xl1-e2evae.yaml": (1, "per-channel", None, True, "REPA-E/e2e-vavae-hf"),
    "meanflow-b4.yaml": (2, "scalar", None, False, MSE),  # sd-vae-ft-mse, x 0.18215, flips
    "imf-b2.yaml": (2, "per-channel", None, False, MSE),  # utils/vae_util.py: (z - mean) / std per channel
    "imf-xl2.yaml": (2, "per-channel", None, False, MSE),
}


def test_there_is_a_row_for_every_recipe_file():
    """(NanoGen's recipes, recipes/nanogen/, have theirs in tests/train/test_nanogen_recipes.py.)"""
    assert sorted(p.name for p in RECIPES.glob("*.yaml") if p.name != "MOVED.yaml") == sorted(PAPERS) == \
        sorted(EXTRACTION)


@pytest.mark.parametrize("name", sorted(PAPERS))
def test_the_recipe_states_the_papers_values(name):
    row, values = PAPERS[name], load_config_file(RECIPES / name)
    cfg = merge_config(values, {"shards": "s", "run_dir": "r"})
    assert (cfg.model, cfg.objective, cfg.global_batch_size, cfg.lr) == (row["model"], row["objective"], row["batch"],
                                                                         row["lr"])
    assert (cfg.adam_beta1, cfg.adam_beta2, cfg.ema_decay, cfg.weight_decay) == (*row["betas"], row["ema"], 0.0)
    assert cfg.class_dropout_prob == 0.1 and cfg.optimizer == "adamw"
    if row["steps"] is not None:  # the source's length in steps, which is the paper's epochs of ImageNet-1k
        assert cfg.max_steps == row["steps"] and cfg.epochs is None
        assert row["steps"] * row["batch"] / IMAGENET == pytest.approx(row["epochs"], rel=0.01)
    else:
        assert cfg.epochs == row["epochs"] and cfg.max_steps is None
    for key, want in row["extra"].items():
        assert getattr(cfg, key) == want, key
    recipe = cfg.recipe
    assert recipe["fid"] == row["fid"] and recipe["epochs"] == row["epochs"] and recipe["paper"]
    if row["objective"] in ("meanflow", "imf"):  # the MeanFlow settings the recipe does not state: the defaults
        assert {k: getattr(cfg, k) for k in ("mf_t_mean", "mf_t_scale", "mf_norm_p", "mf_norm_eps")} == \
            {"mf_t_mean": -0.4, "mf_t_scale": 1.0, "mf_norm_p": 1.0, "mf_norm_eps": 0.01}
    assert re.fullmatch(r"\d{4}\.\d{5}", recipe["arxiv"]) and recipe["extraction"] and recipe["name"]
    views, normalization, encoder, pixels, vae = EXTRACTION[name]  # what the shards must be (train/recipes.py)
    assert recipe["requires"] == {"latent_shape": list(row["latent"]), "image_size": 256, "views": views,
                                  "normalization": normalization, "encoder": encoder, **({"pixels": True} if pixels
                                                                                         else {}),
                                  **({"vae": vae} if vae else {})}
    s = recipe["sampling"]  # a release's protocol (dit/protocols.py), with the values the paper changed
    if "protocol" not in s:  # a release without a protocol row: dit-sample's own flags
        assert (s["sampler"], s["steps"], s["cfg_scale"]) == (row["sampler"], row["sample_steps"], row["cfg"])
        assert s.get("cfg_channels") == row["channels"] and s.get("guidance_interval") == row["interval"]
        assert s.get("time_shift") == row.get("time_shift") and s.get("labels", "uniform") == row.get("labels", "uniform")
        cfg.validate()
        return
    p = PROTOCOLS[s["protocol"]].with_overrides(scale=s.get("cfg_scale"), interval=s.get("guidance_interval"),
                                                labels=s.get("labels"))
    times = p.times(row["latent"])
    evaluations = p.count if times is None else len(times) - 1  # network evaluations per sample (and per half)
    assert (p.solver, evaluations) == (row["sampler"], row["sample_steps"])
    assert p.guidance.scale == row["cfg"] or (p.guidance.rule == "none" and row["cfg"] in (None, 1.0))
    assert row["channels"] in (None, p.guidance.channels) and row["interval"] == (
        None if p.guidance.interval is None else list(p.guidance.interval))
    if row.get("time_shift") is not None:
        assert p.grid.resolve_shift(row["latent"], None) == pytest.approx(row["time_shift"], rel=1e-15)
    assert p.labels == row.get("labels", "uniform")
    cfg.validate()


@pytest.mark.parametrize("name", sorted(PAPERS))
def test_every_unconfirmed_value_says_so(name):
    """A value no release file or paper confirms carries UNCONFIRMED on its line, and only those (the rows'
    `unconfirmed`; rows without the key have none)."""
    lines = (RECIPES / name).read_text(encoding="utf-8").splitlines()
    marked = {m.group(1) for line in lines if (m := re.match(r"\s*(\w+):.*#.*UNCONFIRMED", line))}
    assert marked == PAPERS[name].get("unconfirmed", set())


@pytest.mark.parametrize("name", sorted(PAPERS))
def test_the_sampling_settings_are_dit_samples(name):
    sampling = load_config_file(RECIPES / name)["recipe"]["sampling"]
    assert set(sampling) <= {f.name for f in dataclasses.fields(SampleConfig)}
    SampleConfig(ckpt="model.pt", npz="samples.npz", **sampling).validate()


def _requires(name: str) -> tuple:
    req = load_config_file(RECIPES / name)["recipe"]["requires"]
    return (tuple(req["latent_shape"]), bool(req.get("pixels", False)), req["views"], req["normalization"],
            req["encoder"], req.get("vae"))


def _imagenet(folder: Path, key: tuple) -> Path:
    shape, pixels, views, norm, enc, vae = key
    encoder = {"kind": "features", "model": enc, "weights": f"timm:{enc} (pretrained)"} if enc else None
    return recipe_manifest(folder, shape, pixels=pixels, views=views, normalization=norm, encoder=encoder,
                           vae=hub_vae(vae, shape[0], 256 // shape[1]) if vae else None)


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory):
    """One ImageNet-sized manifest per extraction the recipes require, keyed by recipe file, and the SD-VAE set of
    DiT's recipe under "sd" (the wrong set for the others)."""
    root = tmp_path_factory.mktemp("imagenet")
    sets: dict = {}
    for name in PAPERS:
        key = _requires(name)
        if key not in sets:
            sets[key] = _imagenet(root / f"set{len(sets)}", key)
    return {"teacher": make_tiny_teacher(root / "teacher.safetensors"), "sd": sets[_requires("dit-xl2.yaml")],
            **{name: sets[_requires(name)] for name in PAPERS}}


def _dry_run(name, imagenet, tmp_path, manifest=None, ok=True, **flags):
    manifest = manifest or imagenet[name]
    args = ["--config", RECIPES / name, "--shards", "shard-{000000..001281}.tar", "--manifest", manifest,
            "--run-dir", tmp_path / "run", "--dry-run", "--quiet"]
    if PAPERS[name]["extra"].get("repa"):  # the recipe's teacher, DINOv2-B, cannot be fetched here
        args += ["--repa", imagenet["teacher"]]
    for k, v in flags.items():
        args += [f"--{k}"] if v is None else [f"--{k}", v]
    r = invoke_train(args)
    assert (r.exit_code == 0) == ok, r.output
    return r.output


@pytest.mark.parametrize("name", sorted(PAPERS))
def test_the_dry_run_plans_the_papers_run(name, imagenet, tmp_path):
    row = PAPERS[name]
    plan = _dry_run(name, imagenet, tmp_path)
    if row["extra"].get("repa"):  # a tiny teacher for DINOv2-B (not fetchable here): the one departure
        assert "this run departs from it in 1 way(s), so the paper's number does not apply to it:\n  departs     " \
               f"--repa {row['extra']['repa']} -> {imagenet['teacher']}\n" in plan
    elif row["fid"] is None:  # nothing to state
        assert "the paper states FID" not in plan and "departs" not in plan
        assert f"  recipe      {load_config_file(RECIPES / name)['recipe']['name']}" in plan
    else:  # the recipe's own extraction and settings: the paper's number applies
        assert f"the paper states FID {row['fid']:g} (" in plan and ", not measured here" in plan
        assert "departs" not in plan
    assert f"  batch       global {row['batch']} = 1 rank(s) x micro-batch {row['batch']} x 1" in plan
    length = re.search(r"  length      (.*) -> ([\d,]+) steps \(~([\d.]+) epochs\)", plan)
    assert length is not None
    if row["steps"] is not None:
        assert int(length.group(2).replace(",", "")) == row["steps"]
    else:  # a length in epochs: the steps of that many of the readers' epochs of ImageNet
        assert length.group(1) == f"epochs {row['epochs']}"
        assert int(length.group(2).replace(",", "")) == pytest.approx(row["epochs"] * IMAGENET / row["batch"], rel=0.01)
    assert float(length.group(3)) == pytest.approx(row["epochs"], rel=0.01)  # the readers' epochs of ImageNet
    beta = f"betas ({row['betas'][0]:g}, {row['betas'][1]:g})"
    assert f"  optimizer   AdamW, {beta}, eps 1e-08, weight decay 0; " in plan and f"EMA decay {row['ema']:g}" in plan
    if "final_lr" not in row["extra"] and "warmup_epochs" not in row["extra"]:
        assert f"  lr          {row['lr']:g}, constant\n" in plan
    # fp32 parameters: DiT-DH-XL 839M, DiT-B/4 131M, iMF-B/2 146M and XL/2 711M with their v heads, NanoGen's
    # in-context DiT-DH 611M (its report's "~615M-parameter DiT"), the others 675M
    params_gb = row.get("params_gb", {"DiT-DH-XL": "3.1", "DiT-DH-XL/16": "3.1",
                                      "ddt-en28d1152hd72-dn2d2048hd128": "2.28"}.get(row["model"], "2.5"))
    assert f"  GPU memory  (analytic estimate, unmeasured, rank 0) params {params_gb}" in plan


def test_the_rae_recipe_plans_its_shift_and_schedule_in_the_runs_epochs(imagenet, tmp_path):
    """The DiT-DH-XL recipe: its time shift sqrt(48) and its lr schedule in steps of this run's epochs."""
    plan = _dry_run("dit-dh-xl-rae.yaml", imagenet, tmp_path)
    assert f"shifted by {math.sqrt(48):.4g} toward noise" in plan
    assert "(--time-shift auto: sqrt(768x16x16 / 4096) = 6.928)" in plan
    assert "  optimizer   AdamW, betas (0.9, 0.95), eps 1e-08, weight decay 0; grad clip 1; EMA decay 0.9995" in plan
    epoch = re.search(r"  epoch 0     ([\d,]+) optimizer steps", plan)
    length = re.search(r"  length      epochs 800 -> ([\d,]+) steps", plan)
    lr = re.search(r"  lr          0.0002, constant to step ([\d,]+) \(epoch 40\), linear to 2e-05 at step ([\d,]+) "
                   r"\(epoch 800\), then constant", plan)
    assert epoch and length and lr, plan
    per, total = (int(m.group(1).replace(",", "")) for m in (epoch, length))
    start, end = (int(g.replace(",", "")) for g in lr.groups())
    assert per in (1248, 1249) and abs(start - 40 * per) <= 40 and end == total  # the decay ends with the run


def test_flow_option_recipe_and_sampler_mistakes_are_named():
    with pytest.raises(ConfigError) as e:
        merge_config({"recipe": {"name": "x", "fid": "low", "sampling": [1], "paper_url": "u"}},
                     {"shards": "s", "run_dir": "r", "objective": "ddpm", "cosine_loss": True}).validate()
    msg = str(e.value)
    assert "--time-shift and --cosine-loss act on the flow objective: add --objective flow" in msg
    assert "recipe: unknown key 'paper_url'" in msg and "recipe: 'paper' is required (text)" in msg
    assert "recipe: 'fid' must be a number or null, got 'low'" in msg
    assert "recipe: 'sampling' must be a mapping of dit-sample settings, got [1]" in msg
    cfg = merge_config({}, {"shards": "s", "run_dir": "r", "objective": "flow", "time_shift": "2.5"})
    assert cfg.time_shift == 2.5  # the flag's text, as a number
    with pytest.raises(ConfigError, match="--time-shift must be a number > 0 or 'auto', got 'fast'"):
        merge_config({}, {"shards": "s", "run_dir": "r", "objective": "flow", "time_shift": "fast"}).validate()
    with pytest.raises(ConfigError, match="--time-shift must be > 0 \\(1 = none\\), got 0.0"):
        SampleConfig(ckpt="m.pt", npz="s.npz", class_labels=[0], time_shift=0.0).validate()
    with pytest.raises(ConfigError, match="--time-shift shifts the flow samplers' time grid .* not --sampler ddim's"):
        SampleConfig(ckpt="m.pt", npz="s.npz", class_labels=[0], sampler="ddim", steps=50, time_shift=3.0).validate()


def test_a_recipe_on_the_wrong_shards_is_refused_and_departures_are_listed(imagenet, tmp_path):
    """Issue 41, item 9: RAE's recipe on SD-VAE latents and LightningDiT's on 4-channel latents were accepted without
    a word, and with the model overridden the plan still stated the paper's FID. Now the extraction is compared with
    the manifest (refused, or run with --allow-departures), and every departure is in the plan and config.json, the
    paper's number only where nothing departs."""
    import json

    out = _dry_run("dit-dh-xl-rae.yaml", imagenet, tmp_path, manifest=imagenet["sd"], ok=False)
    assert out.strip().splitlines()[-1] == (
        "error: the recipe 'DiT-DH-XL on RAE DINOv2-B, 800 epochs' needs another shard set than "
        f"{imagenet['sd']}: latent shape 4x32x32 where the recipe needs 768x16x16; normalization scalar where the "
        "recipe needs per-position; feature encoder none (a VAE) where the recipe needs vit_base_patch14_reg4_dinov2. "
        "Extract as the recipe says (DINOv2-B with registers, final norm without affine, 256 patch tokens -> "
        "768x16x16, normalized per channel and position (issue 32's feature extraction, dit-extract with a feature "
        "encoder); both flips), or pass --allow-departures to train on these shards anyway (the paper's FID then "
        "does not apply)")
    out = _dry_run("lightningdit-xl1-64ep.yaml", imagenet, tmp_path, manifest=imagenet["sd"], ok=False)
    assert "latent shape 4x32x32 where the recipe needs 32x16x16; normalization scalar where the recipe needs " \
           "per-channel; VAE stabilityai/sd-vae-ft-ema (a hub id) where the recipe needs " \
           "hustvl/vavae-imagenet256-f16d32-dinov2 (a local copy is recognised by its name: docs/diffusionbench.md)." \
           in out
    plan = _dry_run("dit-xl2.yaml", imagenet, tmp_path, manifest=imagenet["repa-sit-xl2.yaml"], **{
        "allow-departures": None, "model": "DiT-B/2", "max-steps": 100, "num-workers": 2})
    assert "the paper states FID" not in plan
    assert "this run departs from it in 3 way(s), so the paper's number does not apply to it:" in plan
    for line in ("--model DiT-XL/2 -> DiT-B/2", "--max-steps 7000000 -> 100", "shards: views (2: both flips) 1 where "
                 "the recipe needs 2"):
        assert f"\n  departs     {line}" in plan
    assert "--num-workers" not in plan.split("departs from it")[1]  # bookkeeping, not a departure
    cfg = merge_config(load_config_file(RECIPES / "repa-sit-xl2.yaml"), {"shards": "s", "run_dir": "r", "lr": 2e-4})
    assert cfg.recipe["departures"] == ["--lr 0.0001 -> 0.0002"]
    assert json.loads(json.dumps(cfg.to_dict()))["recipe"]["departures"] == ["--lr 0.0001 -> 0.0002"]
