"""Text-conditional training end to end on a tiny captioned set (two captions per image, a tiny random Qwen3 saved with
save_pretrained, its text set made by dit-extract --text-encoder): NanoGen's in-context DiT-DH with `--text` trains
on 2 ranks (gloo) and a run killed with SIGKILL and resumed is bit-identical to a straight run (losses, weights,
EMA, optimizer); the captions encoded online give the very losses of the cached features; the checkpoint records
the condition and the encoder, and dit-sample draws from prompts with the encoder rebuilt from that record."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dit_pipeline.sample import SampleConfig
from dit_pipeline.sample.run import run_sampling
from dit_pipeline.train.metrics import read_metrics
from tests._util import make_image_tree, straight_killed_resumed
from tests.captions._tiny import make_tiny_qwen3
from tests.train.conftest import run_tiny, tiny_args

STEPS = 4
KEYS = ("step", "epoch", "loss", "mse", "grad_norm")
MODEL = {"model": "ddt-en28d1152hd72-dn2d2048hd128", "depth": 1, "hidden-size": 32, "num-heads": 2,
         "head-depth": 1, "head-hidden-size": 32, "head-num-heads": 2}


@pytest.fixture(scope="module")
def captioned(tmp_path_factory, tiny_vae_dir):
    """(latent set of 12 images in 3 classes with two captions each, its text set of a tiny Qwen3 at 24 tokens, the
    encoder's folder)."""
    from dit_pipeline.extract import ExtractConfig, run_extract
    from dit_pipeline.extract.text import run_text_extract

    root = tmp_path_factory.mktemp("t2i-train")
    tree = make_image_tree(root / "images", counts=(4, 4, 4))
    paths = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*.JPEG"))
    lines = [{"path": p, "long": f"a photo of a cat sitting on a red sofa number {i}", "short": f"image {i}"}
             for i, p in enumerate(paths)]
    (root / "captions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    run_extract(ExtractConfig(data_path=str(tree), out=str(root / "latents"), vae=str(tiny_vae_dir),
                              captions=str(root / "captions.jsonl"), caption_keys="long,short", image_size=32,
                              batch_size=4, samples_per_shard=4, num_workers=0, quiet=True))
    qwen = make_tiny_qwen3(root / "qwen3")
    run_text_extract(ExtractConfig(data_path=str(root / "latents"), out=str(root / "text"), text_encoder=str(qwen),
                                   text_max_length=24, batch_size=5, quiet=True))
    return root / "latents", root / "text", qwen


def _args(latents, text, run_dir, **more):
    return tiny_args(latents, run_dir, **{**MODEL, "text": text, "max-steps": STEPS, "ckpt-every": 2,
                                          "num-workers": 0, "global-batch-size": 4, "micro-batch-size": 2,
                                          "grad-clip": 1.0, **more})


@pytest.mark.determinism
def test_text_training_resumes_bit_identically_and_samples_from_prompts(captioned, tiny_vae_dir, tmp_path):
    """A text run on 2 ranks, with its grids of prompts (--sample-prompts: encoded once by the run's encoder), killed
    and resumed: the same steps and weights; the step-4 grid is what dit-sample draws from its EMA file with the
    same prompts, pixel for pixel; dit-sample rebuilds the encoder from the run's record."""
    from PIL import Image

    latents, text, qwen = captioned
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of a cat sitting on a red sofa\nimage 3\na dog\n")
    grids = {"sample-every": 2, "sample-prompts": prompts, "sample-steps": 5, "sample-weights": "both"}
    straight, a, b = straight_killed_resumed(lambda run: _args(latents, text, run, **grids), tmp_path, STEPS, KEYS,
                                             timeout=900)
    for key in ("model", "ema"):
        assert a[key].keys() == b[key].keys() and all(torch.equal(a[key][n], b[key][n]) for n in a[key]), key
    for i, st in a["opt"]["state"].items():
        assert all(torch.equal(v, b["opt"]["state"][i][k]) for k, v in st.items())
    mc = a["model_config"]
    assert (mc["conditioning"], mc["text_dim"], mc["num_c_tokens"]) == ("text", 32, 24)  # the encoder's max length
    assert a["text"]["encoder"]["source"] == str(qwen) and a["text"]["features"] == "cached"
    assert a["text"]["null_text"].shape == (0, 32)  # Qwen3's empty prompt has no token
    plan = (straight / "log.txt").read_text()
    assert "  condition   text features of width 32; dropout 0.1 to the empty prompt's features; text encoder" in plan
    assert f"  grids       every 2 steps, both weights, the prompts of {prompts}\n" in plan
    sidecar = json.loads((straight / "checkpoints" / f"step-{STEPS:07d}-ema.json").read_text())
    assert sidecar["text"]["encoder"]["source"] == str(qwen)

    out = tmp_path / "samples"
    run_sampling(SampleConfig(ckpt=str(straight), vae=str(tiny_vae_dir), prompts=["a photo of a cat",
                              "image 3"], num_samples=4, cfg_scale=2.0, sampler="euler", steps=2, out=str(out),
                              npz=str(tmp_path / "s.npz"), quiet=True))  # the encoder from the run's record
    assert np.load(tmp_path / "s.npz")["arr_1"].tolist() == [0, 0, 1, 1] and (out / "grid.png").is_file()

    names = {f"step-{s:07d}{w}.png" for s in (2, 4) for w in ("", "-raw")}
    assert {p.name for p in (straight / "samples").iterdir()} == names == {p.name for p in
                                                                            (tmp_path / "resumed" / "samples").iterdir()}
    config = json.loads((straight / "config.json").read_text())
    from dit_pipeline.sample.config import GRID_SAMPLER

    result = run_sampling(SampleConfig(ckpt=str(straight / "checkpoints" / f"step-{STEPS:07d}-ema.pt"),
                                       vae=str(tiny_vae_dir), prompts_file=str(prompts), seed=config["seed"],
                                       sampler=GRID_SAMPLER[config["objective"]], steps=5, cfg_scale=4.0,
                                       out=str(tmp_path / "again"), quiet=True))
    with Image.open(result.grid) as x, Image.open(straight / "samples" / f"step-{STEPS:07d}.png") as y:
        assert np.asarray(x).std() > 0 and np.array_equal(np.asarray(x), np.asarray(y))
    for name in names:  # the resumed run's grids: the straight run's
        assert (tmp_path / "resumed" / "samples" / name).read_bytes() == (straight / "samples" / name).read_bytes()


def test_online_features_give_the_cached_losses(captioned, tmp_path):
    """The drawn captions encoded while training (the text set's encoder rebuilt from its identity) against the
    text set's stored features: the same losses and weights, step by step (one process)."""
    latents, text, _ = captioned
    common = {k.replace("-", "_"): v for k, v in MODEL.items()}
    runs = {}
    for mode in ("cached", "online"):
        ckpt = run_tiny(latents, tmp_path / mode, **common, text=str(text), text_features=mode, max_steps=3,
                        global_batch_size=4, micro_batch_size=2, ckpt_every=3)
        runs[mode] = ([tuple(r[k] for k in KEYS) for r in read_metrics(tmp_path / mode)], ckpt)
    assert runs["online"][0] == runs["cached"][0] and len(runs["cached"][0]) == 3  # exact floats
    assert all(torch.equal(runs["online"][1]["ema"][k], v) for k, v in runs["cached"][1]["ema"].items())
    assert runs["online"][1]["text"]["features"] == "online"
    ckpt = runs["cached"][1]  # the text reached the network: its projection moved (the EMA, at 0.9999, barely did)
    assert (ckpt["model"]["ctx_embedder.proj.weight"] - ckpt["ema"]["ctx_embedder.proj.weight"]).abs().max() > 1e-4


def test_fid_during_a_text_run_draws_the_references_prompts_as_dit_sample_does(captioned, tiny_vae_dir, tmp_path):
    """`--fid-every` on a text run: the FID samples draw the captioned reference's prompts (REF.prompts.jsonl, prompt
    k for the N / P samples from k N / P) encoded by the run's text encoder and guided against the empty prompt; the
    record names the prompts and the encoder, and dit-sample with the recorded arguments on the same step's EMA file,
    then dit-eval, give the logged numbers. Refused before any work: no prompts, or a count that does not divide the
    samples."""
    from click.testing import CliRunner

    from dit_pipeline.cli_eval import eval_main
    from dit_pipeline.cli_sample import sample_main
    from dit_pipeline.common.prompts import write_prompts
    from dit_pipeline.evaluate.reference import prompts_path
    from tests.train.conftest import invoke_train

    latents, text, qwen = captioned
    bare, ref = tmp_path / "bare.npz", tmp_path / "ref.npz"
    for path in (bare, ref):  # 32 px images, as the latents decode
        np.savez(path, arr_0=np.random.default_rng(0).integers(0, 256, (6, 32, 32, 3), dtype=np.uint8))
    write_prompts(prompts_path(ref), [{"prompt": "a photo of a cat sitting on a red sofa"}, {"prompt": "image 3"}])
    fid = {"fid-every": 2, "fid-ref": ref, "fid-num-samples": 4, "fid-steps": 2, "fid-cfg-scale": 2.0,
           "fid-batch-size": 4, "fid-input-size": 75, "fid-random-inception": 0, "vae": tiny_vae_dir,
           "max-steps": 2, "ckpt-every": 2, "ema-decay": 0.0, "lr": 0.05}  # the EMA is the weights; the text path
    # moved from its zero init, so that each sample's prompt changes its image (what the comparison below checks)
    r = invoke_train(_args(latents, text, tmp_path / "run", **fid))
    assert r.exit_code == 0, r.output
    ev = [rec for rec in read_metrics(tmp_path / "run") if "fd_rand" in rec][-1]
    run = ev["fid_run"]
    assert ev["step"] == 2 and ev["fid_labels"] is None and run["guidance"].startswith("2 on ")
    assert (run["prompts"]["file"], run["prompts"]["count"]) == (str(prompts_path(ref)), 2)
    assert run["prompts"]["text_encoder"]["source"] == str(qwen) and len(run["prompts"]["prompts_sha256"]) == 64
    args = run["dit_sample_args"]
    assert args[args.index("--prompts") + 1] == str(prompts_path(ref)) and "--labels" not in args
    from dit_pipeline.train.report import write_report

    md = write_report(tmp_path / "run")[0].read_text()
    assert "guidance 2 on all channel(s), the 2 prompts of `ref.prompts.jsonl` encoded by " in md  # not "classes"

    npz = tmp_path / "offline.npz"
    r = CliRunner().invoke(sample_main, ["run", "--ckpt", str(tmp_path / "run" / "checkpoints" / "step-0000002.pt"),
                                         *args, "--npz", str(npz), "--quiet"])
    assert r.exit_code == 0, r.output
    assert np.load(npz)["arr_1"].tolist() == [0, 0, 1, 1]  # each prompt's samples, in order
    r = CliRunner().invoke(eval_main, [str(npz), "--ref", run["reference"]["path"], *run["dit_eval_args"], "--quiet"])
    assert r.exit_code == 0, r.output
    offline = json.loads((tmp_path / "offline.npz.eval.json").read_text())
    for key in ("fd_rand", "sfd_rand", "is_rand", "precision_rand", "recall_rand"):
        assert offline[key] == pytest.approx(ev[key], rel=1e-6, abs=1e-9), key

    r = invoke_train(_args(latents, text, tmp_path / "r2", **{**fid, "fid-ref": bare}))
    assert r.exit_code == 1 and ("FID during training (--fid-every) of a text run draws prompts: pass --fid-prompts "
                                 "FILE, or a captioned --fid-ref") in r.output
    r = invoke_train(_args(latents, text, tmp_path / "r3", **{**fid, "fid-num-samples": 5}))
    assert r.exit_code == 1 and f"--fid-num-samples 5 is not a multiple of the 2 prompts of {prompts_path(ref)}" \
        in r.output
    assert not (tmp_path / "r2").exists() and not (tmp_path / "r3").exists()


@pytest.mark.sweep
def test_fid_of_a_text_run_is_the_same_under_ddp_and_fsdp(captioned, tiny_vae_dir, tmp_path):
    """Every rank samples its share of a text run's FID samples, prompts encoded on each: 2 gloo ranks under DDP and
    under FSDP log the same number (to float rounding: the sharded passes gather the same weights)."""
    from dit_pipeline.common.prompts import write_prompts
    from dit_pipeline.evaluate.reference import prompts_path
    from tests._util import run_torchrun

    latents, text, _ = captioned
    ref = tmp_path / "ref.npz"
    np.savez(ref, arr_0=np.random.default_rng(0).integers(0, 256, (6, 32, 32, 3), dtype=np.uint8))
    write_prompts(prompts_path(ref), [{"prompt": "a photo of a cat sitting on a red sofa"}, {"prompt": "image 3"}])
    fid = {"fid-every": 2, "fid-ref": ref, "fid-num-samples": 4, "fid-steps": 2, "fid-cfg-scale": 2.0,
           "fid-batch-size": 1, "fid-input-size": 75, "fid-random-inception": 0, "vae": tiny_vae_dir,
           "max-steps": 2, "ckpt-every": 2, "ema-decay": 0.0, "lr": 0.05}
    got = {}
    for mode in ("ddp", "fsdp"):
        r = run_torchrun("dit-train", _args(latents, text, tmp_path / mode, parallel=mode, **fid), 2, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        got[mode] = [rec["fd_rand"] for rec in read_metrics(tmp_path / mode) if "fd_rand" in rec]
    assert len(got["ddp"]) == 1 and got["fsdp"] == pytest.approx(got["ddp"], rel=1e-6)
