"""FID during training: dit-train --fid-every logs fid & co. to metrics.jsonl from EMA samples, prints its
cost, leaves the training unchanged (identical losses with and without it), and --plot draws it."""
from __future__ import annotations

import numpy as np
import pytest

from dit_pipeline.common.hooks import HookContext
from dit_pipeline.evaluate import metrics
from dit_pipeline.train.metrics import read_metrics
from tests._util import run_cli
from tests.train.conftest import tiny_args
from tests.train.helpers import make_shard_set

FID = {"fid-every": 2, "fid-num-samples": 4, "fid-steps": 3, "fid-cfg-scale": 1.5, "fid-batch-size": 4,
       "fid-input-size": 75, "fid-random-inception": 0}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_vae_dir):
    root = tmp_path_factory.mktemp("fid-runs")
    make_shard_set(root / "shards", samples=[16, 16], latent_shape=(4, 8, 8))
    # 8x8 latents through the tiny VAE (8x downsampling) are 64x64 images
    np.savez(root / "ref.npz", arr_0=np.random.default_rng(0).integers(0, 256, (6, 64, 64, 3), dtype=np.uint8))
    out = {}
    for name, extra in (("plain", {}), ("fid", {**FID, "fid-ref": root / "ref.npz", "vae": tiny_vae_dir})):
        r = run_cli("dit-train", tiny_args(root / "shards", root / name, **{"max-steps": 4, "num-workers": 1,
                                                                              **extra}), timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        out[name] = (root / name, r.stderr)
    return out


@pytest.mark.timeout(1200)
def test_fid_is_logged_and_training_is_unchanged(runs):
    (plain, _), (fid, log) = runs["plain"], runs["fid"]
    losses = [(r["step"], r["loss"]) for r in read_metrics(plain) if "loss" in r]
    assert losses == [(r["step"], r["loss"]) for r in read_metrics(fid) if "loss" in r]
    evals = [r for r in read_metrics(fid) if "fd_rand" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        assert np.isfinite(r["fd_rand"]) and r["fd_rand"] >= 0 and r["is_rand"] >= 1 - 1e-9 and "fid" not in r
        assert 0 <= r["precision_rand"] <= 1 and 0 <= r["recall_rand"] <= 1 and r["fid_seconds"] > 0
        assert r["fid_num_samples"] == 4
    assert "step 2: FD-rand0-4 " in log and "not FID" in log and "step 2: FID" not in log
    # the bracket names a random Inception's numbers as such (issue 47: it said "(sFID ..., IS ...)")
    assert "(sFD-rand0 " in log and ", IS-rand " in log and ", precision-rand " in log and "(sFID " not in log
    # the reference's features were cached beside it, once
    assert len(list(fid.parent.glob(".ref.npz.*.features.npz"))) == 1


@pytest.mark.timeout(600)
def test_plot_draws_fid_beside_the_loss(runs):
    fid, _ = runs["fid"]
    r = run_cli("dit-train", ["--plot", fid], timeout=300)
    assert r.returncode == 0, r.stderr
    from PIL import Image

    with Image.open(fid / "loss.png") as im:
        width, height = im.size
    assert height == 3 * 3 * 120  # three panels of 3 inches at 120 dpi: loss, FID, throughput


@pytest.mark.parametrize("opts, message", [
    ({"fid-every": 2, "fid-ref": "R"}, "--fid-every needs --vae"),
    ({"fid-every": 2, "vae": "V"}, "--fid-every needs --fid-ref"),
    ({"fid-ref": "R"}, "--fid-ref only serves FID during training"),
    ({"fid-every": 2, "fid-ref": "R", "vae": "V", "fid-num-samples": 3}, "--fid-num-samples must be >= 4"),
    ({"fid-every": 2, "fid-ref": "R", "vae": "V", "fid-labels": "balanced"},
     "Invalid value for '--fid-labels': 'balanced' is not one of 'uniform', 'equal'."),
])
def test_fid_options_are_checked_before_any_work(tmp_path, opts, message):
    r = run_cli("dit-train", tiny_args(tmp_path / "shards", tmp_path / "run", **opts), timeout=300)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("labels", ["uniform", "equal"])
def test_fid_samples_take_the_classes_dit_sample_gives_them(tmp_path, tiny_vae_dir, monkeypatch, labels):
    """The hook, on one process with a tiny DiT, samples exactly `dit-sample --labels L`'s classes (equal: 2
    of each of the 10 classes among 20 samples) and records the choice in its metrics row."""
    from types import SimpleNamespace

    from dit_pipeline.evaluate import hook as hook_module
    from dit_pipeline.evaluate.hook import FidHook
    from dit_pipeline.sample import plan
    from tests.sample.conftest import random_dit

    np.savez(tmp_path / "ref.npz", arr_0=np.random.default_rng(0).integers(0, 256, (6, 32, 32, 3), dtype=np.uint8))
    seen: dict[int, int] = {}
    real = hook_module.generate_images

    def recording(*args, indices, labels, **kw):
        seen.update(zip(indices, labels))
        return real(*args, indices=indices, labels=labels, **kw)

    monkeypatch.setattr(hook_module, "generate_images", recording)
    model = random_dit(1)
    ctx = HookContext(epoch=0, model=model, ema=None, rank=0, world_size=1, model_config=dict(model.config),
                      config={"objective": "ddpm"}, num_classes=10, latent={"scaling_factor": 0.5}, device="cpu",
                      step=2, run_dir=tmp_path, metrics=None)
    hook = FidHook(every=2, ref=str(tmp_path / "ref.npz"), vae=str(tiny_vae_dir), num_samples=20, steps=2,
                   batch_size=8, seed=3, labels=labels, input_size=75, random_inception=0)
    record = hook(ctx)
    want = plan.class_labels(num_samples=20, seed=3, num_classes=10, sampling=labels)
    assert [seen[i] for i in range(20)] == want.tolist()
    if labels == "equal":
        assert np.bincount(want, minlength=10).tolist() == [2] * 10
    assert record["fid_labels"] == labels and record["fid_num_samples"] == 20 and np.isfinite(record["fd_rand"])


def test_fid_labels_reach_the_hook_and_are_checked():
    from dit_pipeline.common.errors import ConfigError
    from dit_pipeline.train.config import TrainConfig
    from dit_pipeline.train.hooks import build_hooks

    cfg = TrainConfig(shards="s", run_dir="r", fid_every=2, fid_ref="R", vae="V", fid_labels="equal")
    (hook,) = build_hooks(cfg)
    assert hook.labels == "equal"
    assert TrainConfig(shards="s", run_dir="r").fid_labels is None  # the protocol's, else uniform
    with pytest.raises(ConfigError, match=r"--fid-labels must be one of uniform, equal, got 'balanced'"):
        TrainConfig(shards="s", run_dir="r", fid_every=2, fid_ref="R", vae="V", fid_labels="balanced").validate()


def test_the_fid_labels_are_the_protocols_unless_given():
    """--protocol NAME without --fid-labels samples the release's classes (NanoGen's and RAE's: equal counts) and
    records no override; --fid-labels changes them and is recorded; without a protocol: uniform draws."""
    from types import SimpleNamespace

    from dit_pipeline.evaluate.hook import FidHook
    from tests.sample.conftest import random_dit

    ctx = SimpleNamespace(model_config={"class_dropout_prob": 0.1, "in_channels": 4}, config={"objective": "flow"})
    for protocol, labels, want, overrides in (("nanogen", None, "equal", ()), ("rae", None, "equal", ()),
                                               ("nanogen", "uniform", "uniform", ("labels uniform",)),
                                               (None, None, "uniform", ())):
        hook = FidHook(every=2, ref="R", vae="V", num_samples=20, objective="flow", sampler="euler",
                       protocol=protocol, labels=labels)
        hook._state = {"conditions": random_dit(1, learn_sigma=False).conditions}  # what setup keeps of the model
        p = hook.resolve_protocol(ctx)
        assert (p.labels, p.overrides) == (want, overrides), (protocol, labels)
        assert hook.sample_args(p, True)[hook.sample_args(p, True).index("--labels") + 1] == want


@pytest.mark.timeout(600)
def test_a_reference_of_another_resolution_is_refused_before_the_first_step(tmp_path, tiny_vae_dir):
    """dit-eval refuses samples and a reference of different resolutions; FID during training says so before it
    trains (8x8 latents decoded by the tiny VAE are 64x64 images, the reference is 32x32)."""
    make_shard_set(tmp_path / "shards", samples=[8, 8], latent_shape=(4, 8, 8))
    np.savez(tmp_path / "ref32.npz", arr_0=np.zeros((6, 32, 32, 3), np.uint8))
    r = run_cli("dit-train", tiny_args(tmp_path / "shards", tmp_path / "run", **{
        **FID, "fid-ref": tmp_path / "ref32.npz", "vae": tiny_vae_dir, "max-steps": 4, "num-workers": 0}), timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    assert r.stderr.rstrip().splitlines()[-1] == (
        f"error: --fid-ref: the FID samples (the model's latents decoded by --vae) are 64x64 but REF "
        f"{tmp_path / 'ref32.npz'} is 32x32: compare against the reference batch of the samples' resolution (e.g. "
        "VIRTUAL_imagenet256_labeled.npz for 256x256)")
    assert not [row for row in read_metrics(tmp_path / "run") if "loss" in row]  # no step ran
    assert not list(tmp_path.glob(".ref32.npz.*.features.npz"))  # no Inception work either


@pytest.mark.timeout(1200)
def test_training_time_fid_equals_dit_eval_on_the_same_samples(runs, tmp_path):
    """bytetriper/RAE #70: "online FID is very high, offline normal". The hook's record says how its samples were
    made (`fid_run.dit_sample_args`, `dit_eval_args`); dit-sample with those settings on the checkpoint of the same
    step, then dit-eval, give the number the hook logged."""
    fid, _ = runs["fid"]
    ev = [r for r in read_metrics(fid) if "fd_rand" in r][-1]
    run = ev["fid_run"]
    npz = tmp_path / "offline.npz"
    r = run_cli("dit-sample", ["--ckpt", fid / "checkpoints" / f"step-{ev['step']:07d}.pt", *run["dit_sample_args"],
                               "--npz", npz, "--quiet"], timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli("dit-eval", [npz, "--ref", run["reference"]["path"], *run["dit_eval_args"], "--quiet"], timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    offline = json.loads((tmp_path / "offline.npz.eval.json").read_text())
    assert offline["fid_name"] == ev["fd_rand_name"] and offline["protocol"] == run["protocol"] == "adm"
    for key in ("fd_rand", "sfd_rand", "is_rand", "precision_rand", "recall_rand"):
        assert offline[key] == pytest.approx(ev[key], rel=1e-6, abs=1e-9), key
