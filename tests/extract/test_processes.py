"""Real processes: 2 ranks under torchrun (gloo) and kill -9 at fixed points, compared byte for byte with
one uninterrupted single-process run (the `odd_baseline` fixture: 15 images, 5 unusable, 4 shards).
Identical by design: the same batches (fixed by shard and batch size) and the same pinned encoder threads,
whatever OMP_NUM_THREADS the processes started with (make test-determinism varies it)."""
from __future__ import annotations

import signal

import pytest

pytestmark = pytest.mark.determinism
from dit_pipeline.shards import read_manifest, sample_key, shard_name, verify_shards
from tests._util import run_cli, run_srun, run_torchrun
from tests.extract.conftest import cli_args, extract, read_samples, shard_hashes
from tests.train.signal_rounds import signal_group_at


def _same_shard_set(out, baseline_out, baseline_hashes):
    assert shard_hashes(out) == baseline_hashes
    a, b = read_manifest(out), read_manifest(baseline_out)
    assert a.shards == b.shards and a.skipped == b.skipped and a.total_samples == b.total_samples
    assert a.fingerprint() == b.fingerprint()
    assert not list(out.glob(".tmp-*"))
    assert verify_shards(out, progress=False).ok


def test_two_ranks_write_the_same_shards_each_image_once(odd_tree, tiny_vae_dir, odd_baseline, tmp_path):
    base_out, _, hashes = odd_baseline
    out = tmp_path / "out"
    r = run_torchrun("dit-extract", cli_args(odd_tree, tiny_vae_dir, out), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    _same_shard_set(out, base_out, hashes)
    keys = sorted(read_samples(out))
    skipped = [s["key"] for s in read_manifest(out).skipped]
    assert sorted(keys + skipped) == [sample_key(i) for i in range(15)]       # every image exactly once
    assert "finished shard-" not in r.stdout + r.stderr        # --quiet: info only in the per-rank logs
    logs = {r: (out / "logs" / f"rank{r}.log").read_text() for r in (0, 1)}
    # shard i is written by rank i % 2, and by no one else
    for i in range(4):
        assert f"finished {shard_name(i)}" in logs[i % 2] and f"finished {shard_name(i)}" not in logs[1 - i % 2]


def test_srun_tasks_extract_as_one_job(odd_tree, tiny_vae_dir, odd_baseline, tmp_path):
    """`srun --ntasks 2 dit-extract` without torchrun: the two tasks form one 2-rank job (SLURM_PROCID /
    SLURM_NTASKS), whose shard set is the single-process one, not two rank-0 runs into one folder."""
    base_out, _, hashes = odd_baseline
    out = tmp_path / "out"
    runs = run_srun("dit-extract", cli_args(odd_tree, tiny_vae_dir, out))
    assert [r.returncode for r in runs] == [0, 0], [r.stderr[-2000:] for r in runs]
    _same_shard_set(out, base_out, hashes)
    logs = {r: (out / "logs" / f"rank{r}.log").read_text() for r in (0, 1)}
    for i in range(4):
        assert f"finished {shard_name(i)}" in logs[i % 2] and f"finished {shard_name(i)}" not in logs[1 - i % 2]
    assert "launcher: srun, 2 rank(s), 2 on this node, rendezvous localhost:" in logs[0]


@pytest.mark.parametrize("fault, kept, temp_left", [
    ("extract.shard_done@1", 1, False),        # between shards
    ("extract.sample_written@6", 1, True),     # in the middle of writing shard 1
    ("extract.shard_renamed@2", 1, False),     # shard 1 renamed into place, its state not yet saved
])
def test_kill_then_rerun_gives_the_uninterrupted_result(odd_tree, tiny_vae_dir, odd_baseline, tmp_path, fault,
                                                        kept, temp_left):
    base_out, _, hashes = odd_baseline
    out = tmp_path / "out"
    r = run_cli("dit-extract", cli_args(odd_tree, tiny_vae_dir, out), env={"DIT_FAULT": fault})
    assert r.returncode == -9, r.stderr[-3000:]                                  # SIGKILLed itself
    assert not (out / "manifest.json").exists()
    assert bool(list(out.glob(".tmp-shard-*"))) == temp_left
    first = (out / shard_name(0)).stat().st_ino
    summary = extract(odd_tree, tiny_vae_dir, out)
    assert (summary.shards_kept, summary.shards_written) == (kept, 4 - kept)
    assert (out / shard_name(0)).stat().st_ino == first                          # kept, not rewritten
    _same_shard_set(out, base_out, hashes)


def test_a_dead_rank_then_a_rerun_on_one_process(odd_tree, tiny_vae_dir, odd_baseline, tmp_path):
    base_out, _, hashes = odd_baseline
    out = tmp_path / "out"
    r = run_torchrun("dit-extract", cli_args(odd_tree, tiny_vae_dir, out), nproc=2,
                     env={"DIT_FAULT": "extract.shard_done@1", "DIT_FAULT_RANK": "1"})
    assert r.returncode != 0
    assert (out / shard_name(1)).exists() and not (out / "manifest.json").exists()
    summary = extract(odd_tree, tiny_vae_dir, out)                                # world size 2 -> 1
    assert summary.shards_kept >= 1
    _same_shard_set(out, base_out, hashes)


@pytest.mark.parametrize("sig, rc", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, 130)])
def test_signal_to_the_group_ends_it_and_a_rerun_gives_the_uninterrupted_result(odd_tree, tiny_vae_dir, odd_baseline,
                                                                                tmp_path, sig, rc):
    """scancel / preemption (SIGTERM) or Ctrl-C (SIGINT) to the whole process group, loader workers
    included, in the middle of shard 1: the command ends (SIGTERM's default action; "interrupted", exit
    130, for Ctrl-C) leaving no process and no traceback, and the rerun completes the uninterrupted set."""
    base_out, _, hashes = odd_baseline
    out = tmp_path / "out"
    args = cli_args(odd_tree, tiny_vae_dir, out, num_workers=2)
    r = signal_group_at("dit-extract", args, "extract.sample_written@6", sig)
    assert r.returncode == rc, r.stderr[-3000:]
    assert r.survivors == [] and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert ("interrupted" in r.stderr) == (sig == signal.SIGINT)
    assert not (out / "manifest.json").exists() and (out / shard_name(0)).is_file()
    rerun = run_cli("dit-extract", args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    _same_shard_set(out, base_out, hashes)
