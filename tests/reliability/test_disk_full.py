"""A full disk while writing shards, checkpoints or samples: the write fails with one clear error naming the
file (exit 1, no traceback), the previous files stay valid (same bytes, no temp files left), and the same
command, rerun with space, finishes with exactly the uninterrupted result.

Two kinds of full disk: a real `RLIMIT_FSIZE` in the child (writes past it fail with EFBIG, as they fail with
ENOSPC on a full disk), sized so that some files fit and the next one does not; and `enospc` injected at the
fault points, to fail at every kind of write (inside a shard, its state file, the manifest, a checkpoint).
"""
from __future__ import annotations

import pytest

from dit_pipeline.extract.state import finished_shard
from dit_pipeline.shards import shard_name
from tests.extract.conftest import cli_args
from tests.reliability.conftest import SAMPLES, sample_args, train_args
from tests.reliability.harness import SWEEP, assert_clean_error, file_hashes, run, temp_files
from tests.reliability.test_extract_faults import assert_same_as_uninterrupted as same_shards
from tests.reliability.test_sample_faults import assert_same_as_uninterrupted as same_samples
from tests.reliability.test_train_faults import assert_same_as_uninterrupted as same_run
from dit_pipeline.train.checkpoint import CheckpointManager

IMAGE_BYTES = 64 * 64 * 3   # one sampled image (8x8 latents, 8x VAE)


# ----------------------------------------------------------------------------------------------------------
# Extraction

def _shards_state(out):
    return {n: h for n, h in file_hashes(out).items() if n.startswith("shard-") or n.startswith(".extract/shard-")}


@pytest.mark.determinism
def test_extract_file_size_limit(images, tiny_vae_dir, extract_base, tmp_path):
    out = tmp_path / "out"
    args = cli_args(images, tiny_vae_dir, out)
    assert run("dit-extract", args, fault="extract.shard_done@2").rc == -9     # shards 0 and 1 finished
    before = _shards_state(out)
    # shards 2 and 3 hold one sample each (10240 bytes): a limit of 8 KiB fails the next write
    r = run("dit-extract", args, fsize=8192)
    assert_clean_error(r, f"cannot write {out / shard_name(2)} (File too large)", "rerun the same command")
    assert _shards_state(out) == before and temp_files(out) == [] and not (out / "manifest.json").exists()
    assert [finished_shard(out, i) is not None for i in range(4)] == [True, True, False, False]
    assert run("dit-extract", args).rc == 0
    same_shards(out, *extract_base)


@SWEEP
@pytest.mark.parametrize("fault, file", [
    ("shards.mid_sample@1", "shard-000000.tar"),       # inside the first shard
    ("shards.mid_sample@7", "shard-000001.tar"),       # inside a later shard
    ("extract.shard_renamed@2", "shard-000001.tar"),   # the shard's state file
    ("extract.shard_renamed@4", "shard-000003.tar"),
    ("extract.before_manifest@1", "manifest.json"),
])
def test_extract_write_fails_at_every_kind_of_write(images, tiny_vae_dir, extract_base, tmp_path, fault, file):
    out = tmp_path / "out"
    args = cli_args(images, tiny_vae_dir, out)
    r = run("dit-extract", args, fault=f"{fault}:enospc")
    assert_clean_error(r, f"cannot write {out / file} (No space left on device", "rerun the same command")
    assert temp_files(out) == [] and not (out / "manifest.json").exists()
    finished = {n: h for n, h in _shards_state(out).items() if n.startswith("shard-")
                and finished_shard(out, int(n[6:12])) is not None}
    assert finished == {n: h for n, h in extract_base[1].items() if n in finished}   # intact, as uninterrupted
    assert run("dit-extract", args).rc == 0
    same_shards(out, *extract_base)


# ----------------------------------------------------------------------------------------------------------
# Training

@pytest.mark.parametrize("fault", ["train.ckpt_mid_save@2", pytest.param("train.ckpt_ema_written@3", marks=SWEEP)])
def test_train_checkpoint_write_fails_cleanly(train_shards, train_base, tmp_path, fault):
    run_dir = tmp_path / "run"
    args = train_args(train_shards, run_dir)
    step = 2 * int(fault.rsplit("@", 1)[1])
    r = run("dit-train", args, fault=f"{fault}:enospc")
    assert_clean_error(r, f"cannot write checkpoint {run_dir / 'checkpoints' / f'step-{step:07d}.pt'} (No space",
                       f"the previous checkpoint (step-{step - 2:07d}.pt) is intact", "rerun the same command")
    ckpts = CheckpointManager(run_dir / "checkpoints")
    assert ckpts.steps() == list(range(2, step, 2)) and temp_files(run_dir) == []
    assert run("dit-train", args).rc == 0
    same_run(run_dir, train_base)


@SWEEP
def test_train_file_size_limit_at_the_first_checkpoint(train_shards, train_base, tmp_path):
    run_dir = tmp_path / "run"
    args = train_args(train_shards, run_dir)
    ema, full = (train_base / "checkpoints" / n for n in ("step-0000002-ema.pt", "step-0000002.pt"))
    limit = (ema.stat().st_size + full.stat().st_size) // 2                    # the EMA file fits, the rest not
    r = run("dit-train", args, fsize=limit)
    assert_clean_error(r, "cannot write checkpoint", "step-0000002.pt (File too large)",
                       "the previous checkpoint (none yet) is intact")
    assert CheckpointManager(run_dir / "checkpoints").steps() == [] and temp_files(run_dir) == []
    assert run("dit-train", args).rc == 0
    same_run(run_dir, train_base)


# ----------------------------------------------------------------------------------------------------------
# Sampling

@SWEEP
@pytest.mark.parametrize("limit, file", [(4 * IMAGE_BYTES, "s.npz"), (IMAGE_BYTES, "part")])
def test_sample_file_size_limit(sample_ckpt, tiny_vae_dir, sample_base, tmp_path, limit, file):
    """4 images' worth: every 2-image part fits, the 6-image npz does not; 1 image's worth: no part fits."""
    npz = tmp_path / "s.npz"
    args = sample_args(sample_ckpt, tiny_vae_dir, npz)
    r = run("dit-sample", args, fsize=limit)
    parts = tmp_path / ".s.npz.parts"
    if file == "part":
        assert_clean_error(r, "cannot write the samples of indices 0..1", "File too large", "rerun the same command")
        assert sorted(p.name for p in parts.iterdir()) == ["run.json"]
    else:
        assert_clean_error(r, f"cannot write {npz} (File too large)", f"all {SAMPLES} samples are finished and kept")
        assert len(list(parts.glob("part-*.npz"))) == SAMPLES // 2 and not npz.exists()
    assert temp_files(tmp_path) == []
    assert run("dit-sample", args).rc == 0
    same_samples(npz, sample_base)
