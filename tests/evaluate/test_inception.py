"""The TF-FID InceptionV3 with random weights of the real architecture: the same outputs as torch-fidelity's
independent port given the same weights, the ADM output shapes, and weight-file handling."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.evaluate import inception as inc


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return inc.load_inception(random_seed=0)[0]


@pytest.fixture(scope="module")
def images():
    return torch.from_numpy(np.random.default_rng(0).integers(0, 256, (2, 40, 56, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def outputs(model, images):
    return model(images)


def test_outputs_have_the_adm_shapes(outputs):
    assert {k: list(v.shape) for k, v in outputs.items()} == {
        "pool": [2, 2048], "spatial": [2, 17 * 17 * 7], "logits": [2, 1008]}
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in outputs.values())
    assert (outputs["pool"] >= 0).all()  # an average of ReLU outputs
    assert not torch.equal(outputs["pool"][0], outputs["pool"][1])


def test_matches_torch_fidelity_with_the_same_weights(model, images, outputs):
    """torch-fidelity's port (test dependency) loads our state_dict unchanged and gives the same pool features
    and bias-free logits; its Mixed_6d.branch1x1 output (TF's mixed_6/conv) gives our spatial features."""
    from unittest import mock

    fe = pytest.importorskip("torch_fidelity.feature_extractor_inceptionv3")
    state = model.state_dict()
    with mock.patch.object(fe, "load_state_dict_from_url", lambda *a, **k: state):
        theirs = fe.FeatureExtractorInceptionV3("inception-v3-compat", ["2048", "logits_unbiased"])
    kept = {}
    theirs.Mixed_6d.branch1x1.register_forward_hook(lambda m, i, o: kept.setdefault("b", o.clone()))
    pool, logits = theirs(images.permute(0, 3, 1, 2).contiguous())
    spatial = kept["b"][:, :7].permute(0, 2, 3, 1).reshape(2, -1)
    # same float32 operations in the same order on the same CPU: equal up to kernel rounding
    torch.testing.assert_close(outputs["pool"], pool, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outputs["logits"], logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outputs["spatial"], spatial, rtol=1e-5, atol=1e-6)


def test_resize_is_tensorflow1_bilinear():
    """TF1 resize_bilinear (align_corners=False): source coordinate = destination * in/out, no half-pixel."""
    x = torch.arange(4.0).reshape(1, 1, 1, 4).expand(1, 1, 2, 4)
    out = inc.tf1_resize_bilinear(x, 8)  # scale 0.5: 0, .5, 1, 1.5, 2, 2.5, 3, 3 (clamped at the edge)
    torch.testing.assert_close(out[0, 0, 0], torch.tensor([0, .5, 1, 1.5, 2, 2.5, 3, 3]))
    fid = pytest.importorskip("torch_fidelity.interpolate_compat_tensorflow")
    y = torch.rand(2, 3, 37, 53) * 255
    assert torch.equal(inc.tf1_resize_bilinear(y, 299),
                       fid.interpolate_bilinear_2d_like_tensorflow1x(y, size=(299, 299), align_corners=False))


def test_rejects_images_that_are_not_uint8_nhwc(model):
    with pytest.raises(ValueError, match=r"expected uint8 images \[N, H, W, 3\], got torch.float32"):
        model(torch.zeros(1, 8, 8, 3))


def test_weights_file_loads_safely_and_bad_files_are_named(tmp_path, model):
    good = tmp_path / inc.WEIGHTS_FILE
    torch.save(model.state_dict(), good)
    loaded, ident = inc.load_inception(good)
    assert ident["weights"] == inc.WEIGHTS_FILE and len(ident["weights_sha256"]) == 64
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    other = tmp_path / "other.pt"
    torch.save({"blocks.0.weight": torch.zeros(3)}, other)
    with pytest.raises(UserError, match=r"is not the TF-FID InceptionV3 \(weights-inception-2015-12-05-6726825d"
                                        r"\.pth\): \d+ missing, 1 unexpected"):
        inc.load_inception(other)
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"not a zip")
    with pytest.raises(UserError, match="is not a readable PyTorch weights file"):
        inc.load_inception(junk)
    with pytest.raises(UserError, match=r"missing.pth\)\)\. Download https://\S+/weights-inception-2015-12-05-"
                                        r"6726825d\.pth and pass --inception PATH, or put it at "):
        inc.load_inception(tmp_path / "missing.pth")


def test_offline_without_weights_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError) as e:
        inc.load_inception()
    where = tmp_path / "hub" / "checkpoints" / inc.WEIGHTS_FILE
    assert str(e.value) == (f"the Inception weights are not available (offline). Download {inc.WEIGHTS_URL} and "
                            f"pass --inception PATH, or put it at {where}")
