"""The text extraction under real processes: 2 ranks under torchrun (gloo), and kill -9 in the middle of a shard
then a rerun, each byte for byte the single-process text set (the `qwen3_text_set` fixture). Identical by design:
the same batches of captions (fixed by the shard and --batch-size) and the same pinned CPU threads."""
from __future__ import annotations

import hashlib

import pytest

from dit_pipeline.shards import read_manifest, verify_shards
from tests._util import run_cli, run_torchrun
from tests.captions.conftest import text_extract

pytestmark = pytest.mark.determinism


def _hashes(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("shard-*.tar"))}


def _args(source, encoder, out):
    return ["--data-path", source, "--out", out, "--text-encoder", encoder, "--text-max-length", "24",
            "--batch-size", "5", "--quiet"]


def _same(out, baseline):
    assert _hashes(out) == _hashes(baseline) and len(_hashes(out)) == 3
    a, b = read_manifest(out), read_manifest(baseline)
    assert a.shards == b.shards and a.text == b.text and a.skipped == b.skipped and a.fingerprint() == b.fingerprint()
    assert verify_shards(out, progress=False).ok and not list(out.glob(".tmp-*"))


def test_two_ranks_and_a_killed_run_give_the_single_process_text_set(captioned_set, tiny_qwen3, qwen3_text_set,
                                                                     tmp_path):
    out = tmp_path / "two-ranks"
    r = run_torchrun("dit-extract", _args(captioned_set, tiny_qwen3, out), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    _same(out, qwen3_text_set)
    logs = {k: (out / "logs" / f"rank{k}.log").read_text() for k in (0, 1)}
    for i in range(3):  # shard i by rank i % 2 only
        assert f"finished shard-{i:06d}.tar" in logs[i % 2] and f"finished shard-{i:06d}.tar" not in logs[1 - i % 2]
    killed = tmp_path / "killed"
    r = run_cli("dit-extract", _args(captioned_set, tiny_qwen3, killed), env={"DIT_FAULT": "extract.sample_written@6"})
    assert r.returncode == -9, r.stderr[-3000:]  # SIGKILLed itself in the middle of shard 1
    assert not (killed / "manifest.json").exists() and (killed / "shard-000000.tar").exists()
    first = (killed / "shard-000000.tar").stat().st_ino
    summary = text_extract(captioned_set, tiny_qwen3, killed)  # the same settings, rerun (in this process)
    assert (summary.shards_kept, summary.shards_written) == (1, 2)
    assert (killed / "shard-000000.tar").stat().st_ino == first  # kept, not rewritten
    _same(killed, qwen3_text_set)
