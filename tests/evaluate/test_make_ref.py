"""`dit-eval --make-ref FOLDER` (issue #34): a reference batch of one's own images, ADM's center crop, with the
Inception statistics the ADM evaluator's reference files hold; dit-eval then uses them."""
from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner
from PIL import Image

import pytest

from dit_pipeline.cli import eval_main
from dit_pipeline.evaluate import metrics as M
from dit_pipeline.evaluate.features import local_features
from dit_pipeline.evaluate.inception import load_inception
from dit_pipeline.extract.images import load_and_crop

FAST = ["--random-inception", "0", "--input-size", "75", "--batch-size", "4"]


def test_make_ref_crops_like_adm_and_stores_the_statistics(tmp_path):
    val = tmp_path / "val"
    rng = np.random.default_rng(0)
    sizes = {"a/1.png": (40, 30), "a/2.jpg": (33, 70), "b/3.png": (64, 64), "b/4.png": (20, 90), "5.png": (50, 41)}
    for rel, (w, h) in sizes.items():
        (val / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(val / rel)
    (val / "b" / "broken.png").write_bytes(b"not an image")
    out = tmp_path / "val16.npz"
    r = CliRunner().invoke(eval_main, ["--make-ref", str(val), "--image-size", "16", "--out", str(out), "--quiet",
                                       *FAST])
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert lines[-1].startswith(f"wrote {out}: 5 images of 16x16 (1 skipped, named in the log) and their Inception "
                                "statistics (random-seed-0), ")
    assert sum(line.startswith("wrote ") for line in lines) == 1  # said once (issue 41: it was printed twice)
    order = ["5.png", "a/1.png", "a/2.jpg", "b/3.png", "b/4.png"]  # sorted by relative path
    with np.load(out) as z:
        assert sorted(z.files) == ["arr_0", "extractor", "mu", "mu_s", "sigma", "sigma_s"]
        made_by = json.loads(str(z["extractor"]))
        assert (made_by["weights"], made_by["random_seed"], made_by["input_size"]) == ("random-seed-0", 0, 75)
        arr = z["arr_0"]
        assert arr.dtype == np.uint8 and arr.shape == (5, 16, 16, 3)
        assert all(np.array_equal(arr[i], load_and_crop(val / rel, 16)[0]) for i, rel in enumerate(order))
        model, _ = load_inception(None, random_seed=0, input_size=75)
        _, feats = local_features(model, [(list(range(5)), arr)], "cpu")
        np.testing.assert_allclose(z["mu"], M.statistics(feats["pool"]).mu, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(z["sigma_s"], M.statistics(feats["spatial"]).sigma, rtol=1e-5, atol=1e-6)
    # the new reference is used as ADM's are: its statistics for FID
    np.savez(tmp_path / "s.npz", arr_0=arr[::-1].copy())
    r = CliRunner().invoke(eval_main, [str(tmp_path / "s.npz"), "--ref", str(out), "--quiet", *FAST])
    assert r.exit_code == 0, r.output
    fd = next(line for line in r.output.splitlines() if line.startswith("FD-rand0-5 (not FID): "))
    assert abs(float(fd.split(": ")[1])) < 1e-6  # the same images in another order
    again = CliRunner().invoke(eval_main, ["--make-ref", str(val), "--image-size", "16", "--out", str(out), *FAST])
    assert again.exit_code == 1 and f"--out {out} already exists" in again.output
    bad = CliRunner().invoke(eval_main, ["--make-ref", str(val), "--out", str(tmp_path / "x.npz")])
    assert bad.exit_code == 2 and "--make-ref needs --image-size N" in bad.output


def _ref(tmp_path, seed: int = 0):
    val = tmp_path / "val"
    rng = np.random.default_rng(seed)
    for i in range(5):
        (val / "c").mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(val / "c" / f"{i}.png")
    out = tmp_path / "ref16.npz"
    r = CliRunner().invoke(eval_main, ["--make-ref", str(val), "--image-size", "16", "--out", str(out), "--quiet",
                                       *FAST])
    assert r.exit_code == 0, r.output
    return out


def test_a_reference_of_another_network_is_refused(tmp_path):
    """Issue 41 item 3: a reference made by one Inception network evaluated with another gave FID 13.09 where the
    same network gives 0.40; now the file records its network and another is refused before any feature work."""
    ref = _ref(tmp_path)
    np.savez(tmp_path / "s.npz", arr_0=np.random.default_rng(1).integers(0, 256, (5, 16, 16, 3), dtype=np.uint8))
    other = ["--random-inception", "1", "--input-size", "75", "--batch-size", "4"]
    r = CliRunner().invoke(eval_main, [str(tmp_path / "s.npz"), "--ref", str(ref), "--quiet", *other])
    assert r.exit_code == 1
    assert r.output.strip().splitlines()[-1] == (
        f"error: REF {ref} holds statistics of RANDOM weights (random-seed-0: not FID), input 75, dit-pipeline "
        "evaluate/inception.py, resize tf1, but this evaluation runs RANDOM weights (random-seed-1: not FID), input "
        "75, dit-pipeline evaluate/inception.py, resize tf1: their distance would mean nothing. Evaluate with the "
        "network that made it (--random-inception 0 --input-size 75), or make it again with this one (dit-eval "
        "--make-ref)")
    assert not (tmp_path / "s.npz.eval.json").exists() and not list(tmp_path.glob(".s.npz.*features.npz"))
    ok = CliRunner().invoke(eval_main, [str(tmp_path / "s.npz"), "--ref", str(ref), "--quiet", *FAST])
    assert ok.exit_code == 0, ok.output
    result = json.loads((tmp_path / "s.npz.eval.json").read_text())
    assert result["ref"]["provenance"] == "dit-eval --make-ref, tf-inception-2015-12-05.v1.input75 with random-seed-0"
    assert result["ref"]["extractor"]["random_seed"] == 0


def test_known_reference_files_are_identified(tmp_path):
    """ADM's reference batches (by name and members) and iMF's/JiT's statistics (ref_mu, ref_sigma) were made by
    the published weights: a random network's distance to them is refused; ref_mu/ref_sigma are read as
    statistics; a file that records nothing is accepted with the published weights only (a warning)."""
    from dit_pipeline.common.errors import UserError
    from dit_pipeline.evaluate.inception import load_inception
    from dit_pipeline.evaluate.inputs import open_source
    from dit_pipeline.evaluate.run import check_network

    rng = np.random.default_rng(2)
    stats = dict(mu=np.zeros(2048), sigma=np.eye(2048), mu_s=np.zeros(2023), sigma_s=np.eye(2023))
    np.savez(tmp_path / "VIRTUAL_imagenet256_labeled.npz", arr_0=rng.integers(0, 256, (4, 8, 8, 3), np.uint8), **stats)
    np.savez(tmp_path / "renamed.npz", arr_0=rng.integers(0, 256, (4, 8, 8, 3), np.uint8), **stats)
    np.savez(tmp_path / "imagenet_256_fid_stats.npz", ref_mu=np.ones(2048), ref_sigma=np.eye(2048))
    adm, renamed, imf = (open_source(tmp_path / n, "REF") for n in
                         ("VIRTUAL_imagenet256_labeled.npz", "renamed.npz", "imagenet_256_fid_stats.npz"))
    assert adm.provenance == ("the ADM evaluator's reference batch VIRTUAL_imagenet256_labeled.npz: TF graph "
                              "inception-2015-12-05") and adm.extractor["weights"] == "published (TF graph)"
    assert renamed.extractor is None and renamed.provenance.startswith("ADM's layout without a network record")
    assert imf.kind == "statistics" and imf.stats_keys == ("ref_mu", "ref_sigma")
    assert np.array_equal(imf.stats["pool"].mu, np.ones(2048))
    random = load_inception(random_seed=0, input_size=75)[1]
    published = {**random, "weights": "weights-inception-2015-12-05-6726825d.pth", "random_seed": None,
                 "weights_sha256": "6726825d" + "0" * 56, "input_size": 299}
    for src in (adm, imf):
        with pytest.raises(UserError, match=r"holds statistics of inception-2015-12-05 \(published \(TF graph\)"):
            check_network(src, random, "REF")
        assert check_network(src, published, "REF") is None
    with pytest.raises(UserError, match=r"holds statistics of an unrecorded network \(ADM's layout"):
        check_network(renamed, random, "REF")
    assert check_network(renamed, published, "REF").endswith("assumed to be inception-2015-12-05's published weights")


def test_make_ref_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    from dit_pipeline.common import faults

    val = tmp_path / "val"
    (val / "c").mkdir(parents=True)
    for i in range(3):
        Image.fromarray(np.full((20, 20, 3), 40 * i, np.uint8)).save(val / "c" / f"{i}.png")
    monkeypatch.setenv("DIT_FAULT", "eval.make_ref_write:enospc")
    faults._counts.clear()
    out = tmp_path / "ref.npz"
    r = CliRunner().invoke(eval_main, ["--make-ref", str(val), "--image-size", "16", "--out", str(out), "--quiet",
                                       *FAST])
    assert r.exit_code == 1 and "Traceback" not in r.output
    message = r.output.strip().splitlines()[-1]
    assert message.startswith(
        f"error: cannot write --out {out}: No space left on device (injected at eval.make_ref_write) (the disk is "
        "full); nothing was written. Free space or pass --out on another disk (it needs at least ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["val"]
    # the size said is the file's (issue 47: "about 0 MiB" counted the images alone)
    monkeypatch.delenv("DIT_FAULT")
    faults._counts.clear()
    made = tmp_path / "made" / "ref.npz"
    made.parent.mkdir()
    assert CliRunner().invoke(eval_main, ["--make-ref", str(val), "--image-size", "16", "--out", str(made),
                                          "--quiet", *FAST]).exit_code == 0
    said = float(message.rsplit("at least ", 1)[1].removesuffix(" MiB)"))
    assert made.stat().st_size > 2**25 and 0 <= made.stat().st_size / 2**20 - said < 0.1
    made.unlink()
    made.parent.rmdir()
    monkeypatch.setenv("DIT_FAULT", "eval.make_ref_write:enospc")
    # a captioned reference: its prompts file, written first, goes too
    captions = tmp_path / "c.jsonl"
    captions.write_text("".join(f'{{"file": "{i}.png", "caption": "gray {i}"}}\n' for i in range(3)))
    faults._counts.clear()
    r = CliRunner().invoke(eval_main, ["--make-ref", str(val), "--captions", str(captions), "--image-size", "16",
                                       "--out", str(out), "--quiet", *FAST])
    assert r.exit_code == 1 and r.output.strip().splitlines()[-1].startswith(f"error: cannot write --out {out}: No "
                                                                             "space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "val"]


def test_imf_against_a_make_ref_reference_uses_its_own_resize(tmp_path):
    """Issue 47 (ok case): `--protocol adm,imf` against a `--make-ref` reference computed iMF's distance from
    iMF-resized sample features against the reference's TF1-resized statistics. The reference records its resize:
    where the protocol's differs, the statistics come from its images under the protocol's network (said in the
    notes), and a statistics-only file made with the other resize is refused."""
    ref = _ref(tmp_path)
    samples = np.random.default_rng(1).integers(0, 256, (6, 16, 16, 3), dtype=np.uint8)
    np.savez(tmp_path / "s.npz", arr_0=samples)
    r = CliRunner().invoke(eval_main, [str(tmp_path / "s.npz"), "--ref", str(ref), "--protocol", "adm,imf",
                                       "--quiet", *FAST])
    assert r.exit_code == 0, r.output
    secs = json.loads((tmp_path / "s.npz.eval.json").read_text())["protocols"]
    assert secs["adm"]["reference_statistics"] == "precomputed"
    assert secs["imf"]["reference_statistics"] == "computed from its images"
    assert secs["imf"]["notes"] == [f"{ref}: its statistics were made with the tf1 resize; protocol imf resizes as "
                                    "imf, so they are computed from its images' features"]
    model, _ = load_inception(None, random_seed=0, input_size=75, resize="imf")
    with np.load(ref) as z:
        _, mine = local_features(model, [(list(range(5)), z["arr_0"])], "cpu")
    _, theirs = local_features(model, [(list(range(6)), samples)], "cpu")
    want = M.frechet_distance_eigvals(M.statistics(mine["pool"]), M.statistics(theirs["pool"]))
    assert abs(secs["imf"]["numbers"]["fd_rand"] - want) <= 1e-6 * max(1.0, abs(want))
    # the statistics alone (no images to recompute from): refused before any feature work
    with np.load(ref) as z:
        np.savez(tmp_path / "stats.npz", **{k: z[k] for k in z.files if k != "arr_0"})
    r = CliRunner().invoke(eval_main, [str(tmp_path / "s.npz"), "--ref", str(tmp_path / "stats.npz"), "--protocol",
                                       "imf", "--quiet", "--json", str(tmp_path / "x.json"), *FAST])
    assert r.exit_code == 1
    assert r.output.strip().splitlines()[-1] == (
        f"error: REF {tmp_path / 'stats.npz'} holds statistics made with the tf1 resize, but this protocol resizes as "
        "imf: their distance mixes two inputs of the network. Pass the images it was made from, or make it with this "
        "protocol's network")
    assert not (tmp_path / "x.json").exists()
