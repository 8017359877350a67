"""dit-extract killed at any moment, then rerun: finished shards kept (same inode, recorded hash), partial ones
redone, the result byte-identical to the uninterrupted run, every image exactly once (stored or skipped).

Fault points of one single-process run over the 15-image tree (10 usable images -> 10 samples in 4 shards):
inside a sample's bytes (`shards.mid_sample`), after a sample (`extract.sample_written`), between a shard's
fsync and its rename (`shards.before_rename`), between the rename and the state file
(`extract.shard_renamed`), after a shard (`extract.shard_done`), before the manifest
(`extract.before_manifest`). The sweep kills at every kind of point (seeded occurrences of each, or all 32
points with DIT_RELIABILITY_EXHAUSTIVE=1), by SIGKILL and SIGTERM, and chains several kills per run.
tests/extract/test_processes.py covers shard_done@1, sample_written@6 and shard_renamed@2 already.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from dit_pipeline.extract.state import finished_shard
from dit_pipeline.shards import read_manifest, sample_key, shard_name, verify_shards
from tests.extract.conftest import cli_args, read_samples, shard_hashes
from tests.reliability.harness import SWEEP, picks, run, sweep_points, temp_files

IMAGES, SAMPLES, SHARDS = 15, 10, 4
KINDS = {"shards.mid_sample": SAMPLES, "extract.sample_written": SAMPLES, "shards.before_rename": SHARDS,
         "extract.shard_renamed": SHARDS, "extract.shard_done": SHARDS - 1,   # @4 (the last) = before_manifest
         "extract.before_manifest": 1}
POINTS = [f"{kind}@{n}" for kind, count in KINDS.items() for n in range(1, count + 1)]
# every kind of point, at 3 (per sample) or 2 (per shard) seeded occurrences
SWEPT = [p for i, (kind, count) in enumerate(KINDS.items())
         for p in sweep_points(i, [f"{kind}@{n}" for n in range(1, count + 1)], 3 if count == SAMPLES else 2)]
SUBSET = {"shards.mid_sample@5"}


def assert_same_as_uninterrupted(out: Path, base_out: Path, base_hashes: dict) -> None:
    assert shard_hashes(out) == base_hashes                                   # byte for byte
    a, b = read_manifest(out), read_manifest(base_out)
    assert (a.shards, a.skipped, a.total_samples) == (b.shards, b.skipped, b.total_samples)
    assert a.fingerprint() == b.fingerprint()
    assert temp_files(out) == []
    keys = sorted(read_samples(out))                                          # raises on a duplicate key
    skipped = sorted(s["key"] for s in a.skipped)
    assert sorted(keys + skipped) == [sample_key(i) for i in range(IMAGES)]   # nothing lost, nothing twice
    assert verify_shards(out, progress=False).ok


def _finished(out: Path) -> dict[str, int]:
    """name -> inode of the shards an interrupted run finished (state file + recorded size and hash)."""
    return {shard_name(i): (out / shard_name(i)).stat().st_ino for i in range(SHARDS)
            if finished_shard(out, i) is not None}


def _kill_and_rerun(images, vae, out, faults: list[str], action: str = "kill"):
    """Run with each fault in turn (the first must fire), then without; check kept shards stay untouched."""
    args = cli_args(images, vae, out)
    signal_rc = {"kill": -9, "term": -15}[action]
    kept: dict[str, int] = {}
    for i, fault in enumerate(faults):
        r = run("dit-extract", args, fault=f"{fault}:{action}")
        assert r.rc == signal_rc or (i > 0 and r.rc == 0), r.err[-3000:]
        if r.rc == 0:
            break  # this run had too little left to reach its fault point: it finished
        assert not (out / "manifest.json").exists()   # an interrupted set never looks complete
        kept.update(_finished(out))
    r = run("dit-extract", args)
    assert r.rc == 0, r.err[-3000:]
    assert {n: ino for n, ino in _finished(out).items() if n in kept} == kept   # kept, not rewritten
    return r


@pytest.mark.determinism
@pytest.mark.parametrize("fault", [f if f in SUBSET else pytest.param(f, marks=SWEEP)
                                   for f in sorted(set(SWEPT) | SUBSET, key=POINTS.index)])
def test_sigkill_at_every_point_then_rerun(images, tiny_vae_dir, extract_base, tmp_path, fault):
    out = tmp_path / "out"
    _kill_and_rerun(images, tiny_vae_dir, out, [fault])
    assert_same_as_uninterrupted(out, *extract_base)


@SWEEP
@pytest.mark.parametrize("fault", picks(11, POINTS, 3))
def test_sigterm_then_rerun(images, tiny_vae_dir, extract_base, tmp_path, fault):
    out = tmp_path / "out"
    _kill_and_rerun(images, tiny_vae_dir, out, [fault], action="term")
    assert_same_as_uninterrupted(out, *extract_base)


@pytest.mark.parametrize("seed", [pytest.param(s, marks=SWEEP) for s in range(4)])
def test_several_kills_in_one_run(images, tiny_vae_dir, extract_base, tmp_path, seed):
    # Three kills at seeded points (each counted within its own process), then a clean rerun.
    faults = picks(seed, POINTS, 3)
    _kill_and_rerun(images, tiny_vae_dir, tmp_path / "out", faults)
    assert_same_as_uninterrupted(tmp_path / "out", *extract_base)
