"""dit-train --repa end to end, on the tiny models: extract with pixels -> verify -> train with a random tiny
DINOv2-architecture teacher on 2 ranks -> SIGKILL -> resume bit-identical to an uninterrupted run -> sample
the EMA file with the guidance interval, and a REPA-format file of the same weights (projector keys ignored).
Also: a shard set without pixels is refused before any work, the plan names the teacher and its cost, the
alignment is in the metrics and the checkpoint, and a checkpoint and a run must agree on --repa."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dit_pipeline.dit import make_sidecar
from dit_pipeline.shards import verify_shards
from dit_pipeline.train.checkpoint import CheckpointManager, load_checkpoint
from dit_pipeline.train.metrics import read_metrics
from tests._util import make_image_tree, make_tiny_teacher, run_cli, run_torchrun
from tests.extract.conftest import extract
from tests.train.conftest import invoke_train, tiny_args

KEYS = ("step", "loss", "mse", "proj", "grad_norm")


@pytest.fixture(scope="module")
def repa_data(tiny_vae_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("repa")
    images = make_image_tree(root / "images", counts=(6, 5, 5))
    extract(images, tiny_vae_dir, root / "shards", pixels=True, samples_per_shard=4)
    assert verify_shards(root / "shards", progress=False).ok  # every pixels member decoded and checked
    extract(images, tiny_vae_dir, root / "plain", samples_per_shard=4)  # the same set without pixels
    return root / "shards", root / "plain", make_tiny_teacher(root / "teacher.safetensors")


def _args(shards, run_dir, teacher, **over):
    return tiny_args(shards, run_dir, **{"objective": "flow", "repa": teacher, "repa-depth": 1, "max-steps": 6,
                                         "num-workers": 1, "micro-batch-size": 2, "global-batch-size": 8,
                                         "ckpt-every": 3, **over})


def test_a_shard_set_without_pixels_is_refused_before_any_work(repa_data, tmp_path):
    _, plain, teacher = repa_data
    r = invoke_train(_args(plain, tmp_path / "run", teacher))
    assert r.exit_code == 1
    assert r.output.strip().splitlines()[-1] == (
        f"error: --repa needs the training pixels, but the shard set in {plain} was extracted without them; "
        "extract again with dit-extract --pixels (the latents are the same)")
    assert not (tmp_path / "run").exists()
    r = invoke_train(_args(repa_data[0], tmp_path / "run", teacher, **{"repa-depth": 3}))
    assert r.exit_code == 1 and "--repa-depth 3: the model has 2 blocks; choose 1..2" in r.output


def test_the_plan_names_the_teacher_and_its_cost(repa_data, tmp_path):
    shards, _, teacher = repa_data
    r = invoke_train(_args(shards, tmp_path / "run", teacher, **{"dry-run": None}))
    assert r.exit_code == 0, r.output
    line = next(x for x in r.output.splitlines() if x.startswith("  repa "))
    assert line.startswith(f"  repa        teacher tiny DINOv2 (teacher.safetensors) (28 px, 4 tokens of 32, "
                           "weights sha256 ")
    assert "frozen; aligned after block 1 of 2, coefficient 0.5; teacher forward " in line
    assert "GFLOP per image = " in line and "of a training step's FLOPs" in line


@pytest.fixture(scope="module")
def straight(repa_data, tmp_path_factory):
    shards, _, teacher = repa_data
    run_dir = tmp_path_factory.mktemp("repa-straight") / "run"
    r = run_torchrun("dit-train", _args(shards, run_dir, teacher), 2, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


def test_two_ranks_killed_and_resumed_are_bit_identical(repa_data, straight, tmp_path):
    shards, _, teacher = repa_data
    run_dir = tmp_path / "run"
    args = _args(shards, run_dir, teacher)
    r = run_torchrun("dit-train", args, 2, env={"DIT_FAULT": "train.step_end@5:kill"}, timeout=600)
    assert r.returncode != 0
    assert CheckpointManager(run_dir / "checkpoints").steps() == [3]
    r = run_torchrun("dit-train", args, 2, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ours = [tuple(rec[k] for k in KEYS) for rec in read_metrics(run_dir)]
    want = [tuple(rec[k] for k in KEYS) for rec in read_metrics(straight)]
    assert [s[0] for s in want] == [1, 2, 3, 4, 5, 6] and ours == want
    a = load_checkpoint(CheckpointManager(run_dir / "checkpoints").latest())
    b = load_checkpoint(CheckpointManager(straight / "checkpoints").latest())
    assert all(torch.equal(a[k][n], b[k][n]) for k in ("model", "ema") for n in b[k])
    pa, pb = a["projector"], b["projector"]
    assert (pa["encoder_depth"], pa["z_dims"], pa["projector_dim"]) == (1, [32], 2048)
    assert pa["teacher"]["name"] == "tiny DINOv2 (teacher.safetensors)" and pa["teacher"]["weights_sha256"]
    assert all(torch.equal(pa["state_dict"][n], pb["state_dict"][n]) for n in pb["state_dict"])


def test_the_alignment_is_logged_and_trained(straight):
    recs = [r for r in read_metrics(straight) if "loss" in r]
    assert all(-1.0 <= r["proj"] <= 1.0 and "vb" not in r for r in recs)
    # loss = mse + 0.5 x proj, each averaged over all samples of all ranks
    assert all(r["loss"] == pytest.approx(r["mse"] + 0.5 * r["proj"], rel=1e-5) for r in recs)
    assert all(0.0 <= r["teacher_time"] <= 1.0 for r in recs)
    own = read_metrics(straight / "logs" / "rank1.jsonl")
    assert any("proj" in r for r in own)
    ck = load_checkpoint(CheckpointManager(straight / "checkpoints").latest())
    ema = torch.load(straight / "checkpoints" / "step-0000006-ema.pt", weights_only=True)
    assert not any(k.startswith("projector") for k in ema) and set(ema) == set(ck["model"])  # the bare DiT


def test_a_checkpoint_and_a_run_agree_on_repa(repa_data, straight, tmp_path):
    shards, _, teacher = repa_data
    ck = CheckpointManager(straight / "checkpoints").latest()
    r = invoke_train(_args(shards, tmp_path / "a", False, **{"resume": ck, "max-steps": 7, "repa-depth": False}))
    assert r.exit_code == 1 and f"checkpoint {ck} was trained with --repa (its projector is in the file)" in r.output
    r = invoke_train(_args(shards, tmp_path / "b", teacher, **{"resume": ck, "max-steps": 7, "repa-depth": 2}))
    assert r.exit_code == 1 and "aligns differently (encoder_depth: checkpoint 1, this run 2)" in r.output
    plain_run = tmp_path / "plain"  # a run without alignment, then resumed with it
    r = invoke_train(_args(shards, plain_run, False, **{"repa-depth": False, "max-steps": 1, "num-workers": 0}))
    assert r.exit_code == 0, r.output
    r = invoke_train(_args(shards, plain_run, teacher, **{"max-steps": 2, "num-workers": 0}))
    assert r.exit_code == 1 and "was trained without --repa; continue it without --repa" in r.output


def test_the_ema_file_samples_with_the_guidance_interval_and_a_repa_format_file_loads(straight, tiny_vae_dir,
                                                                                      tmp_path):
    ckpts = straight / "checkpoints"
    base = ["--vae", tiny_vae_dir, "--num-samples", 4, "--steps", 4, "--sampler", "euler", "--cfg-scale", 2.0,
            "--guidance-interval", 0, 0.7, "--batch-size", 4]
    r = run_cli("dit-sample", ["--ckpt", ckpts / "step-0000006-ema.pt", *base, "--npz", tmp_path / "ema.npz"])
    assert r.returncode == 0, r.stderr[-3000:]
    ck = load_checkpoint(ckpts / "step-0000006.pt")
    # REPA's release layout: the DiT's names plus projectors.<i>.<j>.*, one bare state_dict
    repa_file = tmp_path / "repa-last.pt"
    torch.save({**ck["ema"], **{f"projectors.0.{k}": v for k, v in ck["projector"]["state_dict"].items()}},
               repa_file)
    # a tiny DiT has no preset: its head count comes from a sidecar, as beside our own EMA files
    (tmp_path / "repa-last.json").write_text(json.dumps(make_sidecar(ck["model_config"], ck["latent"], 6, "flow")))
    r = run_cli("dit-sample", ["--ckpt", repa_file, *base, "--flow-convention", "sit", "--npz", tmp_path / "r.npz"])
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = np.load(tmp_path / "ema.npz"), np.load(tmp_path / "r.npz")
    assert a["arr_0"].shape == (4, 32, 32, 3) and np.array_equal(a["arr_0"], b["arr_0"])



# ----------------------------------------------------------------------------------------------------------
# REPA on a data mix: the online teacher sees every source's pixels

def test_a_mixs_batches_carry_each_samples_crop_in_its_view(repa_data, tmp_path):
    """Each sample of a mix's batch carries its own stored crop in its latent's view (the teacher sees the image
    the latent was encoded from), in process and through a loader worker alike."""
    from dit_pipeline.shards import iter_shard, key_index, read_manifest, view_pixels
    from dit_pipeline.train.latents import mix_seed, sample_view
    from dit_pipeline.train.mix import mix_spec, open_mix
    from dit_pipeline.train.mixdata import MixFeed
    from dit_pipeline.train.mixdraws import sample_base

    shards = repa_data[0]
    m = read_manifest(shards)
    crops = {key_index(s.key): s.pixels for url in m.shard_urls(str(shards))
             for s in iter_shard(url, m, pixels="decoded")}

    def batches(workers):
        feed = MixFeed(open_mix(mix_spec([f"{shards} name=a", f"{shards} name=b repeat=1"], None)), seed=0,
                       lanes=2, global_batch=8, accum=1, world=1, rank=0, workers=workers, buffer=4,
                       shards_in_flight=2, pixels=True)
        return list(feed.loader(feed.plan(0), 0))

    inline, views = batches(0), set()
    for b in inline:
        assert b.pixels is not None and b.pixels.dtype == torch.uint8 and b.pixels.shape[1:] == (32, 32, 3)
        for px, s, k in zip(b.pixels, b.sources.tolist(), b.keys.tolist()):
            v = sample_view(mix_seed(sample_base(0, 0, s, 0), k), 2)
            assert np.array_equal(px.numpy(), view_pixels(crops[k], v))
            views.add(v)
    assert views == {0, 1} and sum(len(b.keys) for b in inline) == 32
    pooled = batches(1)
    assert len(pooled) == len(inline) and all(torch.equal(x.pixels, y.pixels) for x, y in zip(inline, pooled))


def test_repa_on_a_mix_resumes_exactly_and_refuses_a_source_without_pixels(repa_data, tmp_path):
    shards, plain, teacher = repa_data

    def run(run_dir, *sources, **over):
        args = _args(False, run_dir, teacher, **{"max-steps": 3, "ckpt-every": 2, **over})  # no --shards
        return invoke_train(args + [x for s in sources for x in ("--source", s)])

    two = (f"{shards} name=a", f"{shards} name=b")
    r = run(tmp_path / "straight", *two)
    assert r.exit_code == 0, r.output
    assert run(tmp_path / "resumed", *two, **{"max-steps": 2}).exit_code == 0
    assert run(tmp_path / "resumed", *two).exit_code == 0
    keys = (*KEYS, "seen_a", "seen_b")
    a = [tuple(rec[k] for k in keys) for rec in read_metrics(tmp_path / "straight")]
    b = [tuple(rec[k] for k in keys) for rec in read_metrics(tmp_path / "resumed")]
    assert [x[0] for x in a] == [1, 2, 3] and a == b and all(x[3] != 0 for x in a)  # exact floats; the alignment
    r = run(tmp_path / "bare", f"{shards} name=a", f"{plain} name=plain", **{"dry-run": None})
    assert r.exit_code == 1 and (f"--repa needs the training pixels, but the shard set in source plain ({plain}) was "
                                 "extracted without them") in r.output
    r = run(tmp_path / "cached", *two, repa=shards, **{"dry-run": None})
    want = (f"--repa {shards} is one shard set's cached teacher tokens: with a data mix name each source's with "
            "repa=FOLDER and pass --repa cached, or give --repa a teacher")
    assert r.exit_code == 2 and want in r.output  # a setting's problem, listed before any work
