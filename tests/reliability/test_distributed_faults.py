"""Several ranks (2, gloo, under torchrun): a rank dies and the other stops within a bounded time, non-zero,
with one clear line, while torchrun's summary names the dead rank; rerunning finishes exactly as an
uninterrupted run. Resuming a training run with another world size is allowed only with the same global
batch, and says so. tests/train/test_distributed.py covers a rank exiting after step 2 and a 2 -> 1 resume
of a finished run; tests/extract/test_processes.py a dead extraction rank then one process.

The bound is the subprocess timeout (harness.TIMEOUT_S): a survivor that waited for the dead rank forever
would fail the test instead of hanging it.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.extract.conftest import cli_args
from tests.reliability.conftest import sample_args, train_args
from tests.reliability.harness import SWEEP, assert_clean_error, file_hashes, run
from tests.reliability.test_extract_faults import assert_same_as_uninterrupted as same_shards
from tests.reliability.test_sample_faults import assert_same_as_uninterrupted as same_samples
from dit_pipeline.train.checkpoint import CheckpointManager, load_checkpoint
from dit_pipeline.train.metrics import read_metrics

DDP = {"max-steps": 4, "num-workers": 1, "micro-batch-size": 2}   # global 8 = 2 ranks x 2 x accum 2


def assert_named(r, dead: int, survivor: int) -> None:
    """torchrun names the dead rank as the root cause; the survivor exits with one line, no traceback."""
    assert r.rc != 0
    root = r.err[r.err.index("Root Cause"):]
    assert re.search(rf"rank\s+: {dead} \(local_rank: {dead}\)", root), root
    assert f"[rank{survivor}]: Traceback" not in r.err, r.err[-4000:]
    # ... or torchrun stopped the survivor first (torch 2.6's torchrun says so only in its own log line; later
    # ones also list the survivor's exit code -15 under Failures)
    assert (f"[rank {survivor}] error: rank {survivor}: " in r.err and "another rank died" in r.err
            or "closing signal SIGTERM" in r.err), r.err[-4000:]


@pytest.fixture(scope="module")
def ddp_base(train_shards, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("rel-ddp") / "run"
    assert run("dit-train", train_args(train_shards, run_dir, **DDP), nproc=2).rc == 0
    return run_dir


def _same_ddp_run(run_dir: Path, base: Path) -> None:
    keys = ("step", "loss", "mse", "vb", "grad_norm")
    recs = [tuple(r[k] for k in keys) for r in read_metrics(run_dir)]
    assert [r[0] for r in recs] == [1, 2, 3, 4]
    assert recs == [tuple(r[k] for k in keys) for r in read_metrics(base)]
    a = load_checkpoint(CheckpointManager(run_dir / "checkpoints").latest())
    b = load_checkpoint(CheckpointManager(base / "checkpoints").latest())
    assert a["step"] == b["step"] == 4
    assert all(torch.equal(a[k][n], b[k][n]) for k in ("model", "ema") for n in b[k])


@pytest.mark.parametrize("fault, dead", [
    pytest.param("train.ckpt_mid_save@1:kill", 0, marks=SWEEP),             # rank 0 dies inside a save
    pytest.param("train.step_end@3:kill", 1, marks=SWEEP),                  # between two checkpoints
    pytest.param("train.ckpt_saved@1:exit", 0, marks=SWEEP),                # right after a save, crashed
    pytest.param("train.step_end@1:exit", 0, marks=SWEEP),                  # before any checkpoint
])
def test_training_rank_dies(train_shards, ddp_base, tmp_path, fault, dead):
    run_dir = tmp_path / "run"
    args = train_args(train_shards, run_dir, **DDP)
    r = run("dit-train", args, nproc=2, fault=fault, rank=dead)
    assert_named(r, dead, 1 - dead)
    ckpts = CheckpointManager(run_dir / "checkpoints")
    if ckpts.steps():
        assert load_checkpoint(ckpts.latest())["step"] == ckpts.steps()[-1]
    assert run("dit-train", args, nproc=2).rc == 0
    _same_ddp_run(run_dir, ddp_base)


@pytest.mark.determinism
@pytest.mark.parametrize("fault, dead, rerun_nproc", [
    ("shards.mid_sample@2:kill", 1, 2),
    pytest.param("extract.shard_done@1:exit", 0, 1, marks=SWEEP),
    pytest.param("extract.before_manifest@1:kill", 0, 2, marks=SWEEP),    # rank 0, with every shard done
])
def test_extraction_rank_dies(images, tiny_vae_dir, extract_base, tmp_path, fault, dead, rerun_nproc):
    out = tmp_path / "out"
    args = cli_args(images, tiny_vae_dir, out)
    r = run("dit-extract", args, nproc=2, fault=fault, rank=dead)
    assert_named(r, dead, 1 - dead)
    assert not (out / "manifest.json").exists()
    assert run("dit-extract", args, nproc=rerun_nproc).rc == 0
    same_shards(out, *extract_base)


@SWEEP
@pytest.mark.parametrize("fault, dead, rerun_nproc", [("sample.part_written@1:kill", 1, 2),
                                                      ("sample.part_write@2:exit", 0, 1)])
def test_sampling_rank_dies(sample_ckpt, tiny_vae_dir, sample_base, tmp_path, fault, dead, rerun_nproc):
    npz = tmp_path / "s.npz"
    args = sample_args(sample_ckpt, tiny_vae_dir, npz)
    r = run("dit-sample", args, nproc=2, fault=fault, rank=dead)
    assert_named(r, dead, 1 - dead)
    assert run("dit-sample", args, nproc=rerun_nproc).rc == 0
    same_samples(npz, sample_base)


@SWEEP
@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_resume_with_another_world_size(train_shards, tmp_path, before, after):
    run_dir = tmp_path / "run"
    args = train_args(train_shards, run_dir, **DDP)
    r = run("dit-train", args, nproc=before, fault="train.step_end@3:kill")  # every rank dies after step 3
    assert r.rc != 0 and CheckpointManager(run_dir / "checkpoints").steps() == [2]
    snapshot = file_hashes(run_dir / "checkpoints")
    # another global batch is refused before anything changes
    bigger = train_args(train_shards, run_dir, **{**DDP, "global-batch-size": 16})
    assert_clean_error(run("dit-train", bigger),
                       "trained with --global-batch-size 8, this run asks for 16")
    assert file_hashes(run_dir / "checkpoints") == snapshot
    r = run("dit-train", args, nproc=after)
    assert r.rc == 0, r.err[-3000:]
    log = (run_dir / "log.txt").read_text()
    assert f"resuming with a different data layout (world_size {before} -> {after}" in log
    assert "no longer identical" in log and "resumed from" in log and "at step 2" in log
    assert [rec["step"] for rec in read_metrics(run_dir)] == [1, 2, 3, 4]     # each step once
    last = load_checkpoint(CheckpointManager(run_dir / "checkpoints").latest())
    assert last["step"] == 4 and last["data"]["world_size"] == after and last["config"]["global_batch_size"] == 8
