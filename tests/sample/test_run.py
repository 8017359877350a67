"""dit-sample end to end: identical arrays whatever the number of ranks (2-rank gloo torchrun) or a kill +
resume (same batch size: the same global chunks); another batch size within one pixel level; the ADM npz
format; grid and PNG outputs; refusals that lose nothing."""
from __future__ import annotations

import json
from pathlib import Path
import signal

import numpy as np
import pytest
import torch
from PIL import Image

from dit_pipeline.common.errors import UserError
from dit_pipeline.sample import SampleConfig, run_sampling
from dit_pipeline.sample.grid import grid_size
from tests._util import run_cli, run_srun, run_torchrun
from tests.sample.conftest import our_checkpoint, random_dit
from tests.train.signal_rounds import signal_group_at

STEPS = 4


def base_args(ckpt, vae, **kw) -> dict:
    return dict(ckpt=str(ckpt), vae=str(vae), steps=STEPS, quiet=True, **kw)


def cli_args(d: dict) -> list[str]:
    out = []
    for k, v in d.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v not in (False, None):
            out += [flag, ",".join(map(str, v)) if isinstance(v, list) else str(v)]
    return out


def load(npz):
    with np.load(npz) as z:
        return z["arr_0"], z["arr_1"]


@pytest.fixture(scope="module")
def reference_run(ckpts, tiny_vae_dir, tmp_path_factory):
    """6 samples, drawn classes, DDPM with CFG 4, batch size 3, one process, in-process call."""
    out = tmp_path_factory.mktemp("ref") / "ref.npz"
    res = run_sampling(SampleConfig(**base_args(ckpts["ours"], tiny_vae_dir, num_samples=6, seed=3, batch_size=3,
                                                npz=str(out))))
    assert res.produced == 6 and res.image_size == 32
    return load(out)


def test_npz_format_and_distinct_samples(reference_run):
    images, labels = reference_run
    assert images.dtype == np.uint8 and images.shape == (6, 32, 32, 3)
    assert labels.dtype == np.int64 and labels.shape == (6,) and labels.min() >= 0 and labels.max() < 10
    assert len({images[i].tobytes() for i in range(6)}) == 6 and images.std() > 5


def within_one_level(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal up to float rounding: other batch shapes move a truncated uint8 value by at most one level, and
    rarely (measured: at most 6 of 61440 values over 50 DDPM steps)."""
    diff = np.abs(a.astype(np.int16) - b.astype(np.int16))
    return a.shape == b.shape and diff.max() <= 1 and (diff > 0).mean() < 0.01


def test_batch_size_one_gives_the_same_samples_to_rounding(reference_run, ckpts, tiny_vae_dir, tmp_path):
    out = tmp_path / "bs1.npz"
    run_sampling(SampleConfig(**base_args(ckpts["ours"], tiny_vae_dir, num_samples=6, seed=3, batch_size=1,
                                          npz=str(out))))
    images, labels = load(out)
    assert within_one_level(images, reference_run[0]) and np.array_equal(labels, reference_run[1])


@pytest.mark.determinism
def test_first_samples_do_not_depend_on_the_total(reference_run, ckpts, tiny_vae_dir, tmp_path):
    out = tmp_path / "four.npz"
    run_sampling(SampleConfig(**base_args(ckpts["ours"], tiny_vae_dir, num_samples=4, seed=3, batch_size=3,
                                          npz=str(out))))
    images = load(out)[0]
    assert np.array_equal(images[:3], reference_run[0][:3])  # the same first chunk [0, 3)
    assert within_one_level(images[3:], reference_run[0][3:4])  # [3] alone, not in [3, 6)


@pytest.mark.determinism
def test_two_rank_gloo_run_gives_identical_arrays(reference_run, ckpts, tiny_vae_dir, tmp_path):
    out = tmp_path / "ddp.npz"
    res = run_torchrun("dit-sample", cli_args(base_args(ckpts["ours"], tiny_vae_dir, num_samples=6, seed=3,
                                                        batch_size=3, npz=str(out))), nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    images, labels = load(out)
    assert np.array_equal(images, reference_run[0]) and np.array_equal(labels, reference_run[1])
    assert not (tmp_path / ".ddp.npz.parts").exists()


@pytest.mark.determinism
def test_equal_labels_two_rank_gloo_run_and_the_records(ckpts, tiny_vae_dir, tmp_path):
    """--labels equal: 13 samples of 10 classes (1 or 2 each) on 2 gloo ranks are the one-process run's arrays
    and classes; the choice is in the npz's record (and its fingerprint) and in dit-eval's JSON, with the
    class counts; a uniform run's fingerprint is as before (no new key), so its earlier parts stay valid."""
    from dit_pipeline.evaluate import EvalConfig, run_eval
    from dit_pipeline.sample import plan

    args = base_args(ckpts["ours"], tiny_vae_dir, num_samples=13, seed=3, batch_size=3, labels="equal")
    one, ddp = tmp_path / "one.npz", tmp_path / "ddp.npz"
    run_sampling(SampleConfig(**args, npz=str(one)))
    res = run_torchrun("dit-sample", cli_args({**args, "npz": str(ddp)}), nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    (images, labels), (ddp_images, ddp_labels) = load(one), load(ddp)
    assert np.array_equal(ddp_images, images) and np.array_equal(ddp_labels, labels)
    assert labels.tolist() == plan.class_labels(num_samples=13, seed=3, num_classes=10, sampling="equal").tolist()
    assert sorted(np.bincount(labels, minlength=10).tolist()) == [1] * 7 + [2] * 3
    record = json.loads((tmp_path / "ddp.npz.json").read_text())
    assert record["label_sampling"] == "equal" and record["fingerprint"]["label_sampling"] == "equal"
    assert record["config"]["labels"] == "equal"
    result = run_eval(EvalConfig(samples=str(ddp), ref=str(one), random_inception=0, input_size=75, batch_size=4,
                                 quiet=True, device="cpu", cache=False))
    written = json.loads((tmp_path / "ddp.npz.eval.json").read_text())
    assert written["samples"]["label_sampling"] == result["samples"]["label_sampling"] == "equal"
    assert written["samples"]["class_counts"] == {"classes": 10, "min_per_class": 1, "max_per_class": 2}
    uniform = tmp_path / "uniform.npz"
    run_sampling(SampleConfig(**{**args, "labels": "uniform", "num_samples": 4}, npz=str(uniform)))
    record = json.loads((tmp_path / "uniform.npz.json").read_text())
    assert record["label_sampling"] == "uniform" and "label_sampling" not in record["fingerprint"]


@pytest.mark.determinism
def test_srun_tasks_sample_as_one_job(reference_run, ckpts, tiny_vae_dir, tmp_path):
    """`srun --ntasks 2 dit-sample` without torchrun splits the samples as one 2-rank job: the arrays are the
    single-process run's."""
    out = tmp_path / "srun.npz"
    runs = run_srun("dit-sample", cli_args(base_args(ckpts["ours"], tiny_vae_dir, num_samples=6, seed=3,
                                                     batch_size=3, npz=str(out))))
    assert [r.returncode for r in runs] == [0, 0], [r.stderr[-2000:] for r in runs]
    images, labels = load(out)
    assert np.array_equal(images, reference_run[0]) and np.array_equal(labels, reference_run[1])


@pytest.mark.determinism
def test_killed_run_resumes_keeping_finished_batches(reference_run, ckpts, tiny_vae_dir, tmp_path):
    out = tmp_path / "resume.npz"
    args = cli_args(base_args(ckpts["ours"], tiny_vae_dir, num_samples=6, seed=3, batch_size=3, npz=str(out)))
    killed = run_cli("dit-sample", args, env={"DIT_FAULT": "sample.part_written@1:kill"})
    assert killed.returncode == -9
    parts = tmp_path / ".resume.npz.parts"
    assert sorted(p.name for p in parts.glob("part-*.npz")) == ["part-000000000.npz"] and not out.exists()
    # a different configuration must not mix in: refused, and the finished batch is kept
    other = run_cli("dit-sample", [*args, "--seed", "4"])
    assert other.returncode == 1 and ("changed: the classes (--class-labels, --labels, --num-samples or --seed), "
                                        "--seed 3 -> 4)") in other.stderr
    assert "Traceback" not in other.stderr and (parts / "part-000000000.npz").is_file()
    resumed = run_cli("dit-sample", [a for a in args if a != "--quiet"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "sampling 3 of 6 images (3 already done)" in resumed.stderr
    images, labels = load(out)
    assert np.array_equal(images, reference_run[0]) and np.array_equal(labels, reference_run[1])
    assert not parts.exists() and json.loads((tmp_path / "resume.npz.json").read_text())["labels"] == labels.tolist()


@pytest.mark.parametrize("sig, rc", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, 130)])
def test_signal_to_the_group_ends_it_and_the_rerun_resumes(reference_run, ckpts, tiny_vae_dir, tmp_path, sig, rc):
    """scancel / preemption (SIGTERM) or Ctrl-C (SIGINT) to the process group after the first batch: the
    command ends at once (exit 130 saying "interrupted" for Ctrl-C) with no traceback and no process left; the
    rerun keeps the finished batch and gives the uninterrupted arrays."""
    out = tmp_path / "s.npz"
    args = cli_args(base_args(ckpts["ours"], tiny_vae_dir, num_samples=6, seed=3, batch_size=3, npz=str(out)))
    r = signal_group_at("dit-sample", args, "sample.part_written@1", sig)
    assert r.returncode == rc, r.stderr[-3000:]
    assert r.survivors == [] and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert ("interrupted" in r.stderr) == (sig == signal.SIGINT)
    assert [p.name for p in (tmp_path / ".s.npz.parts").glob("part-*.npz")] == ["part-000000000.npz"]
    resumed = run_cli("dit-sample", [a for a in args if a != "--quiet"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "sampling 3 of 6 images (3 already done)" in resumed.stderr
    images, labels = load(out)
    assert np.array_equal(images, reference_run[0]) and np.array_equal(labels, reference_run[1])


def test_finished_run_is_not_redone_and_foreign_npz_is_protected(ckpts, tiny_vae_dir, tmp_path):
    npz = tmp_path / "s.npz"
    cfg = dict(base_args(ckpts["ours"], tiny_vae_dir, class_labels=[1, 2], npz=str(npz)))
    run_sampling(SampleConfig(**cfg))
    first = npz.read_bytes()
    assert run_sampling(SampleConfig(**cfg)).produced == 0  # already complete
    with pytest.raises(UserError, match=r"s\.npz, .*s\.npz\.json already exist\(s\) and were not made by this "
                                         r"checkpoint with these settings \(changed: --cfg-scale \S+ -> 1\.5\); choose another "
                                         r"output or pass --overwrite"):
        run_sampling(SampleConfig(**{**cfg, "cfg_scale": 1.5}))
    assert npz.read_bytes() == first
    out = tmp_path / "out"
    run_sampling(SampleConfig(**{**cfg, "npz": None, "out": str(out)}))
    with pytest.raises(UserError, match=r"out/samples\.json already exist"):
        run_sampling(SampleConfig(**{**cfg, "npz": None, "out": str(out), "seed": 1}))
    run_sampling(SampleConfig(**{**cfg, "cfg_scale": 1.5, "overwrite": True}))
    assert npz.read_bytes() != first


def test_out_folder_grid_pngs_and_record(ckpts, tiny_vae_dir, tmp_path):
    out = tmp_path / "out"
    labels = [7, 0, 3, 3, 9]
    res = run_sampling(SampleConfig(**base_args(ckpts["ours"], tiny_vae_dir, class_labels=labels, out=str(out),
                                                save_images=True, grid_max=4, grid_cols=3, npz=str(tmp_path / "s.npz"),
                                                sampler="ddim", cfg_channels="all")))
    images, got_labels = load(tmp_path / "s.npz")
    assert got_labels.tolist() == labels and res.grid == out / "grid.png"
    with Image.open(out / "grid.png") as grid:
        assert grid.size[::-1] == grid_size(4, 32, 32, 3) == (70, 104) and grid.mode == "RGB"
        tile = np.asarray(grid)[2 + 16:2 + 32, 2 + 34:2 + 34 + 32]  # lower half of tile 1 (no label text)
    assert np.array_equal(tile, images[1, 16:])
    pngs = sorted((out / "images").glob("*.png"))
    assert [p.name for p in pngs] == [f"{i:06d}.png" for i in range(5)]
    assert all(np.array_equal(np.asarray(Image.open(p)), images[i]) for i, p in enumerate(pngs))
    record = json.loads((out / "samples.json").read_text())
    assert record["labels"] == labels and record["fingerprint"]["sampler"] == "ddim"
    assert (out / "logs" / "rank0.log").is_file() and not (out / ".parts").exists()
    from dit_pipeline.evaluate.inputs import open_source

    assert (open_source(out, "SAMPLES").count, open_source(out, "SAMPLES").image_hw) == (5, (32, 32))  # not grid.png


def test_every_checkpoint_kind_samples(ckpts, tiny_vae_dir, tmp_path):
    for kind, size in (("bare", 64), ("reference", 32)):
        npz = tmp_path / f"{kind}.npz"
        res = run_sampling(SampleConfig(**{**base_args(ckpts[kind], tiny_vae_dir, class_labels=[1, 9], npz=str(npz)),
                                           "steps": 2}))
        assert res.image_size == size and load(npz)[0].shape == (2, size, size, 3)
    # our checkpoint's raw weights give other images than its EMA weights
    a, b = tmp_path / "ema.npz", tmp_path / "raw.npz"
    for path, weights in ((a, "ema"), (b, "model")):
        run_sampling(SampleConfig(**base_args(ckpts["ours"], tiny_vae_dir, class_labels=[1], npz=str(path),
                                              weights=weights)))
    assert not np.array_equal(load(a)[0], load(b)[0])


def test_bad_inputs_are_clear_errors_that_write_nothing(ckpts, tiny_vae_dir, tmp_path):
    npz = tmp_path / "x.npz"
    res = run_cli("dit-sample", ["--ckpt", ckpts["pickle"], "--vae", tiny_vae_dir, "--num-samples", "2",
                                 "--npz", npz, "--out", tmp_path / "o"])
    assert res.returncode == 1 and "error: --ckpt: refusing to load" in res.stderr and "Traceback" not in res.stderr
    assert not npz.exists() and not (tmp_path / ".x.npz.parts").exists() and not (tmp_path / "o").exists()
    with pytest.raises(UserError, match=r"--class-labels \[10, 12\] out of range: the model has 10 classes"):
        run_sampling(SampleConfig(**base_args(ckpts["ours"], tiny_vae_dir, class_labels=[10, 1, 12], npz=str(npz))))
    with pytest.raises(UserError, match="--model DiT-B/2, but"):
        run_sampling(SampleConfig(**base_args(ckpts["ours"], tiny_vae_dir, num_samples=1, npz=str(npz),
                                              model="DiT-B/2")))
    no_null = tmp_path / "no_null.pt"
    model = random_dit(1, class_dropout_prob=0.0)
    torch.save(our_checkpoint(model, model), no_null)
    # issue 41 item 4: a guidance scale that would do nothing is refused with the reason; without one, none is used
    with pytest.raises(UserError) as e:
        run_sampling(SampleConfig(**base_args(no_null, tiny_vae_dir, num_samples=1, npz=str(npz), cfg_scale=4.0)))
    assert str(e.value) == ("--cfg-scale 4 does nothing here: the model has no null class (trained without class "
                            "dropout), so classifier-free guidance is impossible; drop --cfg-scale (or pass 1)")
    with pytest.raises(UserError, match=r"^--cfg-channels all does nothing without guidance \(cfg scale 1\); drop it$"):
        run_sampling(SampleConfig(**base_args(no_null, tiny_vae_dir, num_samples=1, npz=str(npz), cfg_channels="all")))
    assert not npz.exists()
    run_sampling(SampleConfig(**base_args(no_null, tiny_vae_dir, num_samples=1, npz=str(npz))))
    assert load(npz)[0].shape == (1, 32, 32, 3)
    assert json.loads(Path(str(npz) + ".json").read_text())["fingerprint"]["cfg_scale"] == 1.0


def test_unguided_sampling_agrees_across_batch_sizes_too(ckpts, tiny_vae_dir, tmp_path):
    runs = []
    for bs in (2, 3):
        npz = tmp_path / f"u{bs}.npz"
        run_sampling(SampleConfig(**base_args(ckpts["ours"], tiny_vae_dir, num_samples=6, batch_size=bs,
                                              npz=str(npz), cfg_scale=1.0)))
        runs.append(load(npz)[0])
    assert within_one_level(runs[0], runs[1])


def test_disk_full_is_a_clear_error_and_keeps_finished_batches(reference_run, ckpts, tiny_vae_dir, tmp_path,
                                                               monkeypatch):
    npz = tmp_path / "full.npz"
    cfg = SampleConfig(**base_args(ckpts["ours"], tiny_vae_dir, num_samples=6, seed=3, batch_size=3, npz=str(npz)))
    monkeypatch.setenv("DIT_FAULT", "sample.part_write@2:enospc")
    with pytest.raises(UserError, match=r"cannot write the samples of indices 3..5 .*No space left.*3 images "
                                        r"finished here are kept"):
        run_sampling(cfg)
    parts = tmp_path / ".full.npz.parts"
    assert [p.name for p in parts.glob("part-*.npz")] == ["part-000000000.npz"] and not list(parts.glob(".tmp-*"))
    monkeypatch.delenv("DIT_FAULT")
    assert run_sampling(cfg).resumed == 3
    assert np.array_equal(load(npz)[0], reference_run[0])
