"""A data mix trained sharded (issues 45 and 46 together): 2 ranks of FSDP2 (gloo, CPU) through the CLI on a
two-source mix, killed with SIGKILL mid-epoch and resumed on 2 ranks (the same losses, samples and weights as the
uninterrupted sharded run, bit for bit) and on 1 rank (every later step trains on the uninterrupted run's global
batch, so the epoch's multiset of (source, key) pairs is the same and no key of the single-pass source is seen twice).
The promises of a DDP run on one shard set (tests/train/test_resume.py, test_distributed.py) hold for both at once."""
from __future__ import annotations

import shutil
from collections import Counter

import pytest
import torch

from dit_pipeline.train import merge_config, run
from dit_pipeline.train.checkpoint import CheckpointManager, load_checkpoint, materialize
from tests._util import run_cli
from tests.train.helpers import make_shard_set
from tests.train.test_mix_training import MODEL, keys_by_step, train_records

pytestmark = pytest.mark.skipif(
    __import__("dit_pipeline.common.sharding", fromlist=["x"]).sharding_problem() is not None,
    reason="the sharded modes need torch 2.9+")


def sharded_mix_args(sets, run_dir):
    opts = {**MODEL, "run-dir": run_dir, "global-batch-size": 8, "micro-batch-size": 2, "num-workers": 1,
            "epochs": 1, "log-every": 1, "ckpt-every": 2, "record-keys": None, "mix-lanes": 2, "parallel": "fsdp"}
    args = ["--source", f"{sets}/a proportion=0.6", "--source", f"{sets}/b proportion=0.4"]
    for k, v in opts.items():
        args += [f"--{k}"] if v is None else [f"--{k}", str(v)]
    return args


def _state(path):
    """A sharded checkpoint's content with every tensor read whole, offline."""
    return materialize(load_checkpoint(path), path, {}, collective=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix-sharded")
    make_shard_set(root / "a", samples=(16, 16, 16, 16))
    make_shard_set(root / "b", samples=(10, 10), seed=1)
    straight = root / "s2"
    r = run_cli("dit-train", ["--nproc-per-node", "2", *sharded_mix_args(root, straight)], timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    killed = root / "r2"
    r = run_cli("dit-train", ["--nproc-per-node", "2", *sharded_mix_args(root, killed)],
                env={"DIT_FAULT": "train.step_end@3:kill"}, timeout=900)
    assert r.returncode != 0 and CheckpointManager(killed / "checkpoints").steps() == [2], r.stderr[-2000:]
    one = root / "r1"
    shutil.copytree(killed, one)
    r = run_cli("dit-train", ["--nproc-per-node", "2", *sharded_mix_args(root, killed)], timeout=900)
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr[-3000:]
    # on 1 rank, in this process: the same settings, both lanes now read by rank 0, still FSDP (a mesh of one)
    cfg = {**{k.replace("-", "_"): v for k, v in MODEL.items()}, "run_dir": str(one), "global_batch_size": 8,
           "micro_batch_size": 8, "num_workers": 0, "epochs": 1, "log_every": 1, "ckpt_every": 2,
           "record_keys": True, "quiet": True, "parallel": "fsdp", "mix_lanes": 2,
           "source": [f"{root}/a proportion=0.6", f"{root}/b proportion=0.4"]}
    assert run(merge_config({}, cfg)) == "done"
    return {"s2": straight, "r2": killed, "r1": one}


@pytest.mark.determinism
def test_a_sharded_mix_killed_and_resumed_on_two_ranks_is_the_uninterrupted_run(runs):
    s2, r2 = runs["s2"], runs["r2"]
    assert len(train_records(s2)) >= 6 and train_records(r2) == train_records(s2)  # every logged value, exactly
    assert keys_by_step(r2) == keys_by_step(s2)
    a, b = (_state(CheckpointManager(d / "checkpoints").latest()) for d in (s2, r2))
    assert str(CheckpointManager(s2 / "checkpoints").latest()).endswith(".dcp")  # a sharded checkpoint
    for key in ("model", "ema"):
        assert a[key].keys() == b[key].keys() and all(torch.equal(a[key][n], b[key][n]) for n in a[key]), key
    assert a["mix"]["seen"] == b["mix"]["seen"]


def test_a_sharded_mix_resumed_on_one_rank_continues_its_global_sequence(runs):
    s2, r1 = runs["s2"], runs["r1"]
    assert "the mix's global sample sequence continues where it stopped" in (r1 / "log.txt").read_text()
    straight, resumed = keys_by_step(s2), keys_by_step(r1)  # rank 1: the steps before the resume
    assert sorted(resumed) == sorted(straight)
    for step in straight:  # each step's global batch, across the change of world size
        assert resumed[step] == straight[step], step
    epoch = Counter(p for ps in resumed.values() for p in ps)
    assert epoch == Counter(p for ps in straight.values() for p in ps)
    assert max(n for (s, _), n in epoch.items() if s == 0) == 1  # source a: one pass, no key twice
