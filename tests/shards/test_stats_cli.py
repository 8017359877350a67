"""`dit-shards stats` numbers, and the dit-shards CLI end to end (exit codes, text and JSON output)."""
import json

import numpy as np
import pytest

from dit_pipeline.shards import shard_name
from dit_pipeline.shards.stats import compute_stats
from tests._util import run_cli
from tests.shards._helpers import arrays_for, edit_manifest, make_set, replace_member


def _expected(keys, shift, scale):
    z = np.stack([arrays_for(k, store="sample")["latent"] for k in keys]).astype(np.float64)  # [N, V, C, h, w]
    x = ((z - shift) * scale) if shift is not None else z * scale
    per = x.transpose(2, 0, 1, 3, 4).reshape(x.shape[2], -1)
    return per.mean(1), per.std(1), x.mean(), x.std()


@pytest.mark.parametrize("shift", [None, 0.25])
def test_stats_of_stored_latents_are_exact(tmp_path, shift):
    make_set(tmp_path / "set", store="sample", shift=shift, scale=0.5)
    s = compute_stats(tmp_path / "set", max_samples=100)
    keys = [k for k in range(12) if k != 5]
    mean, std, all_mean, all_std = _expected(keys, shift, 0.5)
    assert s["samples_used"] == 11 and s["total_samples"] == 11
    np.testing.assert_allclose(s["channel_mean"], mean, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(s["channel_std"], std, rtol=1e-6)
    assert s["mean"] == pytest.approx(all_mean, abs=1e-7) and s["std"] == pytest.approx(all_std, rel=1e-6)
    assert s["suggested_scaling_factor"] == pytest.approx(0.5 / all_std, rel=1e-6)
    assert s["near_unit_std"] == (abs(all_std - 1) <= 0.1)
    assert s["classes"] == {"counts": [4, 4, 3], "min": 3, "max": 4, "argmin": "eel", "argmax": "cat", "empty": []}


def test_stats_spread_over_shards_and_count_every_label(tmp_path):
    make_set(tmp_path / "set", store="sample")
    edit_manifest(tmp_path / "set", class_names=["cat", "dog", "eel", "fox"], num_classes=4)
    s = compute_stats(tmp_path / "set", max_samples=3)
    mean, std, _, _ = _expected([0, 4, 8], None, 0.5)  # the first sample of each shard
    assert s["samples_used"] == 3
    np.testing.assert_allclose(s["channel_mean"], mean, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(s["channel_std"], std, rtol=1e-6)
    assert s["classes"]["counts"] == [4, 4, 3, 0] and s["classes"]["empty"] == ["fox"]


def test_stats_of_posterior_are_seeded(tmp_path):
    make_set(tmp_path / "set")
    a, b = compute_stats(tmp_path / "set", seed=1), compute_stats(tmp_path / "set", seed=1)
    c = compute_stats(tmp_path / "set", seed=2)
    assert a == b and a["channel_std"] != c["channel_std"]
    means = np.stack([arrays_for(k)["mean"] for k in range(12) if k != 5]) * 0.5
    # mean + std * noise with small std: the channel means stay close to those of the posterior means.
    np.testing.assert_allclose(a["channel_mean"], means.mean(axis=(0, 1, 3, 4)), atol=0.02)


def test_cli_verify_exit_codes_and_reports(tmp_path):
    folder = tmp_path / "set"
    make_set(folder)
    ok = run_cli("dit-shards", ["verify", folder, "--quiet"])
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[-1] == "OK: no problems found" and "3 shards, 11 samples" in ok.stdout
    replace_member(folder, shard_name(2), "000000009.cls", b"7")
    (folder / shard_name(0)).unlink()
    bad = run_cli("dit-shards", ["verify", folder, "--jobs", "2"])
    assert bad.returncode == 1
    assert bad.stdout.splitlines()[1:] == [
        "FAILED: 2 problems in 2 file(s)",
        "  shard-000000.tar: missing: listed in the manifest but not found",
        "  shard-000002.tar: sample 000000009: label 7 out of range [0, 3)",
    ]
    assert "Traceback" not in bad.stderr
    js = run_cli("dit-shards", ["verify", folder, "--json", "--quick"])
    assert js.returncode == 1
    d = json.loads(js.stdout)
    assert d["ok"] is False and d["quick"] is True and d["problems"] == [
        {"file": "shard-000000.tar", "problem": "missing: listed in the manifest but not found"}]


@pytest.mark.parametrize("args,message", [
    (["verify", "{tmp}/nope"], "Directory '{tmp}/nope' does not exist"),
    (["verify", "{tmp}", "--jobs", "0"], "0 is not in the range x>=1"),
    (["verify", "{tmp}", "--fast"], ("No such option", "--fast")),  # click < 8.3.1 does not quote the name
    (["stats", "{tmp}", "--max-samples", "0"], "0 is not in the range x>=1"),
    (["frobnicate"], "No such command 'frobnicate'"),
])
def test_cli_usage_errors_exit_2(tmp_path, args, message):
    r = run_cli("dit-shards", [a.format(tmp=tmp_path) for a in args])
    parts = message if isinstance(message, tuple) else (message,)
    assert r.returncode == 2 and all(p.format(tmp=tmp_path) in r.stderr for p in parts), r.stderr


def test_cli_info_and_stats(tmp_path):
    folder = tmp_path / "set"
    make_set(folder)
    info = run_cli("dit-shards", ["info", folder])
    assert info.returncode == 0, info.stderr
    lines = info.stdout.splitlines()
    assert lines[0] == f"shard set {folder} (format v1, written by dit-pipeline test)"
    assert lines[1].startswith("  samples:  11 in 3 shards of up to 4, ")
    assert lines[3] == ("  latents:  posterior (mean.npy + std.npy), float16, [2, 4, 4, 4] per sample (2 views), "
                        "from 32px images")
    assert lines[4] == "  pixels:   none (extracted without --pixels)"
    assert lines[5] == "  scale:    scaling_factor 0.5, no shift_factor"
    assert lines[7] == "  geometry: VAE, f8: 32 px -> 4 x 4 x 4 (posterior)"  # the test set records no VAE class
    assert lines[8] == "  skipped:  1 inputs (cannot decode: 1)"
    d = json.loads(run_cli("dit-shards", ["info", folder, "--json"]).stdout)
    assert (d["samples"], d["shards"], d["classes"], d["skipped"]) == (11, 3, 3, 1)
    st = run_cli("dit-shards", ["stats", folder, "--max_samples", "5", "--json"])  # underscore alias
    assert st.returncode == 0, st.stderr
    assert json.loads(st.stdout) == json.loads(json.dumps(compute_stats(folder, max_samples=5)))
    text = run_cli("dit-shards", ["stats", folder]).stdout
    assert "suggested scaling_factor for unit std" in text and "classes: 3, samples per class min 3 (eel)" in text
    missing = run_cli("dit-shards", ["info", tmp_path])
    assert missing.returncode == 1 and missing.stderr.startswith(f"error: {tmp_path / 'manifest.json'}: no manifest")
