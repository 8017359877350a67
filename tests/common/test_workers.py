"""Loader workers are forked from the process that reads them on Linux, even where Python's default start
method is forkserver (Python 3.14 on Linux): the trainer's signal design needs them to inherit its signal mask
(train.signals.workers_start_blocked)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.train.helpers import make_shard_set

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork is the Linux start method")

ROOT = Path(__file__).resolve().parents[2]

# Run as a script: with forkserver, a worker re-imports the main module, so record_parent must live in it.
SCRIPT = '''
import multiprocessing, os, sys
from pathlib import Path


def record_parent(worker_id):
    from dit_pipeline.train.signals import ignore_in_worker
    ignore_in_worker(worker_id)
    Path(sys.argv[2], f"worker-{worker_id}").write_text(str(os.getppid()))


if __name__ == "__main__":
    multiprocessing.set_start_method("forkserver", force=True)  # Python 3.14's default on Linux
    from dit_pipeline.extract.loader import make_loader as extract_loader
    from dit_pipeline.train import data
    from dit_pipeline.train.shard_source import open_shards
    from dit_pipeline.train.partition import plan_epoch

    data.ignore_in_worker = record_parent  # make_loader's worker_init_fn
    src = open_shards(sys.argv[1])
    plan = plan_epoch(src.sizes, seed=0, epoch=0, world_size=1, workers=2, micro_batch=2, accum=1)
    stream = data.EpochStream(src, plan, 0, seed=0, buffer=8)
    batches = sum(1 for _ in data.make_loader(stream, num_workers=2, prefetch_factor=2, pin_memory=False))
    decoders = extract_loader([0], [(0, range(1))], samples_per_shard=1, num_workers=1, pin_memory=False)
    context = decoders.multiprocessing_context  # None: the default start method
    print(os.getpid(), batches, plan.micro_batches, context.get_start_method() if context else "default")
'''


def test_loader_workers_are_forked_where_the_default_is_forkserver(tmp_path):
    shards, seen = tmp_path / "shards", tmp_path / "seen"
    make_shard_set(shards, samples=(8, 8))
    seen.mkdir()
    script = tmp_path / "loader_workers.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(script), str(shards), str(seen)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    pid, batches, expected, extract_method = r.stdout.split()
    assert batches == expected == "8"
    parents = {p.name: p.read_text() for p in seen.iterdir()}
    assert parents == {"worker-0": pid, "worker-1": pid}  # not the forkserver's pid
    assert extract_method == "fork"
