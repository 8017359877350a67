"""The README's and the guides' commands and code, run as pasted where they can run on a CPU (tiny sizes
substituted). Every other shell line of the docs is parsed against the commands in tests/test_docs.py."""
from __future__ import annotations

import pytest
import torch

from dit_pipeline import dit
from tests import _docs
from tests._docs import block_after as _block_after


def test_python_api_snippet_runs(tmp_path, monkeypatch):
    """docs/python-api.md's block, run as written but with a tiny model in place of DiT-XL/2 and few steps."""
    code = _block_after("docs/python-api.md", "# Python API", "python")
    tiny = dit.create_model("DiT-S/8", input_size=32, num_classes=1000)
    torch.save(tiny.state_dict(), tmp_path / "DiT-XL-2-256x256.pt")
    code = code.replace('dit.create_model("DiT-XL/2", input_size=32, num_classes=1000)',
                        'dit.create_model("DiT-S/8", input_size=32, num_classes=1000)')
    code = code.replace('timestep_respacing="250"', 'timestep_respacing="3"')
    assert "DiT-S/8" in code and '"3"' in code, "the Python API block changed: update this test's substitutions"
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "docs/python-api.md", "exec"), scope)
    assert scope["samples"].shape == (8, 4, 32, 32)
    assert torch.isfinite(scope["samples"]).all()
    assert set(scope["losses"]) >= {"loss", "mse", "vb"}
    assert scope["losses"]["loss"].shape == (8,)
    assert scope["info"]["model_config"]["num_classes"] == 1000


def _commands(block: str) -> list[list[str]]:
    return _docs.command_lines(block)


# Training DiT-XL/2 for 400K steps is no CPU test: the README's dit-train commands run exactly as pasted with
# DIT_DRY_RUN=1 in front (every check the real run makes: shards, model vs latents, batch split, readers, run
# folder, resume point; then its plan). The same command with these sizes appended then trains the checkpoint
# that the pasted dit-sample line reads (click takes the last value of a repeated option).
TINY_TRAIN = ["--depth", "2", "--hidden-size", "32", "--num-heads", "2", "--global-batch-size", "8",
              "--micro-batch-size", "4", "--max-steps", "2", "--num-workers", "0", "--log-every", "1"]


def test_quickstart_commands_run_as_pasted(tmp_path, tiny_vae_dir):
    """The Quickstart block as a user pastes it, in a folder where imagenet/train is a small image tree
    (3 classes, 258 images: one global batch of 256) and the hub VAE id is the tiny local VAE (no downloads
    here). Substituted besides: dit-sample's checkpoint (the tiny run's) and class ids (3 classes here)."""
    from tests._util import make_image_tree, run_cli

    make_image_tree(tmp_path / "imagenet" / "train", counts=(86, 86, 86), size=(24, 20))
    commands = _commands(_block_after("README.md", "## Quickstart"))
    assert [c[0] for c in commands] == ["dit-extract", "dit-shards", "dit-train", "dit-sample"]
    for argv in commands:
        argv = [str(tiny_vae_dir) if a == "stabilityai/sd-vae-ft-ema" else a for a in argv]
        if argv[0] == "dit-train":
            res = run_cli(argv[0], argv[1:], cwd=tmp_path, env={"DIT_DRY_RUN": "1"}, timeout=600)
            assert res.returncode == 0, f"{argv}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
            assert "dit-train plan (dry run: nothing was started)" in res.stdout
            assert "length      max_steps 400000 -> 400,000 steps" in res.stdout
            assert "global 256 = 1 rank(s) x micro-batch 64 x 4 accumulation step(s)" in res.stdout
            assert not (tmp_path / "runs").exists()
            argv = [*argv, *TINY_TRAIN]
        if argv[0] == "dit-sample":  # the README's checkpoint name is the paper's step count
            ckpts = sorted((tmp_path / "runs/xl2/checkpoints").glob("step-*[0-9].pt"))
            argv = [str(ckpts[-1]) if a.endswith("step-0400000.pt") else a for a in argv]
            argv = ["0,1,2,0,1,2,0,1" if a.startswith("207,360") else a for a in argv]
        res = run_cli(argv[0], argv[1:], cwd=tmp_path, timeout=900)
        assert res.returncode == 0, f"{argv}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    assert (tmp_path / "shards/manifest.json").is_file()
    assert (tmp_path / "samples/grid.png").is_file()


def test_eight_gpu_training_commands_pass_every_check(tmp_path, monkeypatch):
    """Both 8-GPU dit-train lines of "ImageNet on 8 GPUs" exactly as pasted (shards/in1k-256 is a synthetic
    256px shard set here), under DIT_DRY_RUN=1: the torchrun line as rank 0 of its 8 ranks sees it, the
    --nproc-per-node line as its launcher plans it. They plan the same run."""
    from tests._util import run_cli
    from tests.train.helpers import make_shard_set

    make_shard_set(tmp_path / "shards" / "in1k-256", samples=[64] * 16, latent_shape=(4, 32, 32),
                   dtype="float16")
    monkeypatch.chdir(tmp_path)
    block = _block_after("README.md", "**Training DiT-XL/2 as in the paper**")
    lines = [c for c in _commands(block) if "dit-train" in " ".join(c)]
    assert len(lines) == 2
    plans = []
    for argv in lines:
        env = {"DIT_DRY_RUN": "1"}
        if argv[0] == "torchrun":  # torchrun --nproc-per-node 8 $(which dit-train) ARGS: rank 0 of 8
            at = next(i for i, a in enumerate(argv) if a.endswith("dit-train)"))
            argv = ["dit-train", *argv[at + 1:]]
            env.update(WORLD_SIZE="8", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="8")
        res = run_cli(argv[0], argv[1:], cwd=tmp_path, env=env, timeout=600)
        assert res.returncode == 0, f"{argv}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
        assert "global 256 = 8 rank(s) x micro-batch 32 x 1 accumulation step(s)" in res.stdout
        assert "length      max_steps 7000000 -> 7,000,000 steps" in res.stdout
        plans.append(res.stdout)
    # the other single-node training lines (the objectives), in-process with the same environment variable
    from click.testing import CliRunner

    from dit_pipeline.cli import train_main
    # (docs/reg-pixnerd.md's REG lines need their token sets: tests/features/test_reg_training.py runs that page)
    others = [args for name, args, where in _docs.invocations()
              if name == "dit-train" and "--objective" in args and "/shared/" not in " ".join(args)
              and not where.startswith("docs/reg-pixnerd.md")]
    assert sorted(args[args.index("--objective") + 1] for args in others) == ["flow", "flow", "meanflow"]
    for args in others:
        r = CliRunner().invoke(train_main, args, env={"DIT_DRY_RUN": "1"}, catch_exceptions=False)
        assert r.exit_code == 0 and "dit-train plan (dry run: nothing was started)" in r.output, r.output
        objective = args[args.index("--objective") + 1]
        if objective == "flow":
            assert "  objective   flow (linear interpolant, velocity prediction; training times " in r.output, \
                r.output
        else:
            assert f"  objective   {objective}" in r.output, r.output
    assert not (tmp_path / "runs").exists()


def test_which_checks_catch_what(tmp_path):
    """docs/troubleshooting.md's "Which checks catch what": a flipped byte inside a latent (values stay finite) passes
    `verify --quick`, the trainer's start-up check and its sample checks; the full verify and the trainer's
    sha256 check catch it. A truncated shard is caught by --quick and the start-up check."""
    import shutil

    from dit_pipeline.shards import ShardError, iter_shard, quick_check, read_manifest, verify_shards
    from tests.shards.test_sha256_check import flip_payload_byte
    from tests.train.helpers import make_shard_set

    section = _docs.section("docs/troubleshooting.md", "## Which checks catch what")
    assert "only the sha256 checks catch it" in section
    flipped, cut = tmp_path / "flipped", tmp_path / "cut"
    make_shard_set(flipped, samples=[4, 4])
    shutil.copytree(flipped, cut)
    flip_payload_byte(flipped / "shard-000001.tar")
    m = read_manifest(flipped)
    assert verify_shards(flipped, quick=True, progress=False).ok
    assert quick_check(flipped, m) == []
    assert len(list(iter_shard(str(flipped / "shard-000001.tar"), m, raw=True))) == 4  # sample checks pass
    full = verify_shards(flipped, progress=False)
    assert not full.ok and full.problems == [("shard-000001.tar", full.problems[0][1])]
    assert full.problems[0][1].startswith("sha256 mismatch")
    for mode in ("whole", "stream"):
        with pytest.raises(ShardError, match="sha256 mismatch"):
            list(iter_shard(str(flipped / "shard-000001.tar"), m, raw=True, sha256=mode))

    data = (cut / "shard-000000.tar").read_bytes()
    (cut / "shard-000000.tar").write_bytes(data[:len(data) - 1024])
    assert not verify_shards(cut, quick=True, progress=False).ok
    assert quick_check(cut, read_manifest(cut))[0].startswith("shard-000000.tar: ")


@pytest.mark.timeout(1200)
def test_fid_recipe_runs_as_pasted(tmp_path, tiny_vae_dir):
    """docs/evaluation.md's "full recipe" block: its two torchrun lines, in a folder holding DiT-XL-2-256x256.pt
    (here a small bare DiT-S/8 state_dict under that name) and VIRTUAL_imagenet256_labeled.npz (here 8 random 64 px images), on
    2 gloo ranks instead of 8. Substituted: the hub VAE id (the tiny local VAE), 50000 -> 8 samples and
    250 -> 2 steps; appended: the hidden random-Inception knobs (the real weights cannot be fetched here).
    The npz and the eval JSON land where the comments say."""
    import json
    import subprocess

    import numpy as np

    from tests._util import cli_env, torchrun_cmd

    model = dit.create_model("DiT-S/8", input_size=8, num_classes=1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "pos_embed":
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(0))
    torch.save(model.state_dict(), tmp_path / "DiT-XL-2-256x256.pt")
    ref = np.random.default_rng(0).integers(0, 256, (8, 64, 64, 3), dtype=np.uint8)
    np.savez(tmp_path / "VIRTUAL_imagenet256_labeled.npz", arr_0=ref)
    block = _block_after("docs/evaluation.md", "The full recipe for the paper's DiT-XL/2 256x256 table")
    commands = _commands(block)
    assert [c[:3] for c in commands] == [["torchrun", "--nproc-per-node", "8"]] * 2
    subs = {"stabilityai/sd-vae-ft-ema": str(tiny_vae_dir), "50000": "8", "250": "2"}
    for argv, extra in zip(commands, ([], ["--random-inception", "0", "--input-size", "75", "--batch-size", "4"])):
        at = next(i for i, a in enumerate(argv) if a.startswith("$(which"))
        name = argv[at + 1].rstrip(")")
        args = [subs.get(a, a) for a in argv[at + 2:]] + extra
        res = subprocess.run(torchrun_cmd(name, args, nproc=2), capture_output=True, text=True, env=cli_env(None),
                             cwd=tmp_path, timeout=900)
        assert res.returncode == 0, f"{name} {args}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    with np.load(tmp_path / "samples/dit-xl2-256-cfg1.5.npz") as z:
        assert z["arr_0"].shape == (8, 64, 64, 3) and z["arr_1"].shape == (8,)
    result = json.loads((tmp_path / "samples/dit-xl2-256-cfg1.5.npz.eval.json").read_text())
    assert all(np.isfinite(result[k]) for k in ("fd_rand", "sfd_rand", "is_rand", "precision_rand", "recall_rand"))
    assert result["samples"]["label_sampling"] == "uniform" and result["samples"]["count"] == 8


def test_other_vaes_disk_table_and_training_lines(tmp_path, monkeypatch):
    """docs/vaes.md: every number of the disk table is extract/plan.bytes_per_sample for ImageNet-1k (which the
    tiny tokenizer sets measure exactly: tests/train/test_tokenizers.py), and both dit-train lines pass every
    check as pasted under DIT_DRY_RUN=1 on synthetic sets of those latent shapes (VA-VAE's 32x16x16 normalized
    per channel, DC-AE's 32x8x8), their plans saying the tokens per image and the normalization."""
    from click.testing import CliRunner

    from dit_pipeline.cli import train_main
    from dit_pipeline.extract.plan import bytes_per_sample
    from tests._util import run_cli
    from tests.train.helpers import make_shard_set

    section = _docs.text("docs/vaes.md")
    images = 1_281_167

    def gib(b: int) -> str:
        return f"{b * images / 2 ** 30:.1f} GiB"

    for label, shape, arrays in (("SD-VAE (default)", (4, 32, 32), 2), ("SD3, FLUX.1", (16, 32, 32), 2),
                                 ("VA-VAE", (32, 16, 16), 2), ("DC-AE f32c32", (32, 8, 8), 1)):
        two, one = bytes_per_sample(2, arrays, shape, 2), bytes_per_sample(1, arrays, shape, 2)
        store = "posterior" if arrays == 2 else "sample"
        row = f"| {label} | {'x'.join(map(str, shape))} | {store} | {two:,} | {gib(two)} | {gib(one)} |"
        assert row in section, row
    sample = bytes_per_sample(2, 1, (16, 32, 32), 2)
    assert f"(SD3/FLUX: {sample:,} bytes, {gib(sample)})" in section

    norm = {"form": "mean_std", "mean": [0.0] * 32, "std": [1.0] * 32, "multiplier": 1.0,
            "source": {"kind": "stats", "samples_used": 512, "seed": 0}}
    make_shard_set(tmp_path / "shards" / "in1k-256-vavae", samples=[32] * 16, latent_shape=(32, 16, 16),
                   dtype="float16", normalization=norm)
    make_shard_set(tmp_path / "shards" / "in1k-256-dcae", samples=[256] * 4, latent_shape=(32, 8, 8), store="sample",
                   dtype="float16", scaling_factor=0.41407)
    monkeypatch.chdir(tmp_path)
    lines = [c for c in _commands(_block_after("docs/vaes.md", "# Other VAEs")) if "dit-train" in " ".join(c)]
    assert len(lines) == 2 and lines[0][0] == "torchrun"
    at = next(i for i, a in enumerate(lines[0]) if a.endswith("dit-train)"))
    env = {"DIT_DRY_RUN": "1", "WORLD_SIZE": "8", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"}
    res = run_cli("dit-train", lines[0][at + 1:], cwd=tmp_path, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert ("  model       DiT-XL/1 (depth 28, hidden 1152, heads 16, patch 1): " in res.stdout
            and "input 16 (16x16 latents / patch 1 = 256 tokens per image)" in res.stdout), res.stdout
    assert ("  latents     per-channel over 32 channels: (z - mean_c) * 1 / std_c (mean 0..0, std 1..1), from "
            "dit-shards stats over 512 samples (seed 0)") in res.stdout
    assert "objective   flow (as --model SiT-XL/1 implies;" in res.stdout
    r = CliRunner().invoke(train_main, lines[1][1:], env={"DIT_DRY_RUN": "1"}, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "input 8 (8x8 latents / patch 1 = 64 tokens per image)" in r.output
    assert "latents 32x8x8 float16, scaling 0.41407, 2 classes" in r.output
    assert not (tmp_path / "runs").exists()


def test_format_reading_snippet_runs(tmp_path, monkeypatch):
    """docs/FORMAT.md "Reading": plain WebDataset reads a shard set of four shards as the block writes it, with
    nothing of ours imported by the block."""
    import numpy as np

    from tests.train.helpers import make_shard_set

    make_shard_set(tmp_path / "shards", samples=[2, 2, 2, 2], dtype="float16")
    code = _block_after("docs/FORMAT.md", "## Reading", "python")
    assert "dit_pipeline" not in code
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "docs/FORMAT.md:reading", "exec"), scope)
    assert scope["key"] == "000000007" and scope["label"] == 7 % 2
    assert scope["mean"].dtype == np.float32 and scope["mean"].shape == (1, 4, 8, 8)
