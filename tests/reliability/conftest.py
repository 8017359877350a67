"""Fixtures of the reliability suite: the uninterrupted baselines every faulted run is compared with.

- extraction: the odd image tree of tests/extract (15 images: 10 usable, 5 unusable; 4 shards of 4 keys);
- training: the synthetic shard set of tests/train (60 samples in 4 shards; 8 steps cross an epoch) and a
  straight 8-step run that keeps every checkpoint (2, 4, 6, 8);
- sampling: the straight run's own step-8 checkpoint (the pipeline end to end), 6 samples in 3 batches.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.extract.conftest import extract, make_odd_tree, shard_hashes
from tests.reliability.harness import run
from tests.train.conftest import tiny_args
from tests.train.helpers import make_shard_set

TRAIN_STEPS = 8
SAMPLES = 6


@pytest.fixture(scope="session")
def images(tmp_path_factory) -> Path:
    return make_odd_tree(tmp_path_factory.mktemp("rel-images") / "images")


@pytest.fixture(scope="session")
def extract_base(images, tiny_vae_dir, tmp_path_factory):
    """One uninterrupted extraction: (out folder, shard hashes)."""
    out = tmp_path_factory.mktemp("rel-extract") / "out"
    extract(images, tiny_vae_dir, out)
    return out, shard_hashes(out)


@pytest.fixture(scope="session")
def train_shards(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("rel-shards") / "shards"
    make_shard_set(folder, samples=(16, 16, 16, 12), latent_shape=(4, 8, 8))
    return folder


def train_args(shards: Path, run_dir: Path, **overrides) -> list[str]:
    """The tiny DiT run of tests/train (8 steps, a checkpoint every 2), keeping every checkpoint."""
    return tiny_args(shards, run_dir, **{"keep-last": 10, "quiet": None, **overrides})


@pytest.fixture(scope="session")
def train_base(train_shards, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("rel-train") / "run"
    r = run("dit-train", train_args(train_shards, run_dir))
    assert r.rc == 0, r.err[-3000:]
    return run_dir


@pytest.fixture(scope="session")
def sample_ckpt(train_base) -> Path:
    return train_base / "checkpoints" / f"step-{TRAIN_STEPS:07d}.pt"


def sample_args(ckpt: Path, vae: Path, npz: Path, *extra: str) -> list[str]:
    return ["--ckpt", ckpt, "--vae", vae, "--steps", 4, "--num-samples", SAMPLES, "--batch-size", 2,
            "--seed", 5, "--npz", npz, "--quiet", *extra]


def load_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return z["arr_0"], z["arr_1"]


@pytest.fixture(scope="session")
def sample_base(sample_ckpt, tiny_vae_dir, tmp_path_factory) -> tuple[np.ndarray, np.ndarray]:
    """The uninterrupted run's (images, labels)."""
    npz = tmp_path_factory.mktemp("rel-sample") / "base.npz"
    r = run("dit-sample", sample_args(sample_ckpt, tiny_vae_dir, npz))
    assert r.rc == 0, r.err[-3000:]
    return load_npz(npz)
