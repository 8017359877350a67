"""TrainConfig validation (all problems at once), batch arithmetic with suggestions, config files and merging."""
from __future__ import annotations

import json

import pytest

from dit_pipeline.common.errors import ConfigError, UserError
from dit_pipeline.train.batch import batch_plan
from dit_pipeline.train.config import TrainConfig
from dit_pipeline.train.config_file import load_config_file, merge_config


def test_defaults_are_the_reference_recipe():
    c = TrainConfig(shards="s", run_dir="r", max_steps=10)
    c.validate()
    assert (c.lr, c.weight_decay, c.adam_beta1, c.adam_beta2) == (1e-4, 0.0, 0.9, 0.999)
    assert (c.global_batch_size, c.ema_decay, c.class_dropout_prob, c.seed) == (256, 0.9999, 0.1, 0)
    assert (c.warmup_steps, c.grad_clip, c.resume, c.keep_last) == (0, None, "auto", 3)


def test_validate_reports_every_problem():
    c = TrainConfig(shards="", run_dir="r", lr=0, global_batch_size=0, ema_decay=1.5, precision="fp8",
                    model="DiT-Q/2", num_workers=-1, grad_clip=-1.0)
    with pytest.raises(ConfigError) as e:
        c.validate()
    msg = str(e.value)
    for part in ("--shards is required", "--lr must be > 0",
                 "--global-batch-size must be a positive integer", "--ema-decay must be in [0, 1]",
                 "--precision must be one of", "--model: unknown DiT model", "--num-workers must be >= 0",
                 "--grad-clip must be > 0"):
        assert part in msg, part
    assert len(e.value.problems) == 8  # a missing length is not a problem: the default is 400K steps


def test_batch_plan_splits_exactly():
    b = batch_plan(256, 16, 8)
    assert (b.micro_batch, b.accum, b.per_rank) == (16, 2, 32)
    assert batch_plan(256, None, 8).accum == 1
    assert batch_plan(6, 1, 3).accum == 2


def test_indivisible_global_batch_explains_the_arithmetic():
    with pytest.raises(ConfigError) as e:
        batch_plan(250, None, 8)
    msg = str(e.value)
    assert "--global-batch-size 250 is not divisible by the world size 8 (250 / 8 = 31.25)" in msg
    assert "e.g. 248 or 256" in msg


def test_micro_batch_must_divide_the_per_rank_batch():
    with pytest.raises(ConfigError) as e:
        batch_plan(256, 12, 8)
    msg = str(e.value)
    assert "--micro-batch-size 12 does not divide the per-rank batch 32 (= global batch 256 / 8 ranks)" in msg
    assert "valid micro-batch sizes: 1, 2, 4, 8, 16, 32" in msg
    with pytest.raises(ConfigError, match="is larger than the per-rank batch 32"):
        batch_plan(256, 64, 8)


def test_config_file_yaml_and_json(tmp_path):
    y = tmp_path / "run.yaml"
    y.write_text("shards: /data/shards\nrun-dir: runs/a\nmax_steps: 100\nlr: 0.0003\ncompile: true\n")
    assert load_config_file(y) == {"shards": "/data/shards", "run_dir": "runs/a", "max_steps": 100,
                                   "lr": 0.0003, "compile": True}
    j = tmp_path / "run.json"
    j.write_text(json.dumps({"shards": "x", "run_dir": "y", "epochs": 2}))
    assert load_config_file(j)["epochs"] == 2
    # flags override the file; unset fields keep the dataclass default
    cfg = merge_config(load_config_file(y), {"lr": 1e-4})
    assert (cfg.lr, cfg.max_steps, cfg.compile, cfg.global_batch_size) == (1e-4, 100, True, 256)


def test_config_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("shards: x\nlearning_rate: 1\nbatch: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config_file(bad)
    assert "unknown setting 'batch'" in str(e.value) and "unknown setting 'learning_rate'" in str(e.value)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(UserError, match="cannot parse"):
        load_config_file(broken)
    lst = tmp_path / "list.yaml"
    lst.write_text("- a\n- b\n")
    with pytest.raises(UserError, match="expected a mapping"):
        load_config_file(lst)
    with pytest.raises(UserError, match="no such file"):
        load_config_file(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="--run-dir is required"):
        merge_config({"shards": "x"}, {})


def test_launcher_command_strips_its_flag():
    from dit_pipeline.train.launch import launch_command, strip_launcher_flag

    args = ["--shards", "s", "--nproc-per-node", "8", "--nproc_per_node=2", "--run-dir", "r"]
    assert strip_launcher_flag(args) == ["--shards", "s", "--run-dir", "r"]
    cmd = launch_command(4, args)
    assert cmd[1:5] == ["-m", "dit_pipeline.train.torchrun", "--standalone", "--nproc-per-node=4"]
    assert cmd[5].endswith("dit-train") and cmd[6:] == ["--shards", "s", "--run-dir", "r"]
