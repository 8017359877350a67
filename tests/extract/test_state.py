"""The output folder: new / resume / refuse / overwrite, and which shards count as finished."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dit_pipeline.common.errors import UserError
from dit_pipeline.extract.state import (ShardState, finished_shard, prepare_output, record_differences,
                           save_shard_state, start_output, state_path)
from dit_pipeline.shards import ShardWriter, sample_key, shard_name

RECORD = {"image_size": 32, "views": 2, "dtype": "float16", "data_path": "/a", "batch_size": 4, "device": "cpu",
          "versions": {"torch": "2.14"},
          "vae": {"source": "/v1", "kind": "folder", "weights_sha256": "ab" * 32, "scaling_factor": 0.5}}


def _changed(**kw):
    r = json.loads(json.dumps(RECORD))
    for k, v in kw.items():
        if "." in k:
            a, b = k.split(".")
            r[a][b] = v
        else:
            r[k] = v
    return r


def test_record_differences_hard_soft_and_ignored():
    assert record_differences(RECORD, RECORD) == ([], [])
    # data location and the path the same VAE weights were loaded from do not matter
    assert record_differences(RECORD, _changed(data_path="/b", **{"vae.source": "/v2", "vae.kind": "file"})) == ([], [])
    hard, soft = record_differences(RECORD, _changed(image_size=64, **{"vae.weights_sha256": "cd" * 32}))
    assert hard == ["image_size: 32 in the folder, 64 now", f"vae.weights_sha256: {'ab' * 32!r} in the folder, "
                    f"{'cd' * 32!r} now"] and soft == []
    hard, soft = record_differences(RECORD, _changed(batch_size=8, **{"versions.torch": "2.15"}))
    assert hard == [] and soft == ["batch_size: 4 in the folder, 8 now", "versions.torch: '2.14' in the folder, "
                                   "'2.15' now"]
    hub = _changed(**{"vae.weights_sha256": None})
    assert record_differences(hub, _changed(**{"vae.weights_sha256": None, "vae.source": "other/id"}))[0] == [
        "vae.source: '/v1' in the folder, 'other/id' now"]


def _write_shard(out, index, n=2):
    with ShardWriter(out / shard_name(index), dtype="float16") as w:
        for k in range(n):
            a = np.full((2, 4, 2, 2), k, np.float32)
            w.write(sample_key(index * 10 + k), label=k, meta={"path": f"x{k}"}, mean=a, std=a + 1)
        record = w.close()
    save_shard_state(out, index, ShardState(record, [{"key": sample_key(index * 10 + 9), "path": "bad.jpg",
                                                      "reason": "empty file (0 bytes)"}]))
    return record


def test_finished_shard_checks_size_and_hash(tmp_path):
    rec = _write_shard(tmp_path, 0)
    _write_shard(tmp_path, 1)
    _write_shard(tmp_path, 2)
    _write_shard(tmp_path, 3)
    state = finished_shard(tmp_path, 0)
    assert state is not None and state.record == rec and state.skipped[0]["reason"] == "empty file (0 bytes)"
    # truncated
    p = tmp_path / shard_name(1)
    p.write_bytes(p.read_bytes()[:-512])
    assert finished_shard(tmp_path, 1) is None
    # one flipped bit, same size
    p = tmp_path / shard_name(2)
    data = bytearray(p.read_bytes())
    data[700] ^= 1
    p.write_bytes(bytes(data))
    assert finished_shard(tmp_path, 2) is None
    # renamed into place but its state never written (killed in between), or state unreadable
    state_path(tmp_path, 3).unlink()
    assert finished_shard(tmp_path, 3) is None
    (tmp_path / shard_name(0)).unlink()
    assert finished_shard(tmp_path, 0) is None
    _write_shard(tmp_path, 4)
    state_path(tmp_path, 4).write_text("{not json")
    assert finished_shard(tmp_path, 4) is None


def test_prepare_output_new_resume_refuse_overwrite(tmp_path):
    out = tmp_path / "out"
    assert prepare_output(out, RECORD, overwrite=False) == "new"
    out.mkdir()
    (out / "logs").mkdir()
    (out / ".DS_Store").write_text("x")
    assert prepare_output(out, RECORD, overwrite=False) == "new"
    start_output(out, RECORD)
    _write_shard(out, 0)
    (out / ".tmp-shard-000001.tar.abcd").write_bytes(b"partial")
    assert prepare_output(out, RECORD, overwrite=False) == "resume"
    assert prepare_output(out, _changed(batch_size=16), overwrite=False) == "resume"
    before = sorted(p.name for p in out.rglob("*"))
    with pytest.raises(UserError) as e:
        prepare_output(out, _changed(image_size=64, dtype="float32"), overwrite=False)
    msg = str(e.value)
    assert "different configuration" in msg and "image_size: 32 in the folder, 64 now" in msg
    assert "dtype: 'float16' in the folder, 'float32' now" in msg and "--overwrite" in msg
    assert sorted(p.name for p in out.rglob("*")) == before            # nothing lost
    assert prepare_output(out, _changed(image_size=64), overwrite=True) == "overwritten"
    assert sorted(p.name for p in out.iterdir()) == [".DS_Store", "logs"]


def test_prepare_output_refuses_foreign_content(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    with pytest.raises(UserError, match="holds files that dit-extract did not write \\(thesis.tex\\)"):
        prepare_output(out, RECORD, overwrite=True)
    assert (out / "thesis.tex").read_text() == "precious"
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(UserError, match="exists and is not a folder"):
        prepare_output(f, RECORD, overwrite=False)


def test_shards_without_state_are_refused_unless_overwrite(tmp_path):
    _write_shard(tmp_path, 0)
    clear_state = tmp_path / ".extract"
    for p in clear_state.iterdir():
        p.unlink()
    with pytest.raises(UserError, match="no extraction state"):
        prepare_output(tmp_path, RECORD, overwrite=False)
    assert (tmp_path / shard_name(0)).exists()
    assert prepare_output(tmp_path, RECORD, overwrite=True) == "overwritten"
    assert not (tmp_path / shard_name(0)).exists()


def test_a_changed_compile_setting_is_a_numerics_difference():
    hard, soft = record_differences({**RECORD, "compile": False}, {**RECORD, "compile": True})
    assert hard == [] and soft == ["compile: False in the folder, True now"]
