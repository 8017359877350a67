"""The first hour with dit-train: a default run length and loader-worker count that fit small shard sets
(said in the plan), a dry run that runs exactly the real run's checks (resume included) and a plan that says
where the run starts, and allowed setting changes on resume logged old -> new and kept in a config history."""
from __future__ import annotations

import json
import shutil

import pytest

from dit_pipeline.train.checkpoint import CheckpointManager
from dit_pipeline.train.config import TrainConfig
from dit_pipeline.train.plan import format_plan
from dit_pipeline.train.preflight import prepare, resolve_defaults
from tests.train.conftest import invoke_train as _invoke, tiny_args, two_step_run


def test_default_length_is_the_papers_and_said_in_the_plan(shard_dir, tmp_path):
    r = _invoke(tiny_args(shard_dir, tmp_path / "run",
                **{"max-steps": False, "num-workers": False, "dry-run": None}))
    assert r.exit_code == 0, r.output
    assert "length      max_steps 400000 -> 400,000 steps" in r.output
    assert ("(--max-steps and --epochs not given: the DiT paper's 400K steps; stop earlier with SIGTERM/SIGUSR1 "
            "(a checkpoint is written) or pass --max-steps)") in r.output
    assert "1 rank(s) x 4 loader worker(s) = 4" in r.output and "instead of 4" not in r.output
    assert not (tmp_path / "run").exists()


def test_fewer_workers_with_fewer_shards_per_rank(shard_dir, tmp_path):
    cfg = TrainConfig(shards=str(shard_dir), run_dir=str(tmp_path / "run"), model="DiT-S/2", depth=2,
                      hidden_size=32, num_heads=2, global_batch_size=8, micro_batch_size=4, epochs=1)
    prep = prepare(cfg, world_size=2)
    assert prep.cfg.num_workers == 2 and prep.layout.workers == 2 and prep.cfg.max_steps is None
    plan = format_plan(prep)
    assert "2 rank(s) x 2 loader worker(s) = 4" in plan
    assert ("(2 loader worker(s) per rank instead of 4: the set has 4 shard(s) for 2 rank(s), and each worker "
            "reads whole shards)") in plan and "400K" not in plan
    given, notes = resolve_defaults(TrainConfig(shards="s", run_dir="r", num_workers=0, max_steps=5), 1, 8)
    assert (given.num_workers, given.max_steps, notes) == (0, 5, {})
    one, notes = resolve_defaults(TrainConfig(shards="s", run_dir="r", max_steps=5), 3, 8)
    assert one.num_workers == 1 and "1 loader worker(s) per rank instead of 4" in notes["readers"]


@pytest.fixture(scope="module")
def two_steps(shard_dir, tmp_path_factory):
    return two_step_run(shard_dir, tmp_path_factory, "first-run")


def test_dry_run_runs_the_resume_checks_of_the_real_run(shard_dir, two_steps):
    ckpt = CheckpointManager(two_steps / "checkpoints").path(2)
    before = (two_steps / "config.json").read_bytes()
    outputs = []
    for dry in (True, False):
        r = _invoke(tiny_args(shard_dir, two_steps, **{"max-steps": 4, "num-workers": 0, "patch-size": 4,
                                                       "quiet": None, "dry-run": dry}))
        assert r.exit_code == 1, r.output
        outputs.append(r.output)
    assert outputs[0] == outputs[1]
    assert outputs[0].startswith(f"error: checkpoint {ckpt} is for a different model") and "patch_size" in outputs[0]
    assert (two_steps / "config.json").read_bytes() == before  # a refused resume changes nothing
    r = _invoke(tiny_args(shard_dir, two_steps, **{"max-steps": 2, "num-workers": 0, "dry-run": None}))
    assert r.exit_code == 0 and f"run dir     {two_steps}: would resume from {ckpt} (step 2)" in r.output


def test_allowed_changes_are_logged_and_kept(shard_dir, two_steps, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(two_steps, run)
    ckpt = CheckpointManager(run / "checkpoints").path(2)
    args = tiny_args(shard_dir, run, **{"max-steps": 3, "num-workers": 0, "quiet": None, "lr": 5e-4})
    r = _invoke([*args, "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "changed     since that checkpoint (allowed): max_steps 2 -> 3; lr 0.001 -> 0.0005" in r.output
    r = _invoke(args)
    assert r.exit_code == 0, r.output
    log = (run / "log.txt").read_text()
    assert f"run dir     {run}: resumes from {ckpt} (step 2)" in log
    assert (f"settings changed since {ckpt} (allowed; kept in {run / 'config-history.jsonl'}): max_steps 2 -> 3; "
            "lr 0.001 -> 0.0005") in log
    history = [json.loads(line) for line in (run / "config-history.jsonl").read_text().splitlines()]
    assert [(h["step"], h["changes"]) for h in history] == [
        (0, {}), (2, {"max_steps": [2, 3], "lr": [0.001, 0.0005]})]
    assert history[1]["config"] == json.loads((run / "config.json").read_text())
    assert history[1]["config"]["lr"] == 0.0005 and history[0]["config"]["lr"] == 0.001


def test_plan_says_the_ema_grids_of_a_short_run_show_early_weights(shard_dir, tmp_path, tiny_vae_dir):
    args = tiny_args(shard_dir, tmp_path / "run", **{"dry-run": None, "sample-every": 2, "vae": tiny_vae_dir})
    r = _invoke(args)
    assert r.exit_code == 0, r.output
    assert ("grids       every 2 steps, ema weights; the EMA (decay 0.9999) averages over ~10,000 steps and this "
            "run has 8, so its grids show barely trained weights: --sample-weights both adds grids of the raw "
            "weights") in r.output
    r = _invoke([*args, "--sample-weights", "both"])
    assert r.exit_code == 0 and "grids       every 2 steps, both weights\n" in r.output


def test_the_closing_line_gives_the_final_loss_and_the_speed(shard_dir, tmp_path):
    """The training summary ends with the last logged loss (all ranks' mean, as metrics.jsonl has it) and the
    images per second of the whole invocation."""
    import re

    from dit_pipeline.train.metrics import read_metrics

    run = tmp_path / "run"
    r = _invoke(tiny_args(shard_dir, run, **{"max-steps": 4, "num-workers": 0, "log-every": 3, "quiet": None}))
    assert r.exit_code == 0, r.output
    last = [row for row in read_metrics(run) if "loss" in row][-1]
    assert last["step"] == 4  # the final step is always logged
    closing = (run / "log.txt").read_text().rstrip().splitlines()[-1]
    m = re.search(r" INFO finished at step 4 \(epoch 0\) after ([\d.]+)s: final loss (\S+) \(step 4\), ([\d.]+) "
                  r"images/s; newest checkpoint (\S+)$", closing)
    assert m, closing
    assert m.group(2) == f"{last['loss']:.4f}" and m.group(4) == str(run / "checkpoints" / "step-0000004.pt")
    # 4 steps of 8 images in the wall time shown: both numbers are rounded to 0.1, so the time must lie in the
    # interval the rounded speed allows (on a loaded machine the speed is small and its rounding dominates)
    seconds, speed = float(m.group(1)), float(m.group(3))
    assert 4 * 8 / (speed + 0.05) - 0.05 <= seconds <= 4 * 8 / (speed - 0.05) + 0.05, closing
