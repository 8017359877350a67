"""--objective meanflow end to end: 2 ranks (gloo) with training guidance, a run killed with SIGKILL and resumed is
bit-identical to a straight run, the periodic grid is drawn with the 1-step mean-flow sampler, the checkpoint records
the objective, its settings and the second time input, dit-sample draws 1- and 2-step grids and an npz from it and
refuses a diffusion sampler, and a resume under another objective or other MeanFlow settings is refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dit_pipeline import dit
from dit_pipeline.common.errors import ConfigError, UserError
from dit_pipeline.sample import SampleConfig
from dit_pipeline.sample.run import run_sampling
from dit_pipeline.train import merge_config
from tests._util import straight_killed_resumed
from tests.train.conftest import run_tiny, tiny_args

STEPS = 4
KEYS = ("step", "epoch", "loss", "mse", "grad_norm")
MF = {"objective": "meanflow", "mf-omega": 0.6, "mf-kappa": 0.2, "mf-t-end": 0.9}


def _args(shards, run_dir, vae):
    return tiny_args(shards, run_dir, **{**MF, "max-steps": STEPS, "ckpt-every": 2, "num-workers": 0,
                                         "global-batch-size": 4, "micro-batch-size": 2, "sample-every": STEPS, "sample-classes": "0,1",
                                         "sample-steps": 1, "vae": vae})


def test_meanflow_two_ranks_kill_resume_bit_identical_and_one_step_samples(shard_dir, tiny_vae_dir, tmp_path):
    straight, a, b = straight_killed_resumed(lambda run: _args(shard_dir, run, tiny_vae_dir), tmp_path, STEPS, KEYS)
    for key in ("model", "ema"):
        assert all(torch.equal(a[key][n], b[key][n]) for n in a[key]), key
    assert a["objective"] == "meanflow" and a["model_config"]["conditions"] == "meanflow"
    assert a["meanflow"]["mf_omega"] == 0.6 and a["meanflow"]["mf_kappa"] == 0.2
    assert "h_embedder.mlp.0.weight" in a["ema"] and a["model_config"]["learn_sigma"] is False
    assert (straight / "samples" / f"step-{STEPS:07d}.png").is_file()  # the trainer's grid: 1-step mean flow
    sd, info = dit.load_dit_weights(straight / "checkpoints" / f"step-{STEPS:07d}-ema.pt")  # bare EMA + sidecar
    assert info["objective"] == "meanflow" and info["model_config"] == a["model_config"]
    assert all(torch.equal(sd[k], a["ema"][k]) for k in sd)

    ckpt = straight / "checkpoints" / f"step-{STEPS:07d}.pt"
    base = dict(ckpt=str(ckpt), vae=str(tiny_vae_dir), class_labels=[0, 1, 1], quiet=True)
    one = run_sampling(SampleConfig(**base, sampler="meanflow", steps=1, npz=str(tmp_path / "one.npz"),
                                    out=str(tmp_path / "one")))
    two = run_sampling(SampleConfig(**base, steps=2, npz=str(tmp_path / "two.npz")))  # meanflow: the default
    assert one.grid is not None and one.grid.is_file()
    x1, x2 = (np.load(p)["arr_0"] for p in (one.npz, two.npz))
    # both sample; whether 1 and 2 steps differ is checked on values in tests/dit/test_meanflow.py (after these 4
    # training steps the two gave the same uint8 images under make test-min-deps, torch 2.6)
    assert x1.shape == x2.shape == (3, 64, 64, 3)
    with pytest.raises(UserError, match=r"--sampler ddim: .* is a meanflow model; pass --sampler meanflow"):
        run_sampling(SampleConfig(**base, sampler="ddim", steps=10, npz=str(tmp_path / "x.npz")))
    assert not (tmp_path / "x.npz").exists()

    with pytest.raises(UserError, match="was trained with --objective meanflow, this run asks for --objective flow"):
        run_tiny(shard_dir, straight, max_steps=STEPS + 1, global_batch_size=8, objective="flow")
    with pytest.raises(UserError, match=r"other MeanFlow settings \(--mf-omega 0.6 there, 0.5 here\)"):
        run_tiny(shard_dir, straight, max_steps=STEPS + 1, global_batch_size=8, objective="meanflow",
                 mf_omega=0.5, mf_kappa=0.2, mf_t_end=0.9)


def test_meanflow_settings_are_validated():
    base = {"shards": "s", "run_dir": "r", "max_steps": 1}
    with pytest.raises(ConfigError) as e:
        merge_config({}, {**base, "mf_omega": 0.5}).validate()
    assert "--mf-omega act on the MeanFlow objectives: add --objective meanflow (or imf)" in str(e.value)
    with pytest.raises(ConfigError) as e:
        merge_config({}, {**base, "objective": "meanflow", "mf_omega": 0.5, "class_dropout_prob": 0.0,
                          "mf_t_start": 0.9, "mf_t_end": 0.1, "cosine_loss": True}).validate()
    msg = str(e.value)
    assert "MeanFlow's training guidance needs the null class" in msg
    assert "--mf-t-start and --mf-t-end must satisfy" in msg and "--cosine-loss act on the flow objective" in msg
    with pytest.raises(ConfigError, match="--jvp-attention"):
        merge_config({}, {**base, "objective": "meanflow", "jvp_attention": "flash"}).validate()
    # the flow samplers' settings are refused with the mean-flow sampler, never silently ignored
    sample = {"ckpt": "x.pt", "num_samples": 1, "npz": "x.npz", "sampler": "meanflow", "steps": 1}
    with pytest.raises(Exception, match=r"--time-shift shifts the flow samplers' time grid .* not --sampler meanflow"):
        SampleConfig(**sample, time_shift=3.0).validate()
    with pytest.raises(Exception, match=r"--flow-convention applies to flow models .* not to --sampler meanflow"):
        SampleConfig(**sample, flow_convention="repa").validate()
    SampleConfig(**sample).validate()


def test_the_plan_says_what_meanflow_trains():
    from dit_pipeline.train.plan import objective_line

    base = {"shards": "s", "run_dir": "r", "max_steps": 1}
    line = objective_line(merge_config({}, {**base, "objective": "meanflow", "mf_omega": 0.6, "mf_kappa": 0.2}))
    assert "meanflow (average velocity u(z, t, h = t - r); t, r logit-normal(-0.4, 1), r = t for 75% of each " \
           "step; guidance omega 0.6, kappa 0.2 for t in [0, 1]; JVP through math attention" in line
    line = objective_line(merge_config({}, {**base, "objective": "imf"}))
    assert "r = t for 50% of each step; omega drawn on [1, 8] and fed to the network" in line


def test_imf_trains_in_process_and_samples_with_its_guidance_as_inputs(shard_dir, tiny_vae_dir, tmp_path):
    """The release's iMF (its network, --model iMF-B/2 implying --objective imf): the checkpoint and the EMA file
    record it, both heads' terms are logged; dit-sample's --cfg-scale is the network's omega and --guidance-interval
    its interval (one evaluation per step, no doubled batch): other values, other pixels."""
    import json

    ck = run_tiny(shard_dir, tmp_path / "run", max_steps=3, global_batch_size=8, model="iMF-B/2", head_depth=1,
                  lr=1e-2)
    assert ck["objective"] == "imf" and ck["model_config"]["family"] == "iMF" and ck["model_config"]["v_head"]
    assert ck["meanflow"]["mf_s_max"] == 7.0 and "mf_kappa" not in ck["meanflow"]
    _, info = dit.load_dit_weights(tmp_path / "run" / "checkpoints" / "step-0000003-ema.pt")
    assert (info["objective"], info["meanflow"]) == ("imf", ck["meanflow"])
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["mse_v"] > 0 for r in logged if "loss" in r)
    base = dict(ckpt=str(tmp_path / "run"), vae=str(tiny_vae_dir), class_labels=[0, 1], quiet=True, steps=1,
                weights="model")  # 3 steps: the EMA has hardly moved from the zero-initialised gates
    outs = [np.load(run_sampling(SampleConfig(**base, cfg_scale=w, guidance_interval=iv,
                                              npz=str(tmp_path / f"{i}.npz"))).npz)["arr_0"]
            for i, (w, iv) in enumerate([(1.0, None), (6.0, None), (6.0, [0.0, 0.5])])]
    assert not np.array_equal(outs[0], outs[1]) and not np.array_equal(outs[1], outs[2])
    with pytest.raises(UserError, match="was trained with --objective imf, this run asks for --objective imf-adaln"):
        run_tiny(shard_dir, tmp_path / "run", max_steps=4, global_batch_size=8, objective="imf-adaln")


def test_our_imf_variant_is_its_own_objective():
    base = {"shards": "s", "run_dir": "r", "max_steps": 1}
    with pytest.raises(ConfigError) as e:
        merge_config({}, {**base, "model": "DiT-S/2", "objective": "imf"}).validate()
    assert ("--objective imf is the release's iMF, whose network is its own (an auxiliary v head, the conditions as "
            "in-context tokens): use --model iMF-B/2 (or M/2, L/2, XL/2), or --objective imf-adaln for this "
            "project's variant on a DiT") in str(e.value)
    with pytest.raises(ConfigError, match="iMF's network \\(--model iMF-\\*\\) trains with --objective imf, not flow"):
        merge_config({}, {**base, "model": "iMF-B/2", "objective": "flow"}).validate()
    merge_config({}, {**base, "model": "LightningDiT-B/1", "objective": "imf-adaln"}).validate()
