"""`dit-eval --make-ref FOLDER` (issue #34): a reference batch of one's own images, ADM's center crop, with the
Inception statistics the ADM evaluator's reference files hold; dit-eval then uses them."""
from __future__ import annotations

import numpy as np
from click.testing import CliRunner
from PIL import Image

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
    assert r.output.strip().splitlines()[-1] == f"wrote {out}: 5 images of 16x16 (1 skipped, named in the log)"
    order = ["5.png", "a/1.png", "a/2.jpg", "b/3.png", "b/4.png"]  # sorted by relative path
    with np.load(out) as z:
        assert sorted(z.files) == ["arr_0", "mu", "mu_s", "sigma", "sigma_s"]
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
    assert abs(float(r.output.splitlines()[1].split(": ")[1])) < 1e-6  # the same images in another order
    again = CliRunner().invoke(eval_main, ["--make-ref", str(val), "--image-size", "16", "--out", str(out), *FAST])
    assert again.exit_code == 1 and f"--out {out} already exists" in again.output
    bad = CliRunner().invoke(eval_main, ["--make-ref", str(val), "--out", str(tmp_path / "x.npz")])
    assert bad.exit_code == 2 and "--make-ref needs --image-size N" in bad.output
