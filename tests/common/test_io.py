import hashlib
import os

import pytest

from dit_pipeline.common.io import HashingWriter, atomic_write, atomic_write_json, remove_stale_temps, sha256_file


def test_atomic_write_replaces_only_on_success(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_write(p) as f:
            f.write(b"partial")
            raise RuntimeError("boom")
    assert p.read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["f.bin"]  # temp file removed
    with atomic_write(p) as f:
        f.write(b"new")
    assert p.read_bytes() == b"new"


def test_atomic_json_is_stable(tmp_path):
    atomic_write_json(tmp_path / "a.json", {"b": 1, "a": [1, 2]})
    assert (tmp_path / "a.json").read_text() == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'


def test_hashing_writer_and_sha256_file(tmp_path):
    p = tmp_path / "x"
    with open(p, "wb") as raw:
        w = HashingWriter(raw)
        w.write(b"abc")
        w.write(b"d" * 3_000_000)
    expect = hashlib.sha256(b"abc" + b"d" * 3_000_000).hexdigest()
    assert w.hexdigest() == expect == sha256_file(p)
    assert w.bytes == 3_000_003


def test_remove_stale_temps(tmp_path):
    (tmp_path / ".tmp-shard-000000.tar.abc").write_bytes(b"x")
    (tmp_path / "shard-000000.tar").write_bytes(b"y")
    removed = remove_stale_temps(tmp_path)
    assert [r.name for r in removed] == [".tmp-shard-000000.tar.abc"]
    assert sorted(os.listdir(tmp_path)) == ["shard-000000.tar"]


def test_atomic_write_respects_umask(tmp_path):
    old = os.umask(0o027)
    try:
        with atomic_write(tmp_path / "m") as f:
            f.write(b"x")
    finally:
        os.umask(old)
    assert (tmp_path / "m").stat().st_mode & 0o777 == 0o640
