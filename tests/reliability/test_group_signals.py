"""The randomized sweep of issue 12: SIGTERM to the whole process group of dit-train (2 loader workers) at
random moments (a third of the rounds during start-up, the rest after a random step plus a random
delay: mid-epoch, between epochs while the workers restart, during checkpoint saves) with
two CPU burners beside it. Every round: exit 0, the last step that ran is checkpointed, no process left, no
traceback. (A signal that lands before the interpreter reaches dit-train's first line gets the default action:
the process dies having written nothing; such rounds are counted and must leave nothing behind.)"""
from __future__ import annotations

import random
import signal

import pytest

from tests.train.conftest import SHARD_SIZES  # noqa: F401  (the shard_dir fixture comes from tests/train)
from tests.train.signal_rounds import cpu_burners, finish, signal_group_after, start, wait_for_step

ROUNDS = 12


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    from tests.train.helpers import make_shard_set

    folder = tmp_path_factory.mktemp("sig-shards") / "shards"
    make_shard_set(folder, samples=SHARD_SIZES, latent_shape=(4, 8, 8))
    return folder


@pytest.mark.reliability
@pytest.mark.timeout(3600)
def test_sigterm_to_the_group_at_random_moments_under_load(shard_dir, tmp_path):
    rng = random.Random(12)
    burners = cpu_burners(2)
    results = []
    try:
        for i in range(ROUNDS):
            run_dir = tmp_path / f"run{i}"
            proc = start(shard_dir, run_dir)
            if i % 3 == 0:  # during start-up (imports, model, first loader start)
                delay = rng.uniform(0.0, 20.0)
            else:  # mid-run: after a random step (epochs of 6 steps, a checkpoint every 3), at a random moment
                wait_for_step(run_dir, rng.randint(1, 14))
                delay = rng.uniform(0.0, 1.0)
            r = finish(proc, run_dir, signal_group_after(proc, delay, signal.SIGTERM))
            results.append((i % 3 != 0, round(delay, 2), r.returncode, r.steps_logged,
                            round(r.seconds_after_signal, 1)))
            assert r.survivors == [], (i, results)
            assert "Traceback" not in r.stderr, (i, r.stderr[-3000:])
            if r.returncode == -signal.SIGTERM:  # before dit-train's first line: nothing may exist
                assert not run_dir.exists(), (i, results)
                continue
            assert r.returncode == 0, (i, results, r.stderr[-3000:])
            assert r.checkpoint_step == (r.steps_logged or None), (i, results)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    print("\n(mid-run, delay s, exit code, steps run, s from signal to exit):", results)
