"""`dit-eval --protocol` (issue 41, item 8): each published evaluation protocol's rules, checked against an
independent transcription of the release's own code (file and line named; snapshots End2End-Diffusion/
diffusion-bench 4848f0c and Lyy-iiis/imeanflow bf60cd7), and the numbers of all of them from one set of samples,
each named with its protocol, network, sample count and reference."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dit_pipeline.evaluate import EvalConfig, metrics as M, run_eval
from dit_pipeline.evaluate.inception import imf_resize, load_inception
from dit_pipeline.evaluate.protocols import PROTOCOLS, parse_protocols
from tests._util import assert_close_at_scale


def _logits(n: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, 1008)) * 3).astype(np.float32)


# --- the Inception Score rules ------------------------------------------------------------------------------------

def _nanogen_is(logits: np.ndarray) -> float:
    """End2End-Diffusion/diffusion-bench src/eval/fid.py lines 70-82 (`_inception_score`), transcribed."""
    probs = torch.nn.functional.softmax(torch.from_numpy(logits).float(), dim=1).numpy()
    n = len(probs)
    probs = probs[np.random.RandomState(0).permutation(n)]
    size = n // 10
    scores = []
    for i in range(10):
        part = probs[i * size:(i + 1) * size]
        p_y = part.mean(axis=0, keepdims=True)
        kl = part * (np.log(part + 1e-10) - np.log(p_y + 1e-10))
        scores.append(float(np.exp(kl.sum(axis=1).mean())))
    return float(np.mean(scores))


def _imf_is(logits: np.ndarray) -> float:
    """Lyy-iiis/imeanflow utils/fid_util.py lines 180-224 (`compute_inception_score`), transcribed; its softmax is
    jax.nn.softmax in float32, here torch's in float32 (equal to a few float32 ulps)."""
    logits = logits[np.random.RandomState(2020).permutation(logits.shape[0]), :]
    probs = torch.softmax(torch.from_numpy(logits), dim=-1).numpy()
    probs_64 = np.array(probs, dtype=np.float64)
    split_size = probs_64.shape[0] // 10
    scores = []
    for i in range(10):
        part = probs_64[i * split_size:(i + 1) * split_size]
        py = np.mean(part, axis=0, keepdims=True)
        kl = np.mean(np.sum(part * (np.log(part + 1e-10) - np.log(py + 1e-10)), axis=1))
        scores.append(np.exp(kl))
    return float(np.mean(np.array(scores, dtype=np.float64)))


@pytest.mark.parametrize("n", [40, 57])  # 57: the remainder of N // 10 is dropped
def test_inception_score_rules_are_the_releases(n):
    logits = _logits(n)
    nano, imf = PROTOCOLS["nanogen"].score, PROTOCOLS["imf"].score
    ours_nano = M.inception_score_permuted(logits, num_splits=nano.num_splits, seed=nano.seed, eps=nano.eps,
                                           dtype=nano.dtype)
    ours_imf = M.inception_score_permuted(logits, num_splits=imf.num_splits, seed=imf.seed, eps=imf.eps,
                                          dtype=imf.dtype)
    assert ours_nano == _nanogen_is(logits)  # the same float32 operations in the same order
    assert_close_at_scale(ours_imf, _imf_is(logits), rel=1e-12)
    # the three rules are different numbers for the same logits (ADM: consecutive splits of 5000, no eps)
    assert len({round(v, 9) for v in (ours_nano, ours_imf, M.inception_score(logits))}) == 3


def test_imf_fid_formula_is_the_releases():
    """Lyy-iiis/imeanflow utils/fid_util.py lines 16-30 (`compute_fid`), transcribed, called as its evaluator calls it
    (reference first)."""
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((300, 16)), rng.standard_normal((200, 16)) * 1.3 + 0.2
    ref, smp = M.statistics(a), M.statistics(b)
    mu1, mu2, s1, s2 = ref.mu, smp.mu, ref.sigma, smp.sigma
    diff = mu1 - mu2
    tr = np.sum(np.sqrt(np.linalg.eigvals(s1.dot(s2)).astype("complex128")).real)
    want = float(diff.dot(diff) + np.trace(s1) + np.trace(s2) - 2 * tr)
    assert M.frechet_distance_eigvals(ref, smp) == want
    assert_close_at_scale(want, M.frechet_distance(smp, ref), rel=1e-9)  # equal in exact arithmetic


# --- the networks -------------------------------------------------------------------------------------------------

def _imf_resize_release(img: torch.Tensor) -> torch.Tensor:
    """Lyy-iiis/imeanflow utils/jax_fid/resize.py lines 4-45 (`forward`), transcribed step by step: the offsets
    _7 and _12 are computed but never written into theta (torch.add, not add_)."""
    batch_size, channels, height, width = img.shape
    theta = torch.eye(2, 3)
    _7 = theta[0, 2] + (theta[0, 0] / width - theta[0, 0] / 299)  # noqa: F841 (unused, as in the release)
    _12 = theta[1, 2] + (theta[1, 1] / height - theta[1, 1] / 299)  # noqa: F841
    theta0 = theta.unsqueeze(0).repeat([batch_size, 1, 1])
    grid = F.affine_grid(theta0, [batch_size, channels, 299, 299], False)
    x0 = F.grid_sample(img, grid, "bilinear", "border", False)
    return (x0 - 128) / 128


def test_imf_resize_is_the_releases_half_pixel_rule():
    x = torch.from_numpy(np.random.default_rng(2).integers(0, 256, (2, 3, 256, 256)).astype(np.float32))
    assert torch.equal((imf_resize(x, 299) - 128) / 128, _imf_resize_release(x))
    # not TF1's rule (source = destination * in / out), which the ADM evaluator's graph uses
    from dit_pipeline.evaluate.inception import tf1_resize_bilinear

    assert (tf1_resize_bilinear(x, 299) - imf_resize(x, 299)).abs().max() > 1.0


def test_nanogen_network_is_torch_fidelitys_inception_v3_compat(tmp_path):
    """evaluate/fidelity.py gives what End2End-Diffusion/diffusion-bench src/eval/fid.py lines 40-66 compute: NHWC
    uint8 -> NCHW uint8 -> FeatureExtractorInceptionV3('inception-v3-compat', ['2048', 'logits_unbiased'])."""
    fidelity = pytest.importorskip("torch_fidelity.feature_extractor_inceptionv3")
    from dit_pipeline.evaluate.fidelity import load_fidelity_inception
    from dit_pipeline.evaluate.inception import InceptionFeatures, randomize_

    net, ident = load_fidelity_inception(random_seed=3, input_size=75)
    file = tmp_path / "w.pth"
    torch.save(randomize_(InceptionFeatures(), 3).state_dict(), file)
    fe = fidelity.FeatureExtractorInceptionV3(name="inception-v3-compat", features_list=["2048", "logits_unbiased"],
                                              feature_extractor_weights_path=str(file)).eval()
    fe.INPUT_IMAGE_SIZE = 75
    arr = np.random.default_rng(3).integers(0, 256, (3, 40, 40, 3), dtype=np.uint8)
    want_pool, want_logits = fe(torch.from_numpy(np.transpose(arr, (0, 3, 1, 2))).to(torch.uint8))
    got = net(torch.from_numpy(arr))
    assert torch.equal(got["pool"], want_pool) and torch.equal(got["logits"], want_logits)
    assert ident["implementation"].startswith("torch-fidelity") and ident["random_seed"] == 3
    # our TF-graph port gives the same features for the same weights, to float rounding
    ours, _ = load_inception(random_seed=3, input_size=75)
    assert_close_at_scale(ours(torch.from_numpy(arr))["pool"], want_pool, rel=1e-4)


def test_protocol_names_are_checked():
    assert parse_protocols("all") == ["adm", "nanogen", "imf"] and parse_protocols("imf, adm") == ["imf", "adm"]
    with pytest.raises(ValueError, match=r"--protocol fid: known protocols are adm, nanogen, imf \(or all\)"):
        parse_protocols("fid")
    from dit_pipeline.common.errors import ConfigError

    with pytest.raises(ConfigError) as e:  # text-to-image scores only: an evaluation protocol would do nothing
        EvalConfig(samples="s.npz", t2i=("clip-score",), protocol="nanogen").validate()
    assert ("--protocol nanogen chooses how FID is computed against --ref, and there is no --ref (the text-to-image "
            "evaluators do not use it); add --ref or drop --protocol") in str(e.value)
    EvalConfig(samples="s.npz", t2i=("clip-score",)).validate()


def test_each_protocol_names_its_samplers_image_conversion_from_the_sampling_protocols():
    """The evaluation protocols take their samplers' image conversions by name from dit/image_conversions.py (the
    function dit-sample --protocol applies), and each is the release's arithmetic, transcribed here: ADM's reference
    sampler, DiT's sample_ddp.py l.132 (clamp(127.5 x + 128, 0, 255), truncated); NanoGen's
    src/eval/generation.py l.167-168 (its decoder's [0, 1] images clamp(0, 1), mul(255), truncated); iMF's
    utils/sample_util.py l.28-29 (127.5 x + 128, clip to [0, 255], astype(uint8))."""
    from dit_pipeline.dit.image_conversions import CONVERSIONS

    x = torch.linspace(-1.2, 1.2, 3 * 4 * 5, dtype=torch.float32).reshape(1, 3, 4, 5)
    x[0, 0, 0, 0] = 0.0039  # 127.5 x + 128 = 128.497...: truncated, not rounded
    unit = (x + 1) / 2  # a [0, 1] decoder's images of the same pixels
    want = {
        "adm": torch.clamp(127.5 * x + 128.0, 0, 255).permute(0, 2, 3, 1).to(torch.uint8),
        "nanogen": unit.clamp(0, 1).mul(255).permute(0, 2, 3, 1).to(torch.uint8),
        "imf": torch.from_numpy(np.clip(127.5 * x.permute(0, 2, 3, 1).numpy() + 128.0, 0, 255).astype(np.uint8)),
    }
    assert {n: p.image_conversion for n, p in PROTOCOLS.items()} == {"adm": "dit", "nanogen": "nanogen", "imf": "dit"}
    for name, p in PROTOCOLS.items():
        assert p.conversion is CONVERSIONS[p.image_conversion]
        assert torch.equal(p.conversion(x, unit), want[name]), name
    assert want["adm"][0, 0, 0, 0].item() == 128 and not torch.equal(want["adm"], want["nanogen"])


# --- one set of samples, every protocol ---------------------------------------------------------------------------

def test_every_protocol_from_one_set_of_samples_is_named_with_what_produced_it(tmp_path, capsys):
    from dit_pipeline.evaluate import main

    rng = np.random.default_rng(4)
    np.savez(tmp_path / "samples.npz", arr_0=rng.integers(0, 256, (20, 32, 32, 3), dtype=np.uint8))
    np.savez(tmp_path / "ref.npz", arr_0=rng.integers(0, 256, (6, 32, 32, 3), dtype=np.uint8))
    cfg = EvalConfig(samples=str(tmp_path / "samples.npz"), ref=str(tmp_path / "ref.npz"), random_inception=0,
                     input_size=75, batch_size=20, quiet=True, device="cpu", protocol="all")
    result = main(cfg)
    out = capsys.readouterr().out
    secs = result["protocols"]
    assert list(secs) == ["adm", "nanogen", "imf"] and result["protocol"] == "adm"
    for name, sec in secs.items():
        assert sec["protocol_record"]["name"] == name and sec["sample_count"] == 20
        assert sec["reference_file"] == "ref.npz" and sec["reference_statistics"] == "computed from its images"
        assert sec["fid_name"] == "FD-rand0-20" and "fid" not in sec["numbers"]
        assert f"[{name}] " in out
    assert set(secs["adm"]["numbers"]) == {"is_rand", "fd_rand", "sfd_rand", "precision_rand", "recall_rand"}
    assert set(secs["nanogen"]["numbers"]) == set(secs["imf"]["numbers"]) == {"is_rand", "fd_rand"}
    assert secs["nanogen"]["extractor"]["implementation"].startswith("torch-fidelity")
    assert secs["imf"]["extractor"]["resize"] == "imf"
    # NanoGen's network is ours to float rounding: the same distance; iMF's resize moves it
    a, n, i = (secs[k]["numbers"]["fd_rand"] for k in ("adm", "nanogen", "imf"))
    assert_close_at_scale(n, a, rel=1e-4)
    assert abs(i - a) > 1e-4 * a
    # each protocol's IS rule on the same logits: adm's consecutive split, nanogen's and imf's permutations (10
    # splits of 2 rows: with 1 row per split every score would be exactly 1)
    assert len({secs[k]["numbers"]["is_rand"] for k in secs}) == 3
    assert json.loads((tmp_path / "samples.npz.eval.json").read_text())["protocols"]["imf"]["numbers"]["fd_rand"] == i
