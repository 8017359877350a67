"""sample/npz.py: part files, resume bookkeeping, fingerprint checks and the streamed ADM .npz."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from dit_pipeline.common.errors import UserError
from dit_pipeline.sample.npz import RUN_FILE, PartStore, assemble_npz, parts_dir_for

FP = {"seed": 1, "steps": 5, "checkpoint_sha256": "ab" * 32}


def images_for(indices, h=4, w=6):
    """Deterministic fake images whose pixels encode their index."""
    idx = np.asarray(indices)
    base = (idx[:, None, None, None] * 7 + np.arange(h * w * 3).reshape(1, h, w, 3)) % 256
    return base.astype(np.uint8)


def filled_store(folder, n=10, batch=3, labels=None):
    labels = np.arange(n) % 4 if labels is None else labels
    store = PartStore(folder, FP, n)
    assert store.open() == []
    for start in range(0, n, batch):
        idx = list(range(start, min(start + batch, n)))
        store.write(idx, labels[idx], images_for(idx))
    return store, labels


def test_parts_dir_location(tmp_path):
    assert parts_dir_for(tmp_path / "a" / "s.npz", None) == tmp_path / "a" / ".s.npz.parts"
    assert parts_dir_for(None, tmp_path / "out") == tmp_path / "out" / ".parts"
    assert parts_dir_for(tmp_path / "s.npz", tmp_path / "out") == tmp_path / ".s.npz.parts"


def test_assembled_npz_is_the_adm_format_and_streams_in_index_order(tmp_path):
    store, labels = filled_store(tmp_path / "parts", n=10, batch=3)
    out = tmp_path / "samples.npz"
    assert assemble_npz(store, out, labels) == (10, 4, 6)
    with np.load(out) as z:
        assert sorted(z.files) == ["arr_0", "arr_1"]
        assert z["arr_0"].dtype == np.uint8 and z["arr_0"].shape == (10, 4, 6, 3)
        assert np.array_equal(z["arr_0"], images_for(range(10)))
        assert z["arr_1"].dtype == np.int64 and np.array_equal(z["arr_1"], labels)
    # byte-compatible with numpy's own writer for the same arrays
    ref = tmp_path / "ref.npz"
    np.savez(ref, images_for(range(10)), labels.astype(np.int64))
    with np.load(ref) as a, np.load(out) as b:
        assert all(np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in ("arr_0", "arr_1"))


def test_resume_reports_finished_indices_and_holes_fill_in_any_order(tmp_path):
    folder = tmp_path / "parts"
    store = PartStore(folder, FP, 8)
    store.open()
    store.write([0, 1], np.zeros(2), images_for([0, 1]))
    store.write([5, 6], np.zeros(2), images_for([5, 6]))
    reopened = PartStore(folder, FP, 8)
    assert reopened.open() == [0, 1, 5, 6]
    reopened.write([2, 3, 4, 7], np.zeros(4), images_for([2, 3, 4, 7]))  # a non-contiguous resumed batch
    assemble_npz(reopened, tmp_path / "s.npz", np.zeros(8, np.int64))
    with np.load(tmp_path / "s.npz") as z:
        assert np.array_equal(z["arr_0"], images_for(range(8)))


def test_parts_of_another_configuration_are_refused_then_discarded_with_overwrite(tmp_path):
    folder = tmp_path / "parts"
    filled_store(folder, n=4, batch=2)
    other = PartStore(folder, {**FP, "seed": 2, "steps": 6}, 4)
    with pytest.raises(UserError,
                       match=r"different run \(changed: --seed \S+ -> 2, --steps \S+ -> 6\)\. .*--overwrite"):
        other.open()
    assert len(list(folder.glob("part-*.npz"))) == 2  # nothing lost
    assert other.open(overwrite=True) == []
    assert not list(folder.glob("part-*.npz"))


def test_foreign_folder_without_run_file_is_refused(tmp_path):
    folder = tmp_path / "parts"
    filled_store(folder, n=2, batch=2)
    (folder / RUN_FILE).unlink()
    with pytest.raises(UserError, match=r"changed: unknown: no readable record of its settings\)"):
        PartStore(folder, FP, 2).open()


def test_damaged_part_and_stale_temp_are_dropped_on_resume(tmp_path, caplog):
    folder = tmp_path / "parts"
    filled_store(folder, n=6, batch=2)
    (folder / "part-000000002.npz").write_bytes(b"PK\x03\x04 truncated")
    (folder / ".tmp-part-000000004.npz.abc").write_bytes(b"half")
    log = logging.getLogger("test-npz")
    with caplog.at_level(logging.WARNING, logger="test-npz"):
        assert PartStore(folder, FP, 6).open(log=log) == [0, 1, 4, 5]
    assert "discarding unreadable part" in caplog.text
    assert not (folder / "part-000000002.npz").exists() and not list(folder.glob(".tmp-*"))


def test_missing_or_mislabelled_samples_are_reported(tmp_path):
    store, labels = filled_store(tmp_path / "parts", n=6, batch=2)
    (store.folder / "part-000000002.npz").unlink()
    with pytest.raises(UserError, match=r"samples \[2, 3\] are missing; rerun"):
        assemble_npz(store, tmp_path / "s.npz", labels)
    store, labels = filled_store(tmp_path / "p2", n=4, batch=2)
    with pytest.raises(UserError, match="sample 0 has class 0, expected 3"):
        assemble_npz(store, tmp_path / "s2.npz", np.array([3, 1, 2, 3]))
    assert not (tmp_path / "s.npz").exists() and not (tmp_path / "s2.npz").exists()


@pytest.mark.skipif(not Path("/proc/self/io").is_file(), reason="byte counting needs Linux's /proc/self/io")
def test_resume_scan_and_assembly_read_each_part_once(tmp_path):
    """Counted by the kernel (/proc/self/io rchar): reopening for a resume reads only the index members (no
    pixels), and assembling reads every part once, front to back. The allowance per part covers its zip
    directory, headers and the 8 KiB read-ahead of each open (a real part of 32 images at 256 px is 6.3 MB)."""
    n, batch, per_part = 320, 32, 48 * 1024
    store = PartStore(tmp_path / "parts", FP, n)
    store.open()
    labels = np.arange(n) % 10
    for start in range(0, n, batch):
        idx = list(range(start, start + batch))
        store.write(idx, labels[idx], images_for(idx, h=64, w=64))
    parts = sorted(store.folder.glob("part-*.npz"))
    part_bytes = sum(p.stat().st_size for p in parts)
    assert len(parts) == 10 and part_bytes > 10 * 32 * 64 * 64 * 3

    before = _rchar()
    reopened = PartStore(store.folder, FP, n)
    assert reopened.open() == list(range(n))
    scan = _rchar() - before
    assert scan <= per_part * len(parts), scan
    before = _rchar()
    assemble_npz(reopened, tmp_path / "s.npz", labels)
    used = _rchar() - before
    assert used <= part_bytes + per_part * len(parts), f"{used - part_bytes} bytes over the parts' {part_bytes}"
    with np.load(tmp_path / "s.npz") as z:
        assert np.array_equal(z["arr_0"], images_for(range(n), h=64, w=64))


def _rchar() -> int:
    text = Path("/proc/self/io").read_text()
    return int(next(line for line in text.splitlines() if line.startswith("rchar:")).split()[1])
