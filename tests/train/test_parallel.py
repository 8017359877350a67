"""--parallel zero2|fsdp|hsdp (train/parallel.py: FSDP2 on a DeviceMesh, sharded DCP checkpoints) on real processes
(2 ranks, gloo, CPU), one 2-rank job per promise group:

- the job (tests/train/_parallel_job.py, one torchrun launch): every family sharded per block with gradients equal to
  the unsharded model's; the real trainer under DDP, ZeRO-2 and FSDP equal step for step (DiT ddpm with gradient
  accumulation, in-context DiT-DH with text, flow with REPA's projector sharded beside the model); a DDP checkpoint
  continued under FSDP and that one under DDP again, each leg equal to the DDP run; the model and EMA all-gathered
  at the end, which the consolidated file equals bit for bit, and dit-sample draws the DDP run's images from it;
  the validation loss under ZeRO-2 and FSDP (and of a DiT inside REPA's projector unit): the DDP run's numbers, and
  no training step changed by its passes nor by the sample grids' and FID's beside them (the DDP run's grids and
  numbers; those of dit-sample and the hook on the consolidated checkpoint);
- kill -9 during a sharded checkpoint's write: the previous one resumes, bit-identical to the straight run; its
  checkpoint resumed on one rank continues the same global sample sequence (no sample twice or skipped);
- bad inputs: one line each, nothing written.

The tolerances of "equal", stated once (REL_*): float32 sums in another order (FSDP2 reduce-scatters each
micro-batch's gradients, pre- and post-divided, and sums the norm over the shards; DDP all-reduces the accumulated
gradients in buckets and sums the norm over whole tensors) differ by a few ulps per term: the losses by ~1e-8
relative (REL_LOSS 1e-6); a norm summed over n = 4M elements (REPA's 2048 x 2048 projector layer) by up to
~sqrt(n) ulps, 2.4e-4 (REL_NORM 5e-4; the exact float64 norm lies between DDP's and FSDP's there); the weights after
AdamW steps by up to 1e-4 of a tensor's magnitude (REL_WEIGHT): a gradient element that nearly cancels over the
ranks keeps a large relative rounding error, and AdamW's normalised update g / (sqrt(v) + eps) carries it into the
weight. A real error (a wrong shard, a missed or doubled reduction) differs by 1e-2 or more.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dit_pipeline.common.hooks import HookContext
from dit_pipeline.common.errors import UserError
from dit_pipeline.train.checkpoint import CheckpointManager, load_checkpoint, materialize
from dit_pipeline.train.metrics import read_metrics
from tests._util import REPO, assert_close_at_scale, cli_env, free_port, run_torchrun
from tests.train.conftest import invoke_train, tiny_args
from tests.train.test_repa_training import repa_data  # noqa: F401 (a fixture)
from tests.train.test_text_training import MODEL as IC_MODEL, captioned  # noqa: F401 (a fixture)

REL_LOSS, REL_NORM, REL_WEIGHT = 1e-6, 5e-4, 1e-4  # module docstring
REL_GRAD = 1e-5  # one backward's gradients, the batch whole or split over the ranks (no AdamW in between)
REL_PASS = 1e-6  # one forward of the same weights, gathered or whole (bit-equal on this machine; another CPU's
#                  kernels may take another path for the gathered tensors' memory and round differently)
TINY = {"model": "DiT-S/2", "depth": 2, "hidden_size": 32, "num_heads": 2, "lr": 1e-3, "log_every": 1,
        "quiet": True, "tensorboard": False, "ckpt_every": 2}
SHARDED = pytest.mark.skipif(
    __import__("dit_pipeline.common.sharding", fromlist=["x"]).sharding_problem() is not None,
    reason="the sharded modes need torch 2.9+")
pytestmark = SHARDED


def _state(path: Path) -> dict:
    """A checkpoint's content with every tensor read (a sharded one's whole, offline)."""
    return materialize(load_checkpoint(path), path, {}, collective=False)


def _same_run(a: list[dict], b: list[dict], keys=("loss", "grad_norm")) -> None:
    a, b = ([r for r in run if "loss" in r] for run in (a, b))  # the steps' records (not the validation passes')
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for k in keys:
        rel = REL_NORM if k == "grad_norm" else REL_LOSS
        assert_close_at_scale([r[k] for r in a], [r[k] for r in b], rel=rel, what=k)


def _close_states(a: dict, b: dict, keys=("model", "ema")) -> None:
    for key in keys:
        assert a[key].keys() == b[key].keys(), key
        for name in a[key]:
            assert_close_at_scale(a[key][name], b[key][name], rel=REL_WEIGHT, what=f"{key}/{name}")


def _job(spec: dict, folder: Path, nproc: int = 2, timeout: float = 1500) -> dict:
    spec = {**spec, "result": str(folder / "result.json")}
    (folder / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(REPO / "tests" / "train" / "_parallel_job.py"), str(folder / "spec.json")]
    r = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads((folder / "result.json").read_text())


def _dit(shards, run: Path, **over) -> dict:
    return {"config": {**TINY, "shards": str(shards), "run_dir": str(run), "global_batch_size": 8,
                       "micro_batch_size": 2, "num_workers": 1, **over}}


def _val(shards) -> dict:
    """--val-shards on the run's own shard set: passes at steps 0, 2, 4, in chunks of 3, 3 and 2 samples."""
    return {"val_shards": str(shards), "val_every": 2, "val_samples": 8, "val_batch_size": 3}


GRIDS = {"sample_every": 2, "sample_steps": 5, "sample_classes": "1,0,1", "sample_weights": "both"}


def _hooks(vae, ref) -> dict:
    """Grids of the EMA and raw weights and FID at steps 2 and 4: 6 samples in batches of 2, so rank 0 samples two
    batches and rank 1 one (and the passes of one more in lockstep, under the sharded modes)."""
    return {**GRIDS, "vae": str(vae), "fid_every": 2, "fid_ref": str(ref), "fid_num_samples": 6, "fid_steps": 3,
            "fid_batch_size": 2, "fid_input_size": 75, "fid_random_inception": 0}


@pytest.fixture(scope="module")
def job(shard_dir, captioned, repa_data, tiny_vae_dir, tmp_path_factory):  # noqa: F811 (fixtures)
    root = tmp_path_factory.mktemp("parallel-job")
    ref = root / "ref.npz"  # 8x8 latents through the tiny VAE (8x downsampling): 64x64 images
    np.savez(ref, arr_0=np.random.default_rng(0).integers(0, 256, (6, 64, 64, 3), dtype=np.uint8))
    hooks = _hooks(tiny_vae_dir, ref)
    latents, text, _ = captioned
    repa_shards, _, teacher = repa_data
    (root / "prompts.txt").write_text("a photo of a cat\nimage 3\n")
    ic = {**{k.replace("-", "_"): v for k, v in IC_MODEL.items()}, "text": str(text), "global_batch_size": 4,
          "micro_batch_size": 2, "num_workers": 0, "grad_clip": 1.0, "max_steps": 4, "sample_every": 2,
          "sample_steps": 5, "sample_prompts": str(root / "prompts.txt")}  # grids of prompts
    repa = {"objective": "flow", "repa": str(teacher), "repa_depth": 1, "num_workers": 1, "max_steps": 4,
            **_val(repa_shards), **GRIDS}  # the validation pass and grids of the DiT inside the projector's root unit
    runs = [_dit(shard_dir, root / "ddp", max_steps=6),
            _dit(shard_dir, root / "zero2", max_steps=4, parallel="zero2", grad_checkpointing=True),
            # also the straight sharded run of the kill and world-size tests below: their CLI settings (CLI)
            {**_dit(shard_dir, root / "fsdp", max_steps=6, parallel="fsdp", log_keys=True),
             "gather": str(root / "gathered.pt")},
            {**_dit(shard_dir, root / "ddp-fsdp", max_steps=4, parallel="fsdp"),
             "copy_from": str(root / "ddp" / "checkpoints" / "step-0000002.pt")},
            {**_dit(shard_dir, root / "ddp-fsdp-ddp", max_steps=6),
             "copy_from": str(root / "ddp-fsdp" / "checkpoints" / "step-0000004.dcp")},
            {"config": {**TINY, **ic, "shards": str(latents), "run_dir": str(root / "ic-ddp")}},
            {"config": {**TINY, **ic, "shards": str(latents), "run_dir": str(root / "ic-fsdp"), "parallel": "fsdp"}},
            _dit(repa_shards, root / "repa-ddp", **repa),
            _dit(repa_shards, root / "repa-fsdp", **repa, parallel="fsdp"),
            _dit(shard_dir, root / "mf-ddp", objective="meanflow", max_steps=2),
            _dit(shard_dir, root / "mf-fsdp", objective="meanflow", max_steps=2, parallel="fsdp"),
            # the validation loss in each mode (_val), with grids and FID (hooks), beside the zero2 and fsdp runs
            # above without them
            _dit(shard_dir, root / "val-ddp", max_steps=4, **_val(shard_dir), **hooks),
            _dit(shard_dir, root / "val-zero2", max_steps=4, parallel="zero2", grad_checkpointing=True,
                 **_val(shard_dir), **hooks),
            _dit(shard_dir, root / "val-fsdp", max_steps=4, parallel="fsdp", log_keys=True, **_val(shard_dir),
                 **hooks),
            _dit(shard_dir, root / "val-hsdp", max_steps=2, parallel="hsdp", hsdp_shard_size=1, **_val(shard_dir))]
    return root, _job({"runs": runs}, root)


def test_every_family_shards_per_block_with_the_unsharded_gradients(job):
    _, result = job
    fams = result["families"]
    compiled, bf16 = fams.pop("DiT compiled"), fams.pop("bf16")
    assert compiled["compiled_units"] == 3 and compiled["graphs"] >= 1
    assert compiled["worst_relative_grad_difference"] < REL_GRAD
    # torchtitan's mixed precision: the blocks computed in bf16, the root in fp32, fp32 master weights and gradients
    assert bf16 == {"block": "torch.bfloat16", "root": "torch.float32", "grad": "torch.float32",
                    "master": "torch.float32"}
    assert set(fams) == {"DiT", "LightningDiT", "DDT", "DiT-DH", "DiT-DH-IC", "PixArt", "JiT", "iMF"}
    for family, row in fams.items():
        assert row["blocks"] >= 2 and row["sharded_blocks"] == row["blocks"] and row["root"], (family, row)
        if family != "iMF":  # iMF: structure only (its time input is its own)
            assert row["grads"] > 10 and row["worst_relative_grad_difference"] < REL_GRAD, (family, row)


def test_zero2_and_fsdp_train_as_ddp_does_and_a_checkpoint_crosses_modes(job):
    root, _ = job
    ddp = read_metrics(root / "ddp")
    for mode, steps in (("zero2", 4), ("fsdp", 6)):
        _same_run(read_metrics(root / mode), ddp[:steps])
        _close_states(_state(root / mode / "checkpoints" / f"step-{steps:07d}.dcp"),
                      _state(root / "ddp" / "checkpoints" / f"step-{steps:07d}.pt"))
    # DDP file -> FSDP run -> its sharded file -> DDP run: each leg continues the DDP run
    _same_run(read_metrics(root / "ddp-fsdp"), ddp[2:4])
    _same_run(read_metrics(root / "ddp-fsdp-ddp"), ddp[4:6])
    _close_states(_state(root / "ddp-fsdp-ddp" / "checkpoints" / "step-0000006.pt"),
                  _state(root / "ddp" / "checkpoints" / "step-0000006.pt"))
    assert "resumed from" in (root / "ddp-fsdp" / "log.txt").read_text()
    sharded = load_checkpoint(root / "fsdp" / "checkpoints" / "step-0000006.dcp")
    assert sharded["sharded"]["parallel"] == "fsdp" and sharded["sharded"]["world_size"] == 2
    assert len(sharded["sharded"]["files"]) == 2  # one safetensors file per rank


@pytest.mark.parametrize("family", ["ic", "repa", "mf"])
def test_text_repa_and_meanflow_runs_train_as_ddp_does(job, family):
    root, _ = job
    keys = ("loss", "grad_norm", "proj") if family == "repa" else ("loss", "grad_norm")
    _same_run(read_metrics(root / f"{family}-fsdp"), read_metrics(root / f"{family}-ddp"), keys)
    last = read_metrics(root / f"{family}-ddp")[-1]["step"]
    a = _state(root / f"{family}-fsdp" / "checkpoints" / f"step-{last:07d}.dcp")
    b = _state(root / f"{family}-ddp" / "checkpoints" / f"step-{last:07d}.pt")
    _close_states(a, b)
    if family == "repa":  # the projector trained sharded beside the model
        sd_a, sd_b = a["projector"]["state_dict"], b["projector"]["state_dict"]
        assert sd_a.keys() == sd_b.keys()
        for k in sd_a:
            assert_close_at_scale(sd_a[k], sd_b[k], rel=REL_WEIGHT, what=k)


def test_the_validation_loss_under_zero2_and_fsdp_is_ddps_and_changes_no_step(job):
    """--val-shards under the sharded modes (ZeRO-2, FSDP, HSDP, and a DiT inside REPA's projector unit): every rank
    runs the passes on its shards (train/validation.py) and rank 0 writes the DDP run's numbers (within REL_PASS at
    step 0, where the weights are the same; within REL_WEIGHT after AdamW steps); the passes, and the grids' and
    FID's beside them (_hooks), change nothing in training: the steps and the final checkpoint of the same run
    without them, bit for bit."""
    root, _ = job
    vals = {run: [r for r in read_metrics(root / run) if "val_run" in r]
            for run in ("val-ddp", "val-zero2", "val-fsdp", "val-hsdp", "repa-ddp", "repa-fsdp")}
    assert {run: [r["step"] for r in v] for run, v in vals.items()} == {
        **{run: [0, 2, 4] for run in vals}, "val-hsdp": [0, 2]}
    for run, ddp in (("val-zero2", "val-ddp"), ("val-fsdp", "val-ddp"), ("val-hsdp", "val-ddp"),
                     ("repa-fsdp", "repa-ddp")):
        got, want = vals[run], vals[ddp]
        for w in ("raw", "ema"):
            assert_close_at_scale(got[0][f"val_loss_{w}_t"], want[0][f"val_loss_{w}_t"], rel=REL_PASS, what=f"{run} {w}")
            for a, b in zip(got[1:], want[1:]):
                assert_close_at_scale(a[f"val_loss_{w}_t"], b[f"val_loss_{w}_t"], rel=REL_WEIGHT, what=f"{run} {w}")
        assert got[1]["val_loss_raw"] != got[0]["val_loss_raw"]  # the weights moved: not a stale number
    for mode in ("zero2", "fsdp"):  # beside the runs without validation passes
        fields = ("step", "loss", "grad_norm")
        with_val = [[r[k] for k in fields] for r in read_metrics(root / f"val-{mode}") if "loss" in r]
        without = [[r[k] for k in fields] for r in read_metrics(root / mode) if r["step"] <= 4]
        assert with_val == without, mode
        a, b = (_state(root / run / "checkpoints" / "step-0000004.dcp") for run in (f"val-{mode}", mode))
        for key in ("model", "ema"):
            assert all(torch.equal(a[key][k], b[key][k]) for k in a[key]), (mode, key)
    assert "val   step 4: ema" in (root / "val-fsdp" / "log.txt").read_text()


def test_grids_and_fid_under_zero2_and_fsdp_are_ddps_and_the_consolidated_files(job, tiny_vae_dir, tmp_path):
    """--sample-every and --fid-every under the sharded modes: every rank samples through its shards (the EMA's, and
    the raw model's, also inside REPA's projector unit; a text run's prompts) and rank 0 decodes and writes. The
    grids and FID numbers are the DDP run's (its weights within REL_WEIGHT: at most 1 level per pixel); the step-4
    grid is what dit-sample draws from the consolidated checkpoint and the FID what the hook computes from it on one
    process: equal on the development machine; allowed 1 level in a pixel (the gathered weights' pass may round
    otherwise on another CPU, REL_PASS) and REL_PASS. That the passes change no training step: the validation test
    above (the same runs)."""
    from PIL import Image

    from dit_pipeline.dit.family import family_class
    from dit_pipeline.evaluate.hook import FidHook
    from dit_pipeline.sample import SampleConfig
    from dit_pipeline.sample.run import run_sampling
    from dit_pipeline.train import merge_config
    from dit_pipeline.train.consolidate import consolidate
    from dit_pipeline.train.hooks import build_hooks

    root, _ = job

    def grid(path: Path) -> np.ndarray:
        with Image.open(path) as im:
            return np.asarray(im).astype(int)

    names = [f"step-{s:07d}{w}.png" for s in (2, 4) for w in ("", "-raw")]
    for run, ddp in (("val-zero2", "val-ddp"), ("val-fsdp", "val-ddp"), ("repa-fsdp", "repa-ddp"),
                     ("ic-fsdp", "ic-ddp")):
        want = names if run != "ic-fsdp" else [n for n in names if "raw" not in n]  # a text run: EMA grids of prompts
        assert sorted(p.name for p in (root / run / "samples").iterdir()) == sorted(want), run
        for name in want:
            a, b = grid(root / run / "samples" / name), grid(root / ddp / "samples" / name)
            assert a.shape == b.shape and np.abs(a - b).max() <= 1, (run, name)
    fid = {run: [(r["step"], r["fd_rand"]) for r in read_metrics(root / run) if "fd_rand" in r]
           for run in ("val-ddp", "val-zero2", "val-fsdp")}
    assert [s for s, _ in fid["val-fsdp"]] == [2, 4]
    for run in ("val-zero2", "val-fsdp"):
        assert_close_at_scale([v for _, v in fid[run]], [v for _, v in fid["val-ddp"]], rel=REL_WEIGHT, what=run)
    assert grid(root / "val-fsdp" / "samples" / "step-0000002.png").std() > 0

    folder = tmp_path / "checkpoints"  # the step-4 checkpoint consolidated: dit-sample and the hook on one process
    shutil.copytree(root / "val-fsdp" / "checkpoints" / "step-0000004.dcp", folder / "step-0000004.dcp")
    full, ema, _ = consolidate(folder / "step-0000004.dcp", quiet=True)
    out = run_sampling(SampleConfig(ckpt=str(ema), vae=str(tiny_vae_dir), class_labels=[1, 0, 1], seed=0,
                                    sampler="ddim", steps=5, cfg_scale=4.0, out=str(tmp_path / "grid"), quiet=True))
    assert out.grid is not None
    drawn, written = grid(out.grid), grid(root / "val-fsdp" / "samples" / "step-0000004.png")
    assert drawn.shape == written.shape and np.abs(drawn - written).max() <= 1
    config = json.loads((root / "val-fsdp" / "config.json").read_text())
    (hook,) = [h for h in build_hooks(merge_config({}, config)) if isinstance(h, FidHook)]
    ckpt = load_checkpoint(full)
    model = family_class(ckpt["model_config"].get("family")).from_config(ckpt["model_config"])
    model.load_state_dict(ckpt["ema"])
    ctx = HookContext(epoch=0, model=model, ema=None, rank=0, world_size=1, model_config=dict(model.config),
                      config=config, num_classes=2, latent=ckpt["latent"], device=torch.device("cpu"), step=4,
                      run_dir=tmp_path, metrics=None)
    assert_close_at_scale([hook(ctx)["fd_rand"]], [fid["val-fsdp"][1][1]], rel=REL_PASS, what="the hook's FID")


def test_consolidated_file_is_the_gathered_model_and_samples_as_the_ddp_file(job, tiny_vae_dir, tmp_path):
    from dit_pipeline.sample import SampleConfig
    from dit_pipeline.sample.run import run_sampling
    from dit_pipeline.train.consolidate import consolidate

    root, _ = job
    folder = tmp_path / "checkpoints"
    shutil.copytree(root / "fsdp" / "checkpoints", folder)
    written = consolidate(folder / "step-0000006.dcp", quiet=True)
    assert [p.name for p in written] == ["step-0000006.pt", "step-0000006-ema.pt", "step-0000006-ema.json"]
    one = load_checkpoint(written[0])
    gathered = torch.load(root / "gathered.pt", weights_only=True)
    for key in ("model", "ema"):  # bit for bit: the all-gathered live model and the streamed consolidation
        assert one[key].keys() == gathered[key].keys()
        assert all(torch.equal(one[key][k], gathered[key][k]) for k in one[key]), key
    sharded = _state(folder / "step-0000006.dcp")
    assert [list(g["params"]) for g in one["opt"]["param_groups"]] == [list(range(len(one["opt"]["state"])))]
    names = sharded["opt"]["param_groups"][0]["params"]  # torch's index layout of the name-keyed state
    assert all(torch.equal(one["opt"]["state"][i]["exp_avg"], sharded["opt"]["state"][n]["exp_avg"])
               for i, n in enumerate(names))
    with pytest.raises(UserError, match="already exist"):  # nothing overwritten
        consolidate(folder / "step-0000006.dcp", quiet=True)
    images = [np.load(run_sampling(SampleConfig(ckpt=str(ckpt), vae=str(tiny_vae_dir), class_labels=[0, 1], steps=5,
                                                npz=str(tmp_path / f"{i}.npz"), quiet=True)).npz)["arr_0"]
              for i, ckpt in enumerate([written[0], root / "ddp" / "checkpoints" / "step-0000006.pt"])]
    assert images[0].shape == images[1].shape and images[0].std() > 0
    assert np.abs(images[0].astype(int) - images[1].astype(int)).max() <= 1  # weights within REL_WEIGHT: 1 level


# -- kills, resume, another world size ----------------------------------------------------------------------------

STEPS = 6
CLI = {"max-steps": STEPS, "num-workers": 1, "micro-batch-size": 2, "parallel": "fsdp", "log-keys": True,
       "quiet": True}


def _keys(run: Path, rank: int) -> dict[int, list[int]]:
    return {r["step"]: r["keys"] for r in read_metrics(run / "logs" / f"rank{rank}.jsonl") if "keys" in r}


@pytest.fixture(scope="module")
def sharded_run(job):
    """The job's straight 2-rank FSDP run: CLI's settings, 6 steps of an epoch of 7, checkpoints at 2, 4, 6 (the
    trainer in the job's process, as dit-train runs it)."""
    return job[0] / "fsdp"


@pytest.mark.determinism
def test_kill_during_a_sharded_save_resumes_the_previous_bit_identically(shard_dir, sharded_run, tmp_path):
    run = tmp_path / "killed"
    args = tiny_args(shard_dir, run, **CLI)
    r = run_torchrun("dit-train", args, 2, env={"DIT_FAULT": "train.ckpt_mid_save@2:kill"}, timeout=900)
    assert r.returncode != 0
    ckpts = run / "checkpoints"
    assert CheckpointManager(ckpts).steps() == [2] and (ckpts / ".tmp-step-0000004.dcp").is_dir()  # never committed
    r = run_torchrun("dit-train", args, 2, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    log = (run / "log.txt").read_text()
    assert "removed 1 partial checkpoint file(s)" in log and "resumed from" in log and "step-0000002.dcp" in log
    keys = ("step", "loss", "mse", "vb", "grad_norm")
    assert [[x[k] for k in keys] for x in read_metrics(run)] == [[x[k] for k in keys] for x in read_metrics(sharded_run)]
    a, b = (_state(d / "checkpoints" / f"step-{STEPS:07d}.dcp") for d in (run, sharded_run))
    for key in ("model", "ema"):
        assert all(torch.equal(a[key][k], b[key][k]) for k in a[key]), key
    for name, st in a["opt"]["state"].items():
        assert all(torch.equal(v, b["opt"]["state"][name][k]) for k, v in st.items())


def test_two_ranks_to_one_continue_the_global_sample_sequence(shard_dir, sharded_run, tmp_path):
    from dit_pipeline.train import merge_config, run

    resumed = tmp_path / "one-rank"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(sharded_run / "checkpoints" / "step-0000002.dcp", resumed / "checkpoints" / "step-0000002.dcp")
    cfg = {**TINY, "shards": str(shard_dir), "run_dir": str(resumed), "max_steps": STEPS, "global_batch_size": 8,
           "micro_batch_size": 4, "num_workers": 1, "parallel": "fsdp", "log_keys": True}
    assert run(merge_config({}, cfg)) == "done"  # one process: its own process group for the DeviceMesh
    log = (resumed / "log.txt").read_text()
    assert ("resuming with a different data layout (world_size 2 -> 1, micro_batch 2 -> 4) at step 2 of 7 of "
            "epoch 0: the rest of this epoch reads the 2 rank stream(s) of the saved run") in log
    two = [_keys(sharded_run, r) for r in (0, 1)]
    one = _keys(resumed, 0)
    assert sorted(one) == list(range(3, STEPS + 1))
    for step in one:  # every step trains on the uninterrupted run's samples of that step
        assert sorted(one[step]) == sorted(two[0][step] + two[1][step]), step
    seen = [k for s in (1, 2) for r in (0, 1) for k in two[r][s]] + [k for s in one for k in one[s]]
    assert len(seen) == len(set(seen)) == 8 * STEPS  # none twice, none skipped


# -- bad inputs: one line, nothing written -------------------------------------------------------------------------

def _listing(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def test_bad_inputs_are_one_line_and_write_nothing(shard_dir, sharded_run, tmp_path):
    base = {k: v for k, v in CLI.items() if k != "log-keys"}
    r = invoke_train(tiny_args(shard_dir, tmp_path / "new", **{**base, "parallel": "hsdp", "hsdp-shard-size": 3}))
    assert r.exit_code == 1 and not (tmp_path / "new").exists()
    assert r.output.strip().splitlines()[-1] == ("error: --parallel hsdp: --hsdp-shard-size 3 does not divide the world "
                                                 "size 1 into equal shard groups; pass --hsdp-shard-size one of [1]")
    run = tmp_path / "run"
    shutil.copytree(sharded_run, run)
    before = _listing(run)
    r = invoke_train(tiny_args(shard_dir, run, **{**base, "max-steps": 8, "hidden-size": 64}))
    assert r.exit_code == 1 and r.output.strip().splitlines()[-1] == (
        f"error: checkpoint {run / 'checkpoints' / 'step-0000006.dcp'} is for a different model (custom): "
        "hidden_size: checkpoint 32, this run 64. Use the same --model and overrides, or a new --run-dir.")
    assert _listing(run) == before
    (run / "checkpoints" / "step-0000006.dcp" / "shard-00002-model-00001-of-00001.safetensors").unlink()
    before = _listing(run)
    r = invoke_train(tiny_args(shard_dir, run, **{**base, "max-steps": 8}))
    assert r.exit_code == 1 and r.output.strip().splitlines()[-1] == (
        f"error: sharded checkpoint {run / 'checkpoints' / 'step-0000006.dcp'} of 2 rank(s) is incomplete: "
        "shard-00002-model-00001-of-00001.safetensors (rank 1's) is missing. Nothing was loaded. Restore the file, or "
        "move the folder aside to resume from the previous checkpoint.")
    assert _listing(run) == before  # config.json, logs and checkpoints untouched
    r = invoke_train(["--consolidate", run / "checkpoints" / "step-0000006.dcp"])
    assert r.exit_code == 1 and "is incomplete" in r.output and _listing(run) == before


def test_refusals_with_the_reason(shard_dir, tmp_path):
    for over, says in (({"optimizer": "muon"}, "Muon orthogonalises each whole weight matrix"),
                       ({"precision": "fp16"}, "use --precision bf16"),
                       ({"parallel": "ddp", "hsdp-shard-size": 2}, "--hsdp-shard-size sets HSDP's shard groups"),
                       ({"gpu-memory": "lots"}, "is not a memory size such as 80GiB")):
        r = invoke_train(tiny_args(shard_dir, tmp_path / "run", **{**CLI, **over}))
        assert r.exit_code != 0 and says in r.output, (over, r.output)
    assert not (tmp_path / "run").exists()


# -- 4 ranks (make test-sweep) ---------------------------------------------------------------------------------------

@pytest.mark.sweep
def test_four_ranks_hsdp_fsdp_zero2_equal_ddp_and_four_to_two_continue_the_sequence(shard_dir, tmp_path):
    runs = [_dit(shard_dir, tmp_path / "ddp", max_steps=4),
            _dit(shard_dir, tmp_path / "zero2", max_steps=4, parallel="zero2"),
            _dit(shard_dir, tmp_path / "fsdp", max_steps=4, parallel="fsdp"),
            _dit(shard_dir, tmp_path / "hsdp", max_steps=4, parallel="hsdp", hsdp_shard_size=2, log_keys=True)]
    _job({"runs": runs}, tmp_path, nproc=4)
    ddp = read_metrics(tmp_path / "ddp")
    for mode in ("zero2", "fsdp", "hsdp"):
        _same_run(read_metrics(tmp_path / mode), ddp)
        _close_states(_state(tmp_path / mode / "checkpoints" / "step-0000004.dcp"),
                      _state(tmp_path / "ddp" / "checkpoints" / "step-0000004.pt"))
    assert load_checkpoint(tmp_path / "hsdp" / "checkpoints" / "step-0000004.dcp")["sharded"]["mesh"] == [2, 2]
    # 4 -> 2 ranks (HSDP 2 x 2 -> FSDP over 2) from step 2: the same global samples at every step
    resumed = tmp_path / "two"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "hsdp" / "checkpoints" / "step-0000002.dcp", resumed / "checkpoints" / "step-0000002.dcp")
    r = run_torchrun("dit-train", tiny_args(shard_dir, resumed, **{**CLI, "max-steps": 4}), 2, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    four = [_keys(tmp_path / "hsdp", k) for k in range(4)]
    two = [_keys(resumed, k) for k in range(2)]
    for step in (3, 4):
        assert sorted(two[0][step] + two[1][step]) == sorted(k for r in range(4) for k in four[r][step]), step


@pytest.mark.sweep
def test_a_sharded_run_rolls_back_to_its_sharded_checkpoint(shard_dir, tmp_path):
    """The divergence guard's rollback (train/guard.py) under FSDP: it loads the sharded checkpoint, sets the
    abandoned ones aside and rewrites the one it returns to (a folder replaced by a second rename)."""
    run = tmp_path / "run"
    over = {**CLI, "max-steps": 10, "num-workers": 0, "on-divergence": "rollback", "spike-window": 3, "max-skips": 2,
            "skip-window": 10, "log-keys": False}
    r = run_torchrun("dit-train", tiny_args(shard_dir, run, **over), 2, timeout=900,
                     env={"DIT_FAULT": "train.nan_batch@5,train.spike_batch@7", "DIT_FAULT_RANK": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    log = (run / "log.txt").read_text()
    assert "step 7: rolled back to step-0000004.dcp (rollback 1)" in log
    assert "divergence guard: 2 step(s) skipped (5, 7), 1 rollback(s) (step 7 -> 4, 3 batches skipped)" in log
    assert (run / "checkpoints" / "rolled-back" / "step-0000006.dcp").is_dir()
    assert CheckpointManager(run / "checkpoints").steps() == [6, 8, 10]
