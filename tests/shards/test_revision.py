"""Manifest revisions (shards/revision.py) and the normalization field: `dit-shards stats --write` and
`--latent-stats` keep the old manifest byte for byte, change the fingerprint exactly when the numbers change,
verify accepts the kept files, and format version 3 is what a per-channel set is, refused by readers that
predate it."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.shards import read_manifest, verify_shards
from dit_pipeline.shards.revision import revise
from dit_pipeline.shards.stats import compute_stats
from tests._util import run_cli
from tests.shards._helpers import arrays_for, make_set

KEYS = [k for k in range(12) if k != 5]  # make_set's samples (key 5 is a skipped image)


def test_write_per_channel_keeps_the_old_manifest_and_normalizes_to_unit_std(tmp_path):
    folder = tmp_path / "set"
    make_set(folder, store="sample")
    before = (folder / "manifest.json").read_bytes()
    old = read_manifest(folder)
    r = revise(folder, mode="per-channel", max_samples=100, seed=0)
    assert r["written"] and r["revision"] == 2 and r["kept"] == str(folder / "manifest.json.rev1")
    assert (folder / "manifest.json.rev1").read_bytes() == before  # the replaced manifest, byte for byte
    m = read_manifest(folder)
    assert m.format_version == 3 and m.revision == {
        "number": 2, "previous": "manifest.json.rev1", "by": "dit-shards stats --write per-channel --max-samples "
        "100 --seed 0"}
    z = np.stack([arrays_for(k, store="sample")["latent"] for k in KEYS]).astype(np.float64)  # [N, V, C, h, w]
    per = z.transpose(2, 0, 1, 3, 4).reshape(z.shape[2], -1)
    norm = m.normalization
    np.testing.assert_allclose(norm["mean"], per.mean(1), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(norm["std"], per.std(1), rtol=1e-6)
    assert (norm["form"], norm["multiplier"]) == ("mean_std", 1.0)
    assert norm["source"] == {"kind": "stats", "samples_used": 11, "max_samples": 100, "seed": 0, "store": "sample",
                              "revision": 2}
    # everything but the normalization, the version and the revision record is as before
    a, b = old.to_dict(), m.to_dict()
    assert {k for k in set(a) | set(b) if a.get(k) != b.get(k)} == {"normalization", "format_version", "revision"}
    assert r["old_fingerprint"] == old.fingerprint() != r["new_fingerprint"] == m.fingerprint()
    after = r["after"]  # the same samples under the new normalization: mean 0, std 1 per channel
    np.testing.assert_allclose(after["channel_mean"], 0.0, atol=1e-6)
    np.testing.assert_allclose(after["channel_std"], 1.0, rtol=1e-6)
    assert after["near_unit_std"] and after == compute_stats(folder, max_samples=100, seed=0)
    assert verify_shards(folder).ok  # the kept revision is not an extra file
    again = revise(folder, mode="per-channel", max_samples=100, seed=0)  # the same numbers: nothing written
    assert not again["written"] and not (folder / "manifest.json.rev2").exists()


def test_write_scalar_and_a_stats_file_then_verify_and_stray_revisions(tmp_path):
    folder = tmp_path / "set"
    make_set(folder)
    s = compute_stats(folder, max_samples=100, seed=3)
    r = revise(folder, mode="scalar", max_samples=100, seed=3)
    m = read_manifest(folder)
    assert m.format_version == 1 and m.normalization is None  # a scalar revision: any reader computes it right
    assert m.scaling_factor == s["suggested_scaling_factor"] == 0.5 / s["std"] and m.shift_factor is None
    assert r["after"]["std"] == pytest.approx(1.0, rel=1e-6)
    stats = tmp_path / "latents_stats.pt"
    torch.save({"mean": torch.zeros(1, 4, 1, 1), "std": torch.full((1, 4, 1, 1), 0.5)}, stats)
    r = revise(folder, stats_file=str(stats))
    m = read_manifest(folder)
    assert r["revision"] == 3 and m.revision["previous"] == "manifest.json.rev2"
    assert m.normalization["source"]["path"] == str(stats.resolve()) and m.norm.vectors()[0].tolist() == [2.0] * 4
    assert m.revision["by"] == f"dit-shards stats --latent-stats {stats.resolve()}"
    assert read_manifest(folder / "manifest.json.rev2").scaling_factor == 0.5 / s["std"]
    assert verify_shards(folder, quick=True).ok
    (folder / "manifest.json.rev7").write_bytes(b"{}")
    report = verify_shards(folder, quick=True)
    assert report.problems == [("manifest.json.rev7", "a kept manifest revision 7, but manifest.json is revision 3 "
                                "(left from another set? move it away)")]
    (folder / "manifest.json.rev7").unlink()
    (folder / "manifest.json.rev3").write_bytes(b"not the manifest")
    with pytest.raises(UserError, match="manifest.json.rev3 exists and is not the current manifest.json; move it "
                                        "away .* Nothing was changed"):
        revise(folder, mode="per-channel")
    assert read_manifest(folder).revision_number == 3


def test_fingerprint_covers_the_numbers_not_their_source(tmp_path):
    folder = tmp_path / "set"
    make_set(folder)
    m = read_manifest(folder)
    rec = {"form": "mean_std", "mean": [0.0] * 4, "std": [1.0] * 4, "multiplier": 1.0, "source": {"kind": "file"}}
    import dataclasses

    a = dataclasses.replace(m, format_version=3, normalization=rec)
    b = dataclasses.replace(a, normalization={**rec, "source": {"kind": "stats", "seed": 9}},
                            revision={"number": 4, "previous": "manifest.json.rev3", "by": "x"})
    c = dataclasses.replace(a, normalization={**rec, "std": [1.0, 1.0, 1.0, 2.0]})
    assert a.fingerprint() == b.fingerprint() != c.fingerprint() and a.fingerprint() != m.fingerprint()
    assert "normalization" not in m.to_dict() and "revision" not in m.to_dict()  # a scalar set: as it always was


def test_format_version_3_rules(tmp_path):
    folder = tmp_path / "set"
    make_set(folder)
    path = folder / "manifest.json"
    good = json.loads(path.read_text())
    rec = {"form": "mean_std", "mean": [0.0] * 3, "std": [1.0] * 3, "multiplier": 1.0, "source": {"kind": "file"}}

    def problem(d) -> str:
        path.write_text(json.dumps(d))
        with pytest.raises(UserError) as e:
            read_manifest(folder)
        return str(e.value).split("invalid manifest: ", 1)[1]

    assert problem({**good, "normalization": rec}) == (
        "normalization is a format version 3 field, but format_version is 1")
    assert problem({**good, "format_version": 3, "normalization": rec}) == (
        "normalization mean has 3 values for 4 latent channels; normalization std has 3 values for 4 latent channels")
    assert problem({**good, "revision": {"number": 1}}) == (
        "revision must be an object with number (an integer >= 2), previous (a file name) and by (text), got "
        "{'number': 1}")
    rec4 = {**rec, "mean": [0.0] * 4, "std": [1.0] * 4}
    path.write_text(json.dumps({**good, "format_version": 3, "normalization": rec4}))  # v3 without pixels: valid
    assert read_manifest(folder).norm.is_per_channel


def test_cli_write_and_its_refusals(tmp_path):
    folder = tmp_path / "set"
    make_set(folder)
    r = run_cli("dit-shards", ["stats", folder, "--write", "per-channel", "--latent-stats", "x.pt"])
    assert r.returncode == 2 and "--write and --latent-stats both set the normalization; give one of them" in r.stderr
    r = run_cli("dit-shards", ["stats", folder, "--write", "per-channel"])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"wrote manifest revision 2 of {folder}: per-channel over 4 channels: "
                               "(z - mean_c) * 1 / std_c (mean ")
    assert lines[0].endswith("from dit-shards stats over 11 samples (seed 0)")
    assert lines[1] == f"  the previous manifest (revision 1) is kept as {folder / 'manifest.json.rev1'}"
    assert lines[2].endswith(f"dit-train refuses to resume a run trained on revision 1 against it (continue such "
                             f"a run with --manifest {folder / 'manifest.json.rev1'})")
    assert lines[3].startswith("  after: all channels mean +0.0000 std 1.0000 -> near 1, as DiT assumes")
    info = run_cli("dit-shards", ["info", folder]).stdout
    assert "  revision: 2 (by dit-shards stats --write per-channel --max-samples 10000 --seed 0; the previous " \
           "manifest is kept as manifest.json.rev1)" in info
    assert "  scale:    per-channel over 4 channels: (z - mean_c) * 1 / std_c" in info
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"mean": [0, 0], "std": [1, 1]}))
    r = run_cli("dit-shards", ["stats", folder, "--latent-stats", bad])
    assert r.returncode == 1 and r.stderr.strip() == (
        f"error: --latent-stats {bad}: normalization mean has 2 values for 4 latent channels; normalization std "
        "has 2 values for 4 latent channels")
    assert read_manifest(folder).revision_number == 2  # nothing changed
