"""manifest.json: round trip, fingerprint, atomic write, and exact messages for damaged manifests."""
import json
import os

import pytest

from dit_pipeline.common.errors import UserError
from dit_pipeline.shards import Manifest, ShardRecord, read_manifest, write_manifest
from tests.shards._helpers import edit_manifest, make_set


def test_round_trip_and_stable_fingerprint(tmp_path):
    m = make_set(tmp_path / "set")
    back = read_manifest(tmp_path / "set")
    assert back == m and read_manifest(tmp_path / "set" / "manifest.json") == m
    assert Manifest.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    assert back.fingerprint() == m.fingerprint() and len(m.fingerprint()) == 64
    assert isinstance(back.shards[0], ShardRecord) and back.shards[0].to_dict()["name"] == "shard-000000.tar"
    # Not part of the data: tool version and the skipped list.
    d = m.to_dict()
    d["tool_version"], d["skipped"] = "other", []
    assert Manifest.from_dict(d).fingerprint() == m.fingerprint()
    # Part of the data: the config and every shard record.
    for change in ({"scaling_factor": 0.25}, {"dtype": "float32"}, {"extraction": {"vae": {"source": "other"}}}):
        assert Manifest.from_dict({**m.to_dict(), **change}).fingerprint() != m.fingerprint()
    shards = m.to_dict()["shards"]
    shards[1]["sha256"] = "0" * 64
    assert Manifest.from_dict({**m.to_dict(), "shards": shards}).fingerprint() != m.fingerprint()


def test_write_is_atomic_and_refuses_invalid(tmp_path):
    m = make_set(tmp_path / "set")
    before = (tmp_path / "set" / "manifest.json").read_bytes()
    bad = Manifest.from_dict(m.to_dict())
    bad.total_samples += 1
    with pytest.raises(ValueError, match="total_samples is 12 but the shard records add up to 11"):
        write_manifest(tmp_path / "set", bad)
    assert (tmp_path / "set" / "manifest.json").read_bytes() == before
    assert not [p for p in os.listdir(tmp_path / "set") if p.startswith(".tmp-")]
    assert write_manifest(tmp_path / "set", m) == tmp_path / "set" / "manifest.json"
    assert (tmp_path / "set" / "manifest.json").read_bytes() == before  # stable bytes


def _read_error(path) -> str:
    with pytest.raises(UserError) as e:
        read_manifest(path)
    return str(e.value)


def test_damaged_manifests_have_exact_messages(tmp_path):
    folder = tmp_path / "set"
    make_set(folder)
    path = folder / "manifest.json"
    good = path.read_text()

    path.write_text(good[:200])
    msg = _read_error(folder)
    assert msg.startswith(f"{path}: invalid JSON at line ") and msg.endswith(
        "the manifest is damaged: re-copy it or rerun the extraction")

    d = json.loads(good)
    del d["dtype"], d["shards"]
    path.write_text(json.dumps(d))
    assert _read_error(folder) == f"{path}: invalid manifest: missing field(s): dtype, shards"

    path.write_text(json.dumps({**json.loads(good), "format_version": 5}))
    assert _read_error(folder) == (f"{path}: invalid manifest: unsupported format_version 5 (this tool reads "
                                   "versions 1, 2, 3 and 4); use the dit-pipeline version that wrote it, or re-extract")
    path.write_text(json.dumps({**json.loads(good), "format_version": 4}))
    assert _read_error(folder) == (f"{path}: invalid manifest: format_version 4 is the version of a set with captions "
                                   "or of a text set, but the manifest has neither")
    path.write_text(json.dumps({**json.loads(good), "format_version": 3}))
    assert _read_error(folder) == (f"{path}: invalid manifest: format_version 3 is the version of a set normalized "
                                   "per channel, but the manifest has no normalization field")
    path.write_text(json.dumps({**json.loads(good), "format_version": 2}))
    assert _read_error(folder) == (f"{path}: invalid manifest: format_version 2 is the version of a set with "
                                   "pixels, but the manifest has no pixels field")

    path.write_text(json.dumps([1, 2]))
    assert _read_error(folder) == f"{path}: invalid manifest: the top level is not a JSON object"

    path.write_text(good)
    edit_manifest(folder, store="latents", dtype="int8", num_classes=2, latent_shape=[4, 4])
    assert _read_error(folder) == (
        f"{path}: invalid manifest: store must be one of ['pixels', 'posterior', 'sample', 'text'], got 'latents'; "
        "dtype must be one of ['bfloat16', 'float16', 'float32'] (or 'uint8' exactly when store is 'pixels'), got "
        "'int8' with store 'latents'; latent_shape must be 3 positive integers [C, h, w], "
        "got [4, 4]; class_names must be 2 strings (num_classes), got 3")

    path.write_text(good)
    edit_manifest(folder, scaling_factor="0.18215", views=True)
    assert _read_error(folder) == (f"{path}: invalid manifest: scaling_factor must be int or float, got str; "
                                   "views must be int, got bool")

    path.write_text(good)
    d = json.loads(good)
    d["shards"][0]["sha256"] = "xyz"
    d["shards"][1]["name"] = "../shard-000001.tar"
    del d["shards"][2]["bytes"]
    path.write_text(json.dumps(d))
    assert _read_error(folder) == (
        f"{path}: invalid manifest: shard 'shard-000000.tar': sha256 must be 64 lowercase hex digits; "
        "shard name '../shard-000001.tar' is not of the form shard-000000.tar; "
        "shard record 'shard-000002.tar' lacks bytes")


def test_missing_manifest_says_what_to_do(tmp_path):
    assert _read_error(tmp_path) == (f"{tmp_path / 'manifest.json'}: no manifest (is {tmp_path} a shard folder "
                                     "written by dit-extract? An extraction that did not finish has no manifest "
                                     "yet: rerun it)")


def test_shard_urls(tmp_path):
    m = make_set(tmp_path / "set")
    assert m.shard_urls(str(tmp_path / "set")) == [str(tmp_path / "set" / f"shard-00000{i}.tar") for i in range(3)]
    assert m.shard_urls("https://host/data/")[2] == "https://host/data/shard-000002.tar"
    assert m.total_bytes == sum(s.bytes for s in m.shards)
