"""shards/text.py and the version 4 manifest fields: the members' rules, the records' validation."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dit_pipeline.shards import ShardError, ShardWriter, read_manifest
from dit_pipeline.shards.manifest import manifest_problems
from dit_pipeline.shards.text import (captions_problem, check_text_sample, decode_captions, decode_null,
                                      encode_captions, encode_null, encode_text_members, length_edges,
                                      length_histogram)


def test_caption_members():
    assert decode_captions(encode_captions(["a cat", "un café"])) == ["a cat", "un café"]
    assert encode_captions(["un café"]) == '["un café"]'.encode("utf-8")
    assert captions_problem([]) == "captions.json is not a non-empty JSON array of captions"
    assert captions_problem(["ok", " padded "]) == ("captions.json: caption 1 is empty or not stripped of "
                                                    "surrounding whitespace")
    with pytest.raises(ValueError, match="captions.json is not UTF-8 JSON"):
        decode_captions(b"\xff[]")


def test_text_members_and_their_checks():
    feats = [np.ones((3, 4), np.float32), np.zeros((0, 4), np.float32), np.full((2, 4), 2, np.float32)]
    fields = encode_text_members(feats, "float16")
    s = check_text_sample("000000001", fields, dtype="float16", dim=4, max_length=3)
    assert s.lengths.tolist() == [3, 0, 2] and s.text.shape == (5, 4)
    assert s.caption(2).tolist() == [[2.0] * 4] * 2 and s.caption(1).shape == (0, 4)
    with pytest.raises(ValueError) as e:
        check_text_sample("000000001", fields, dtype="float16", dim=4, max_length=2)
    assert str(e.value) == "lengths.npy [3, 0, 2] outside [0, 2] (the encoder's max length)"
    with pytest.raises(ValueError) as e:
        check_text_sample("000000001", fields, dtype="bfloat16", dim=4, max_length=3)
    assert str(e.value) == "text.npy has dtype <f2, the manifest says bfloat16 (<u2)"
    with pytest.raises(ValueError) as e:
        check_text_sample("000000001", {"text.npy": fields["text.npy"]}, dtype="float16", dim=4, max_length=3)
    assert str(e.value) == "a text sample holds lengths.npy and text.npy; missing lengths.npy"


def test_a_value_beyond_float16_is_refused_naming_the_sample(tmp_path):
    with ShardWriter(tmp_path / "shard-000000.tar", dtype="float16") as w:
        with pytest.raises(ShardError) as e:
            w.write_text("000000007", [np.full((2, 4), 1e6, np.float32)])
    assert e.value.key == "000000007" and e.value.problem.startswith("text.npy holds NaN or Inf (or overflows float16)")


def test_null_features_and_histogram():
    x = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
    for dtype in ("float16", "bfloat16", "float32"):
        entry = encode_null(x, dtype)
        got = decode_null(json.loads(json.dumps(entry)), dtype, 3)
        assert got.shape == (2, 3) and entry["tokens"] == 2
        tol = {"float16": 2 ** -11, "bfloat16": 2 ** -8, "float32": 0}[dtype]
        assert np.abs(got - x).max() <= tol * np.abs(x).max()
    assert decode_null(encode_null(np.zeros((0, 3), np.float32), "bfloat16"), "bfloat16", 3).shape == (0, 3)
    assert length_edges(77) == [0, 1, 2, 4, 8, 16, 32, 64, 77, 78]
    assert length_histogram([0, 1, 5, 64, 76, 77, 77], 77) == [1, 1, 0, 1, 0, 0, 0, 2, 2]


def test_version_4_manifest_rules(qwen3_text_set, captioned_set):
    text = read_manifest(qwen3_text_set).to_dict()
    latent = read_manifest(captioned_set).to_dict()
    assert manifest_problems(text) == [] and manifest_problems(latent) == []
    assert manifest_problems({**text, "format_version": 1}) == [
        "text, store 'text': format version 4 only, but format_version is 1"]
    assert manifest_problems({**text, "captions": latent["captions"]}) == ["a text set has no captions"]
    assert manifest_problems({**text, "latent_shape": [4, 4, 4]}) == [
        "latent_shape of a text set must be [D] (the feature width), got [4, 4, 4]",
        "text.dim must be a positive integer equal to latent_shape [D], got 32 and [4, 4, 4]"]
    assert manifest_problems({**latent, "text": text["text"]}) == [
        "a text record belongs to a text set (store 'text')"]
    broken = {**text, "text": {**text["text"], "null": {"tokens": 3, "data": "AAAA"}}}
    assert manifest_problems(broken)[0].startswith("text.null (the empty prompt's features) is unreadable")


def test_identity_problems_and_a_resume_with_another_encoder(captioned_set, qwen3_text_set, tiny_qwen3, tiny_t5,
                                                             tmp_path):
    import shutil

    from dit_pipeline.common.errors import UserError
    from dit_pipeline.common.text_encoders import from_identity, identity_problems, load_text_encoder
    from tests.captions.conftest import text_extract

    recorded = read_manifest(qwen3_text_set).text_encoder
    assert identity_problems(recorded, load_text_encoder(str(tiny_qwen3), max_length=24)) == []
    assert identity_problems(recorded, load_text_encoder(str(tiny_qwen3), max_length=16)) == [
        "max_length: 24 recorded, 16 now"]
    assert from_identity(recorded).identity == recorded  # the online encoder of a text set
    with pytest.raises(UserError) as e:
        from_identity({**recorded, "dim": 64}, where="--text shards/t")
    assert str(e.value) == (f"the text encoder of --text shards/t ({tiny_qwen3}) loads as another encoder now: dim: 64 "
                            "recorded, 32 now. Encode with the recorded one, or extract the text set again")
    folder = tmp_path / "text"
    shutil.copytree(qwen3_text_set, folder)
    with pytest.raises(UserError) as e:
        text_extract(captioned_set, tiny_t5, folder)
    assert str(e.value).startswith(f"--out {folder}: holds a shard set made with a different configuration:")
    assert "text_encoder.family: 'decoder' in the folder, 't5' now" in str(e.value)
    assert read_manifest(folder).fingerprint() == read_manifest(qwen3_text_set).fingerprint()  # nothing changed
