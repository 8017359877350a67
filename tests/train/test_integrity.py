"""The trainer's sha256 check of each shard against the manifest, end to end: a flipped byte inside a latent
payload (every value still finite, so the per-sample checks pass) stops the run naming the shard and saying
that none of its samples were used; --skip-bad-shards skips it from then on (one warning, one count, epochs
stay passes over the remaining shards); --no-verify-shards trains on it."""
from __future__ import annotations

import shutil

import pytest
import torch
from click.testing import CliRunner

from dit_pipeline.cli import train_main
from dit_pipeline.train.metrics import read_metrics
from tests.shards.test_sha256_check import flip_payload_byte
from tests.train.conftest import tiny_args


def _invoke(args):
    return CliRunner().invoke(train_main, [str(a) for a in args])


@pytest.fixture(scope="module")
def damaged(shard_dir, tmp_path_factory):
    shards = tmp_path_factory.mktemp("damaged") / "shards"
    shutil.copytree(shard_dir, shards)
    flip_payload_byte(shards / "shard-000002.tar")
    return shards


def test_a_flipped_byte_stops_the_run_naming_the_shard(damaged, tmp_path):
    args = tiny_args(damaged, tmp_path / "run", **{"max-steps": 3, "num-workers": 0, "quiet": None})
    r = _invoke([*args, "--dry-run"])
    assert r.exit_code == 0 and ("integrity   each shard's sha256 checked against the manifest before its "
                                 "samples are used (0.00 GiB of whole shards per node)") in r.output
    r = _invoke(args)
    assert r.exit_code == 1, r.output
    assert r.output.startswith("error: rank 0 cannot read its data at step 1: shard ")
    assert (f"shard {damaged / 'shard-000002.tar'}: sha256 mismatch: the file hashes to ") in r.output
    assert ("for shard-000002.tar (changed or damaged since extraction); none of its samples were used. Run "
            "`dit-shards verify`") in r.output
    assert r.output.endswith("(or pass --skip-bad-shards to skip unreadable shards)\n")
    r = _invoke([*args[:3], tmp_path / "unchecked", *args[4:], "--no-verify-shards"])
    assert r.exit_code == 0, r.output  # without the hash the damaged value is trained on silently
    r = _invoke([*args, "--no-verify-shards", "--dry-run"])
    assert "integrity   sha256 check of the shards off (--no-verify-shards)" in r.output


def test_streaming_check_when_whole_shards_would_not_fit(damaged, tmp_path, monkeypatch):
    from dit_pipeline.train import preflight
    monkeypatch.setattr(preflight, "host_memory_available", lambda: 1e-9)  # GiB: nothing fits
    args = tiny_args(damaged, tmp_path / "run", **{"max-steps": 3, "num-workers": 0, "quiet": None})
    r = _invoke([*args, "--dry-run"])
    assert r.exit_code == 0 and "integrity   each shard's sha256 checked against the manifest as it streams" in r.output
    r = _invoke(args)
    assert r.exit_code == 1, r.output
    assert "shard-000002.tar: sha256 mismatch" in r.output and ("all 16 of its samples were already read (a check as the shard streams comes at its end)"
                                                              in r.output)


def test_skip_bad_shards_warns_once_counts_once_and_keeps_epochs(damaged, tmp_path):
    run = tmp_path / "run"
    r = _invoke(tiny_args(damaged, run, **{"max-steps": 15, "num-workers": 0, "quiet": None, "ckpt-every": 15,
                                           "skip-bad-shards": None}))
    assert r.exit_code == 0, r.output
    log = (run / "log.txt").read_text()
    assert log.count("skipping shard-000002.tar from now on") == 1
    assert ("skipping shard-000002.tar from now on (--skip-bad-shards; 1 distinct shard(s) skipped): shard "
            in log) and "none of its samples were used" in log
    recs = read_metrics(run)
    assert [r["bad_shards"] for r in recs] == [1] * 15
    # 44 good samples and 8 per step: every epoch is 5 steps (epoch 0 met the bad shard at its start)
    assert [r["epoch"] for r in recs] == [0] * 5 + [1] * 5 + [2] * 5
    ckpt = torch.load(run / "checkpoints" / "step-0000015.pt", map_location="cpu", weights_only=False)
    assert ckpt["data"]["bad_shards"] == 1 and ckpt["data"]["bad_shard_names"] == ["shard-000002.tar"]
