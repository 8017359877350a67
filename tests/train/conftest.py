"""Fixtures of the trainer tests: small synthetic shard sets (session-scoped, shared by all tests) and the
arguments of a tiny DiT run (depth 2, hidden 32, 4x8x8 latents)."""
from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from dit_pipeline.cli import train_main

from tests.train.helpers import make_shard_set

# 4 shards of unequal size (60 samples); with 3 loader workers and global batch 8 (micro 4 x 2) an epoch
# has 6 optimizer steps, so an 8-step run crosses an epoch boundary.
SHARD_SIZES = (16, 16, 16, 12)


@pytest.fixture(scope="session")
def shard_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("train-shards") / "shards"
    make_shard_set(folder, samples=SHARD_SIZES, latent_shape=(4, 8, 8))
    return folder


def tiny_args(shards, run_dir, **overrides) -> list[str]:
    """dit-train arguments of the tiny test model; overrides as {"max-steps": 8, "quiet": None (flag)}."""
    opts = {"shards": shards, "run-dir": run_dir, "model": "DiT-S/2", "depth": 2, "hidden-size": 32,
            "num-heads": 2, "max-steps": 8, "global-batch-size": 8, "micro-batch-size": 4, "num-workers": 3,
            "log-every": 1, "ckpt-every": 2, "lr": 1e-3}
    opts.update(overrides)
    args = []
    for k, v in opts.items():
        if v is False:
            continue
        args += [f"--{k}"] if v is None or v is True else [f"--{k}", str(v)]
    return args


# The same tiny model as a TrainConfig mapping, for in-process `train.run` (no loader workers, quiet).
TINY_CONFIG = {"model": "DiT-S/2", "depth": 2, "hidden_size": 32, "num_heads": 2, "num_workers": 0, "quiet": True,
               "log_every": 1, "lr": 1e-3}


def run_tiny(shards, run_dir, **overrides) -> dict:
    """Train the tiny model in process to the end (`train.run` returns "done"); its newest checkpoint."""
    from dit_pipeline.train import merge_config, run
    from dit_pipeline.train.checkpoint import CheckpointManager, load_checkpoint

    cfg = merge_config({}, {"shards": str(shards), "run_dir": str(run_dir), **TINY_CONFIG, **overrides})
    assert run(cfg) == "done"
    return load_checkpoint(CheckpointManager(Path(run_dir) / "checkpoints").latest())


def invoke_train(args, env=None):
    """dit-train in process (click's runner)."""
    return CliRunner().invoke(train_main, [str(a) for a in args], env=env)


def two_step_run(shard_dir, tmp_path_factory, name: str):
    """A finished 2-step run folder (in process, no loader workers) to resume from or inspect."""
    run_dir = tmp_path_factory.mktemp(name) / "run"
    r = invoke_train(tiny_args(shard_dir, run_dir, **{"max-steps": 2, "num-workers": 0, "quiet": None}))
    assert r.exit_code == 0, r.output
    return run_dir
