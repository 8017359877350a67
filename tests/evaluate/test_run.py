"""dit-eval end to end with random Inception weights of the real architecture (small input resolution to keep
it cheap): inputs, caching, multi-rank equality, bad inputs."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dit_pipeline.common.errors import UserError
from dit_pipeline.evaluate import EvalConfig, metrics, run_eval
from dit_pipeline.evaluate.inputs import check_comparable, open_source, read_features_file
from tests._util import run_cli, run_torchrun

FAST = ["--random-inception", "0", "--input-size", "75", "--batch-size", "2"]


def _images(seed: int, n: int, size: int = 32) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


@pytest.fixture
def pair(tmp_path):
    np.savez(tmp_path / "samples.npz", arr_0=_images(1, 5), arr_1=np.arange(5))
    np.savez(tmp_path / "ref.npz", arr_0=_images(2, 6))
    return tmp_path / "samples.npz", tmp_path / "ref.npz"


def _cfg(samples, ref, **kw):
    return EvalConfig(samples=str(samples), ref=str(ref), random_inception=0, input_size=75, batch_size=2,
                      quiet=True, device="cpu", **kw)


def _features(path: Path) -> dict:
    (cache,) = path.parent.glob(f".{path.name}.*.features.npz")
    return read_features_file(cache)[0]


def test_metrics_follow_from_the_cached_features_and_rerun_reads_the_cache(pair, monkeypatch):
    samples, ref = pair
    result = run_eval(_cfg(samples, ref))
    s, r = _features(samples), _features(ref)
    # spatial: 7 channels of mixed_6/conv, 3x3 at this input size (17x17 at 299)
    assert {k: v.shape for k, v in s.items()} == {"pool": (5, 2048), "spatial": (5, 63), "logits": (5, 1008)}
    # random weights: the numbers are stored under their own keys (evaluate/labels.py), never as FID
    assert "fid" not in result and result["fid_name"] == "FD-rand0-5" and result["protocol"] == "adm"
    assert result["fd_rand"] == metrics.frechet_distance_of_features(s["pool"], r["pool"])
    assert result["sfd_rand"] == pytest.approx(metrics.frechet_distance(metrics.statistics(s["spatial"]),
                                                                        metrics.statistics(r["spatial"])), rel=1e-6)
    assert result["is_rand"] == metrics.inception_score(s["logits"])
    assert (result["precision_rand"], result["recall_rand"]) == metrics.precision_recall(r["pool"], s["pool"])
    assert json.loads(Path(str(samples) + ".eval.json").read_text())["fd_rand"] == result["fd_rand"]
    # a second evaluation never runs the network
    from dit_pipeline.evaluate import features

    monkeypatch.setattr(features, "batch_features", lambda *a, **k: pytest.fail("features recomputed"))
    assert run_eval(_cfg(samples, ref))["fd_rand"] == result["fd_rand"]


def test_a_folder_gives_the_features_of_the_same_npz(pair, tmp_path):
    samples, _ = pair
    folder = tmp_path / "pngs"
    folder.mkdir()
    for i, img in enumerate(np.load(samples)["arr_0"]):
        Image.fromarray(img).save(folder / f"{i:03d}.png")
    run_eval(_cfg(folder, samples, json=str(tmp_path / "f.json")))
    assert all(np.array_equal(_features(folder)[k], _features(samples)[k]) for k in ("pool", "spatial", "logits"))


def test_precomputed_reference_statistics_are_used(pair, tmp_path):
    samples, ref = pair
    from dit_pipeline.evaluate.inception import load_inception

    mu, sigma = np.zeros(2048), np.eye(2048)
    made_by = load_inception(random_seed=0, input_size=75)[1]  # the network that made them, as --make-ref records it
    np.savez(tmp_path / "stats.npz", mu=mu, sigma=sigma, extractor=json.dumps(made_by))
    result = run_eval(_cfg(samples, tmp_path / "stats.npz", json=str(tmp_path / "a.json")))
    s = _features(samples)
    assert result["fd_rand"] == metrics.frechet_distance_to_statistics(s["pool"], metrics.Statistics(mu, sigma))
    assert result["sfd_rand"] is None and result["precision_rand"] is None and result["is_rand"] is not None
    assert result["reference_statistics"] == "precomputed"


@pytest.mark.timeout(900)
def test_two_ranks_give_the_features_and_metrics_of_one(pair, tmp_path):
    samples, ref = pair
    one = run_cli("dit-eval", [samples, "--ref", ref, "--json", tmp_path / "one.json", *FAST], timeout=600)
    assert one.returncode == 0, one.stderr
    assert "FD-rand0-5 (not FID): " in one.stdout and "Recall-rand: " in one.stdout and "FID:" not in one.stdout
    single = _features(samples)
    for cache in tmp_path.glob(".*.features.npz"):
        cache.unlink()
    two = run_torchrun("dit-eval", [samples, "--ref", ref, "--json", tmp_path / "two.json", *FAST], timeout=600)
    assert two.returncode == 0, two.stderr
    assert all(np.array_equal(single[k], _features(samples)[k]) for k in single)  # same batches, same threads
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert [a[k] for k in metrics_names()] == [b[k] for k in metrics_names()]


def metrics_names():
    return ("is_rand", "fd_rand", "sfd_rand", "precision_rand", "recall_rand")


@pytest.mark.parametrize("arr, message", [
    (np.zeros((4, 8, 8, 3), np.float32), r"arr_0 is float32; the ADM format is uint8"),
    (np.full((4, 8, 8, 3), np.nan, np.float32), r"arr_0 is float32 and contains NaN; the ADM format is uint8"),
    (np.zeros((4, 8, 8), np.uint8), r"arr_0 has shape \[4, 8, 8\]; the ADM format is uint8 \[N, H, W, 3\]"),
    (np.zeros((4, 8, 8, 4), np.uint8), r"arr_0 has shape \[4, 8, 8, 4\]"),
])
def test_bad_npz_is_a_clear_error(tmp_path, arr, message):
    np.savez(tmp_path / "bad.npz", arr_0=arr)
    with pytest.raises(UserError, match=message):
        open_source(tmp_path / "bad.npz", "SAMPLES")


def test_too_few_samples_mismatched_sizes_and_nan_statistics(tmp_path):
    np.savez(tmp_path / "three.npz", arr_0=_images(0, 3))
    np.savez(tmp_path / "ref.npz", arr_0=_images(1, 6))
    np.savez(tmp_path / "big.npz", arr_0=_images(1, 6, size=64))
    np.savez(tmp_path / "nan.npz", mu=np.full(4, np.nan), sigma=np.eye(4))
    three, ref, big = (open_source(tmp_path / f"{n}.npz", n) for n in ("three", "ref", "big"))
    with pytest.raises(UserError, match=r"has 3 images: precision and recall \(k = 3 nearest neighbours\) need at "
                                        r"least 4 on each side"):
        check_comparable(three, ref)
    with pytest.raises(UserError) as e:
        check_comparable(ref, big)
    assert str(e.value) == (f"SAMPLES {tmp_path / 'ref.npz'} are 32x32 but REF {tmp_path / 'big.npz'} is 64x64: "
                            "compare against the reference batch of the samples' resolution (e.g. "
                            "VIRTUAL_imagenet256_labeled.npz for 256x256)")
    with pytest.raises(UserError, match=r"nan.npz: mu has NaN or Inf values"):
        open_source(tmp_path / "nan.npz", "REF")


def test_folder_of_mixed_sizes_names_the_odd_image(tmp_path):
    for i, size in enumerate((16, 16, 24)):
        Image.fromarray(_images(i, 1, size)[0]).save(tmp_path / f"{i}.png")
    src = open_source(tmp_path, "SAMPLES")
    with pytest.raises(UserError, match=r"2.png is 24x24 but the other images of its folder are 16x16"):
        src.read(0, 3)


def test_cli_bad_input_exits_1_with_one_line(tmp_path):
    np.savez(tmp_path / "bad.npz", arr_0=np.zeros((4, 8, 8), np.uint8))
    res = run_cli("dit-eval", [tmp_path / "bad.npz", "--ref", tmp_path / "bad.npz", *FAST], timeout=300)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [
        f"error: SAMPLES {tmp_path / 'bad.npz'}: arr_0 has shape [4, 8, 8]; the ADM format is uint8 [N, H, W, 3] "
        "(NHWC, RGB, N >= 1)"]


def test_the_readme_trial_without_weights_runs_offline(tmp_path):
    """docs/evaluation.md "Trying FID without the Inception weights": its command, as written, in a folder holding
    samples/trial.npz; the numbers are finite but mean nothing (random weights)."""
    import shlex

    from tests._docs import block_after

    block = block_after("docs/evaluation.md", "## Trying FID without the Inception weights")
    [words] = [shlex.split(line) for line in block.strip().splitlines()]
    assert words[0] == "dit-eval"
    (tmp_path / "samples").mkdir()
    np.savez(tmp_path / "samples" / "trial.npz", arr_0=_images(3, 8))
    res = run_cli("dit-eval", words[1:], timeout=300, cwd=tmp_path, env={"TORCH_HOME": str(tmp_path / "no-hub")})
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert lines[0].startswith("[adm] ADM evaluator") and "Inception network: RANDOM weights" in lines[0]
    assert [x.split(":")[0] for x in lines[1:6]] == ["IS-rand (not IS)", "FD-rand0-8 (not FID)",
                                                     "sFD-rand0-8 (not FID)", "Precision-rand", "Recall-rand"]
    assert abs(float(lines[2].split(": ")[1])) < 1e-3  # the samples against themselves
    assert lines[6] == "wrote samples/trial.npz.eval.json"
    assert not (tmp_path / "no-hub").exists()  # no weights file looked up or fetched
