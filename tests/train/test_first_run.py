"""The first hour with dit-train: a default run length and loader-worker count that fit small shard sets,
both said in the plan."""
from __future__ import annotations

from click.testing import CliRunner

from dit_pipeline.cli import train_main
from dit_pipeline.train.config import TrainConfig
from dit_pipeline.train.preflight import format_plan, prepare, resolve_defaults
from tests.train.conftest import tiny_args


def test_default_length_is_the_papers_and_said_in_the_plan(shard_dir, tmp_path):
    r = CliRunner().invoke(train_main, [str(a) for a in tiny_args(
        shard_dir, tmp_path / "run", **{"max-steps": False, "num-workers": False, "dry-run": None})])
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
