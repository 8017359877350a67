"""dit-sample killed at any moment, then rerun: finished batches kept (not sampled again), the rest sampled,
and the `.npz` identical to the uninterrupted run's arrays, every index exactly once.

The run samples 6 images from the training suite's own step-8 checkpoint in 3 batches of 2. Points: before
a batch's part file is written (`sample.part_write`), after it (`sample.part_written`), and after the npz
before its record (`sample.npz_written`). tests/sample/test_run.py covers part_written@1.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.reliability.conftest import SAMPLES, load_npz, sample_args
from tests.reliability.harness import SWEEP, picks, run, sweep_points, temp_files

BATCHES = 3
POINTS = ([f"sample.{p}@{n}" for p in ("part_write", "part_written") for n in range(1, BATCHES + 1)]
          + ["sample.npz_written@1"])
SWEPT = [*sweep_points(20, POINTS[:BATCHES], 2), *sweep_points(21, POINTS[BATCHES:-1], 2), POINTS[-1]]
SUBSET = {"sample.part_write@2"}


def _parts(npz: Path) -> Path:
    return npz.parent / f".{npz.name}.parts"


def assert_same_as_uninterrupted(npz: Path, base) -> None:
    images, labels = load_npz(npz)
    assert images.shape[0] == SAMPLES and np.array_equal(images, base[0]) and np.array_equal(labels, base[1])
    assert not _parts(npz).exists() and temp_files(npz.parent) == []
    assert json.loads(Path(f"{npz}.json").read_text())["labels"] == labels.tolist()


def _kill_and_rerun(ckpt, vae, npz: Path, faults: list[str], action: str = "kill") -> None:
    args = sample_args(ckpt, vae, npz)
    rc = {"kill": -9, "term": -15}[action]
    for i, fault in enumerate(faults):
        r = run("dit-sample", args, fault=f"{fault}:{action}")
        assert r.rc == rc or (i > 0 and r.rc == 0), r.err[-3000:]
        if r.rc == 0:
            break
    done = 2 * len(list(_parts(npz).glob("part-*.npz")))
    r = run("dit-sample", [a for a in args if a != "--quiet"])
    assert r.rc == 0, r.err[-3000:]
    # every finished batch was kept, only the others were sampled again
    assert f"sampling {SAMPLES - done} of {SAMPLES} images ({done} already done)" in r.err, r.err[-3000:]


@pytest.mark.determinism
@pytest.mark.parametrize("fault", [f if f in SUBSET else pytest.param(f, marks=SWEEP)
                                   for f in sorted(set(SWEPT) | SUBSET, key=POINTS.index)])
def test_sigkill_at_every_point_then_rerun(sample_ckpt, tiny_vae_dir, sample_base, tmp_path, fault):
    npz = tmp_path / "s.npz"
    _kill_and_rerun(sample_ckpt, tiny_vae_dir, npz, [fault])
    assert_same_as_uninterrupted(npz, sample_base)


@SWEEP
@pytest.mark.parametrize("seed, action", [(0, "kill"), (2, "term")])
def test_several_kills_and_sigterm(sample_ckpt, tiny_vae_dir, sample_base, tmp_path, seed, action):
    npz = tmp_path / "s.npz"
    _kill_and_rerun(sample_ckpt, tiny_vae_dir, npz, picks(seed, POINTS, 2), action=action)
    assert_same_as_uninterrupted(npz, sample_base)
