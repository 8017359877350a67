"""`dit-train` as users meet it: every clear-error case (exit code, one message naming the problem, nothing
written), --dry-run, --config files with flag overrides and underscore aliases, and --plot."""
from __future__ import annotations

import shutil

import pytest

from tests.train.conftest import invoke_train as _invoke, tiny_args, two_step_run
from tests.train.helpers import make_shard_set


@pytest.fixture(scope="module")
def trained(shard_dir, tmp_path_factory):
    """A 2-step run (in-process) to resume from."""
    return two_step_run(shard_dir, tmp_path_factory, "cli")


def test_indivisible_batch_fails_before_any_work(shard_dir, tmp_path):
    run_dir = tmp_path / "run"
    # under torchrun (WORLD_SIZE=3): refused before the process group is joined or anything is written
    r = _invoke(tiny_args(shard_dir, run_dir, **{"global-batch-size": 8, "micro-batch-size": False}),
                env={"WORLD_SIZE": "3", "RANK": "0", "LOCAL_RANK": "0"})
    assert r.exit_code == 2
    assert "--global-batch-size 8 is not divisible by the world size 3 (8 / 3 = 2.66667)" in r.output
    assert "e.g. 6 or 9" in r.output and "Traceback" not in r.output
    r = _invoke(tiny_args(shard_dir, run_dir, **{"global-batch-size": 16, "micro-batch-size": 3,
                                                 "nproc-per-node": 2}))
    assert r.exit_code == 2
    assert "--micro-batch-size 3 does not divide the per-rank batch 8 (= global batch 16 / 2 ranks)" in r.output
    assert "valid micro-batch sizes: 1, 2, 4, 8" in r.output
    assert not run_dir.exists()


def test_too_few_shards_for_the_readers(shard_dir, tmp_path):
    r = _invoke(tiny_args(shard_dir, tmp_path / "run", **{"num-workers": 5}))
    assert r.exit_code == 2
    assert "4 shard(s), fewer than 1 rank(s) x 5 loader worker(s) = 5 readers" in r.output
    assert "use --num-workers 4 or fewer" in r.output and not (tmp_path / "run").exists()


def test_manifest_and_model_mismatches(shard_dir, tmp_path):
    r = _invoke(tiny_args(shard_dir, tmp_path / "run", **{"image-size": 128}))
    assert r.exit_code == 1
    assert "--image-size 128 does not match the shard set" in r.output and "extracted at 64px" in r.output
    r = _invoke(tiny_args(shard_dir, tmp_path / "run", **{"patch-size": 3}))
    assert r.exit_code == 1 and "input_size 8 is not divisible by patch_size 3" in r.output
    assert not (tmp_path / "run").exists()


def test_missing_shard_is_named(shard_dir, tmp_path):
    copy = tmp_path / "shards"
    shutil.copytree(shard_dir, copy)
    (copy / "shard-000003.tar").unlink()
    r = _invoke(tiny_args(copy, tmp_path / "run"))
    assert r.exit_code == 1
    assert "shard-000003.tar: missing" in r.output and "dit-shards verify" in r.output
    assert not (tmp_path / "run").exists()


def test_resume_refuses_another_model_or_shard_set_or_a_corrupt_file(trained, shard_dir, tmp_path):
    args = {"max-steps": 4, "num-workers": 0, "quiet": None}
    before = sorted(p.name for p in (trained / "checkpoints").iterdir())
    r = _invoke(tiny_args(shard_dir, trained, **args, resume="none"))
    assert r.exit_code == 1 and "already holds checkpoints up to step 2; --resume none" in r.output
    r = _invoke(tiny_args(shard_dir, trained, **args, **{"hidden-size": 64}))
    assert r.exit_code == 1
    assert "is for a different model" in r.output and "hidden_size: checkpoint 32, this run 64" in r.output
    other = tmp_path / "other"
    make_shard_set(other, samples=[16, 16, 16, 16], latent_shape=(4, 8, 8))
    r = _invoke(tiny_args(other, trained, **args))
    assert r.exit_code == 1 and "was trained on a different shard set" in r.output
    assert sorted(p.name for p in (trained / "checkpoints").iterdir()) == before  # nothing changed
    broken = tmp_path / "broken"
    shutil.copytree(trained, broken)
    ck = broken / "checkpoints" / "step-0000002.pt"
    ck.write_bytes(ck.read_bytes()[:5000])
    r = _invoke(tiny_args(shard_dir, broken, **args))
    assert r.exit_code == 1 and f"checkpoint {ck} is corrupt" in r.output and "Nothing was loaded" in r.output


def test_dry_run_with_config_file_and_flag_override(shard_dir, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"shards: {shard_dir}\nrun-dir: {tmp_path / 'run'}\nmodel: DiT-S/2\ndepth: 2\n"
                   "hidden_size: 32\nnum-heads: 2\nglobal_batch_size: 16\nmicro-batch-size: 4\nepochs: 3\n"
                   "num-workers: 2\n")
    r = _invoke(["--config", cfg, "--dry-run", "--global_batch_size", "8", "--nproc-per-node", "2"])
    assert r.exit_code == 0, r.output
    out = r.output
    assert "global 8 = 2 rank(s) x micro-batch 4 x 1 accumulation step(s)" in out  # flag beat the file
    assert "readers     2 rank(s) x 2 loader worker(s) = 4" in out and "epochs 3 ->" in out
    assert "would start from scratch" in out and "0.05M parameters" in out
    assert not (tmp_path / "run").exists()  # a dry run writes nothing
    bad = tmp_path / "bad.yaml"
    bad.write_text("global_batch: 8\n")
    r = _invoke(["--config", bad])
    assert r.exit_code == 2 and "unknown setting 'global_batch'" in r.output
    r = _invoke(["--shards", shard_dir, "--run-dir", tmp_path / "run", "--model", "DiT-S/2", "--dry-run",
                 "--global-batch-size", "8"])  # no length given: the paper's 400K steps, said in the plan
    assert r.exit_code == 0 and "length      max_steps 400000 -> 400,000 steps" in r.output


def test_plot_writes_a_png(trained):
    r = _invoke(["--plot", trained])
    assert r.exit_code == 0, r.output
    png = trained / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in r.output
    r = _invoke(["--plot", trained / "checkpoints"])
    assert r.exit_code == 1 and "no metrics in" in r.output
