"""The trainer's sha256 check of each shard against the manifest, end to end: a flipped byte inside a latent
payload (every value still finite, so the per-sample checks pass) stops the run naming the shard and saying
that none of its samples were used; --no-verify-shards trains on it."""
from __future__ import annotations

import shutil

import pytest
from click.testing import CliRunner

from dit_pipeline.cli import train_main
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
