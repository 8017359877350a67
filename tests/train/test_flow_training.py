"""Training with --objective flow and the block options: it learns the class-conditional data (Heun samples
land nearest their own class), the micro-batch split does not change the run, two ranks hold identical
weights, the checkpoint and its EMA sidecar record the objective, and mismatches are clear errors."""
from __future__ import annotations

import json

import pytest
import torch

from dit_pipeline import dit
from dit_pipeline.common.errors import ConfigError, UserError
from dit_pipeline.train import merge_config
from dit_pipeline.train.checkpoint import CheckpointManager, load_checkpoint
from dit_pipeline.train.metrics import read_metrics
from tests._util import run_cli
from tests.train.conftest import run_tiny, tiny_args
from tests.train.helpers import class_mean, make_shard_set

OPTIONS = {"qk_norm": True, "rms_norm": True, "swiglu": True, "rope": True}



def test_flow_learns_a_two_class_dataset(tmp_path):
    shards = tmp_path / "shards"
    make_shard_set(shards, samples=[32] * 4, scaling_factor=1.0, pattern="constant")  # classes at +1 / -1
    ck = run_tiny(shards, tmp_path / "run", hidden_size=64, num_heads=4, max_steps=200, global_batch_size=16,
              lr=3e-3, ema_decay=0.9, log_every=10, ckpt_every=1000, shuffle_buffer=64, objective="flow",
              t_sampling="logit-normal")
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert sum(losses[-3:]) / 3 < 0.5 * losses[0]
    model = dit.model_from_config(ck["model_config"])
    model.load_state_dict(ck["ema"])
    model.eval()
    means = torch.stack([torch.from_numpy(class_mean(c, (4, 8, 8), "constant")) for c in (0, 1)])
    fm = dit.create_flow()
    for label in (0, 1):
        noise = torch.randn(16, 4, 8, 8, generator=torch.Generator().manual_seed(label))
        x = fm.sample_loop(model, noise, sampler="heun", steps=10, model_kwargs={"y": torch.full((16,), label)})
        own = ((x - means[label]) ** 2).mean(dim=(1, 2, 3)).sqrt()
        other = ((x - means[1 - label]) ** 2).mean(dim=(1, 2, 3)).sqrt()
        assert own.mean() < 0.6 * other.mean() and (own < other).float().mean() >= 0.75, (label, own, other)


def test_flow_with_options_accumulation_matches_one_big_batch_and_is_recorded(shard_dir, tmp_path):
    kw = dict(max_steps=3, global_batch_size=8, objective="flow", t_sampling="logit-normal", t_mean=-0.3,
              t_scale=0.8, **OPTIONS)
    a = run_tiny(shard_dir, tmp_path / "a", micro_batch_size=4, **kw)
    b = run_tiny(shard_dir, tmp_path / "b", micro_batch_size=8, **kw)
    for x, y in zip(read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5) and "vb" not in x  # flow has no vb term
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-5, atol=1e-6)
    assert a["objective"] == "flow" and a["config"]["t_sampling"] == "logit-normal"
    mc = a["model_config"]
    assert mc["learn_sigma"] is False and all(mc[k] is True for k in OPTIONS)
    side = json.loads((tmp_path / "a" / "checkpoints" / "step-0000003-ema.json").read_text())
    assert side["objective"] == "flow" and side["model_config"] == mc
    _, info = dit.load_dit_weights(tmp_path / "a" / "checkpoints" / "step-0000003-ema.pt")
    assert info["objective"] == "flow" and all(info["model_config"][k] for k in OPTIONS)


def test_ddpm_default_checkpoint_records_ddpm_and_resume_refuses_another_objective(shard_dir, tmp_path):
    ck = run_tiny(shard_dir, tmp_path / "r", max_steps=1, global_batch_size=8)
    assert ck["objective"] == "ddpm" and ck["model_config"]["learn_sigma"] is True
    assert not {"qk_norm", "rms_norm", "swiglu", "rope"} & set(ck["model_config"])
    with pytest.raises(UserError, match="was trained with --objective ddpm, this run asks for --objective flow"):
        run_tiny(shard_dir, tmp_path / "r", max_steps=2, global_batch_size=8, objective="flow")
    with pytest.raises(UserError, match=r"is for a different model .*rope: checkpoint None, this run True"):
        run_tiny(shard_dir, tmp_path / "r", max_steps=2, global_batch_size=8, rope=True)  # no parameters to differ


def test_objective_settings_are_validated():
    base = {"shards": "s", "run_dir": "r", "max_steps": 1}
    with pytest.raises(ConfigError) as e:
        merge_config({}, {**base, "t_sampling": "logit-normal", "t_scale": 0.0}).validate()
    msg = str(e.value)
    assert "--t-sampling, --t-mean and --t-scale choose flow training times: add --objective flow" in msg
    assert "--t-scale must be > 0, got 0.0" in msg


def test_two_ranks_train_a_flow_model_with_grids(shard_dir, tiny_vae_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = tiny_args(shard_dir, run_dir, **{"max-steps": 2, "num-workers": 1, "micro-batch-size": 2,
                                            "objective": "flow", "qk-norm": True, "sample-every": 2,
                                            "vae": tiny_vae_dir, "sample-steps": 5, "sample-classes": "0,1"})
    r = run_cli("dit-train", ["--nproc-per-node", "2", *args], timeout=900)  # a hang guard only
    assert r.returncode == 0, r.stderr[-3000:]
    prints = [{x["step"]: x["weights_fingerprint"] for x in read_metrics(run_dir / "logs" / f"rank{k}.jsonl")
               if "weights_fingerprint" in x} for k in (0, 1)]
    assert prints[0] == prints[1] and sorted(prints[0]) == [2]
    assert (run_dir / "samples" / "step-0000002.png").is_file()
    assert load_checkpoint(CheckpointManager(run_dir / "checkpoints").latest())["objective"] == "flow"


def test_plan_says_what_the_model_learns():
    from dit_pipeline.train.config import TrainConfig
    from dit_pipeline.train.plan import objective_line

    assert objective_line(TrainConfig(shards="s", run_dir="r")) == (
        "  objective   ddpm (DiT: noise prediction + learned variance, 1000-step linear schedule); blocks as in DiT")
    cfg = TrainConfig(shards="s", run_dir="r", objective="flow", t_sampling="logit-normal", t_mean=-0.5,
                      qk_norm=True, swiglu=True)
    assert objective_line(cfg) == ("  objective   flow (linear interpolant, velocity prediction; training times "
                                   "logit-normal (mean -0.5, scale 1)); blocks qk-norm, swiglu")
    assert objective_line(TrainConfig(shards="s", run_dir="r", objective="flow")).startswith(
        "  objective   flow (linear interpolant, velocity prediction; training times uniform); blocks as in DiT")


def test_a_sit_model_name_trains_the_flow_objective_and_the_plan_says_so(shard_dir, tmp_path):
    """`--model SiT-S/2` is DiT-S/2 trained as SiT trains it (flow), as dit-sample reads SiT- names; an explicit
    `--objective ddpm` contradicts the name and is refused."""
    base = {"shards": "s", "run_dir": "r", "max_steps": 1}
    cfg = merge_config({}, {**base, "model": "SiT-S/2"})
    assert cfg.objective == "flow"
    assert merge_config({"model": "sit-xl/2"}, base).objective == "flow"   # from a config file, any spelling
    assert merge_config({}, {**base, "model": "DiT-S/2"}).objective == "ddpm"
    with pytest.raises(ConfigError) as e:
        merge_config({}, {**base, "model": "SiT-S/2", "objective": "ddpm"}).validate()
    assert ("--model SiT-S/2 names SiT, a flow model (dit-sample samples SiT- files as flow), which --objective ddpm "
            "contradicts: drop --objective (a SiT- name implies flow) or use --model DiT-S/2 for DiT's ddpm "
            "objective") in str(e.value)
    ck = run_tiny(shard_dir, tmp_path / "run", model="SiT-S/2", max_steps=1, global_batch_size=8)
    assert ck["objective"] == "flow" and ck["config"]["objective"] == "flow"
    assert ck["model_config"]["learn_sigma"] is False
    assert ("objective   flow (as --model SiT-S/2 implies; linear interpolant, velocity prediction; training times "
            "uniform); blocks as in DiT") in (tmp_path / "run" / "log.txt").read_text()
