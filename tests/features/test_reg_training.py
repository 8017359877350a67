"""REG and internal guidance end to end (issue 44 item 4): the DINOv2 class token cached at extraction
(`dit-extract --encoder-formula reg`, a sibling set of [z, 1, 1] tokens) is NanoGen's REG target, transcribed below
from End2End-Diffusion/diffusion-bench src/encoders/vision_encoder.py; `dit-train --use-reg --reg-tokens FOLDER
--base-model-depth 1` through the CLI trains the in-context DiT-DH with the class token and the base head, logs the
`reg` and `base` terms, records both in the checkpoint, resumes to the straight run's exact losses and weights,
refuses a resume without REG, and `dit-sample` samples the checkpoint with the class token, with and without
internal guidance (refused for a model without the base head)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dit_pipeline.shards import iter_shard, read_manifest, view_pixels
from dit_pipeline.train.checkpoint import CheckpointManager, load_checkpoint
from dit_pipeline.train.metrics import read_metrics
from tests.features._tiny import TINY_INPUT, tiny_encoder_model
from tests.train.conftest import invoke_train

IC = {"model": "ddt-en28d1152hd72-dn2d2048hd128", "depth": 2, "hidden-size": 32, "num-heads": 2, "head-depth": 1,
      "head-hidden-size": 32, "head-num-heads": 2, "patch-size": 1, "objective": "flow", "v-target": "clamped",
      "t-sampling": "logit-normal", "global-batch-size": 4, "micro-batch-size": 2, "num-workers": 0, "log-every": 1,
      "ckpt-every": 2, "lr": 1e-3, "quiet": None}


def nanogen_class_token(model: nn.Module, images_uint8: torch.Tensor, resolution: int) -> torch.Tensor:
    """vision_encoder.py DINOv2Encoder: the final norm replaced by LayerNorm without affine (l.207-210, torch's
    eps 1e-5), preprocess (l.216-223: /255, Normalize, interpolate bicubic to 224 x res // 256: here the tiny
    encoder's input), forward_features' x_norm_clstoken (l.225-231; timm's forward_features: norm(x)[:, 0])."""
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
    from torchvision.transforms import Normalize

    model.norm = nn.LayerNorm(model.embed_dim, elementwise_affine=False)
    x = Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)(images_uint8.float() / 255.0)
    x = F.interpolate(x, resolution, mode="bicubic")
    return model.forward_features(x)[:, 0]


def test_the_cached_class_tokens_are_nanogens_reg_target(reg_sets):
    vae, tokens = reg_sets
    m = read_manifest(tokens)
    enc = m.extraction["encoder"]
    assert m.latent_shape == [32, 1, 1] and enc["formula_name"] == "reg" and m.store == "sample"
    pix = {s.key: s.pixels for url in read_manifest(vae).shard_urls(str(vae))
           for s in iter_shard(url, read_manifest(vae), pixels="decoded")}
    cached = {s.key: s.latent for url in m.shard_urls(str(tokens)) for s in iter_shard(url, m)}
    assert sorted(pix) == sorted(cached) and len(pix) == 5
    net = tiny_encoder_model()
    with torch.no_grad():
        for key, crop in pix.items():
            views = torch.stack([torch.from_numpy(view_pixels(crop, v).copy()) for v in range(2)])  # [2, H, W, 3]
            want = nanogen_class_token(net, views.permute(0, 3, 1, 2), TINY_INPUT)                # [2, 32]
            got = torch.from_numpy(cached[key]).reshape(2, 32)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _train(shards, tokens, run, **extra):
    args = {"shards": shards, "run-dir": run, **IC, "use-reg": None, "reg-tokens": tokens, "base-model-depth": 1,
            "base-model-coeff": 0.5, **extra}
    flat = []
    for k, v in args.items():
        flat += [f"--{k}"] if v is None else [f"--{k}", str(v)]
    return invoke_train(flat)


def test_reg_trains_resumes_exactly_and_samples_through_the_clis(reg_sets, tiny_vae_dir, tmp_path):
    vae, tokens = reg_sets
    grids = {"sample-every": 3, "sample-classes": "0,1", "sample-steps": 2, "vae": tiny_vae_dir}
    # the validation loss of a REG model: each held-out sample with its class token (reg=)
    val = {"val-shards": f"{vae} reg={tokens}", "val-every": 2, "val-samples": 4, "val-timesteps": 2}
    r = _train(vae, tokens, tmp_path / "straight", **{"max-steps": 3, **grids, **val})
    assert r.exit_code == 0, r.output
    r = _train(vae, tokens, tmp_path / "resumed", **{"max-steps": 2, **val})
    assert r.exit_code == 0, r.output
    r = _train(vae, tokens, tmp_path / "resumed", **{"max-steps": 3, **val})  # continues from step 2
    assert r.exit_code == 0, r.output
    keys = ("step", "loss", "mse", "reg", "base", "grad_norm")
    a = [tuple(rec[k] for k in keys) for rec in read_metrics(tmp_path / "straight") if "loss" in rec]
    b = [tuple(rec[k] for k in keys) for rec in read_metrics(tmp_path / "resumed") if "loss" in rec]
    assert [x[0] for x in a] == [1, 2, 3] and a == b  # exact floats
    vals = [[(rec["step"], rec["val_loss_ema_t"], rec["val_loss_raw_t"]) for rec in read_metrics(tmp_path / run)
             if "val_loss_ema" in rec] for run in ("straight", "resumed")]
    assert [v[0] for v in vals[0]] == [0, 2] and vals[0] == vals[1]  # per level, bit for bit
    # the logged loss is the image MSE + 0.03 x the class token's + 0.5 x the base head's
    assert all(abs(loss - (mse + 0.03 * reg + 0.5 * base)) <= 1e-6 * loss for _, loss, mse, reg, base, _ in a)
    ca = load_checkpoint(CheckpointManager(tmp_path / "straight" / "checkpoints").latest())
    cb = load_checkpoint(CheckpointManager(tmp_path / "resumed" / "checkpoints").latest())
    for part in ("model", "ema"):
        assert all(torch.equal(ca[part][k], cb[part][k]) for k in ca[part])
    mc = ca["model_config"]
    assert (mc["reg_dim"], mc["base_model_depth"]) == (32, 1)
    assert ca["ema"]["final_layer.cls_linear.weight"].shape == (32, 32) and "base_final_layer.linear.weight" in ca["ema"]
    assert ca["reg"]["reg_coeff"] == 0.03 and ca["reg"]["target"]["formula_name"] == "reg"
    assert ca["internal_guidance"] == {"base_model_depth": 1, "base_model_coeff": 0.5}
    assert ca["objective"] == "flow" and ca["prediction"] == {"kind": "v", "t_eps": 0.05}
    assert (tmp_path / "straight" / "samples" / "step-0000003.png").is_file()  # the grid samples with the token

    # a resume without REG is refused before any work (the dry run runs the checkpoint's checks)
    flat = [str(v) for k, v in {"shards": vae, "run-dir": tmp_path / "straight"}.items() for v in (f"--{k}", v)]
    flat += [a for k, v in IC.items() for a in ([f"--{k}"] if v is None else [f"--{k}", str(v)])]
    r = invoke_train(flat + ["--max-steps", "4", "--base-model-depth", "1", "--base-model-coeff", "0.5", "--dry-run"])
    assert r.exit_code != 0 and "was trained with REG (--use-reg); resume it with --use-reg" in r.output

    from dit_pipeline.common.errors import UserError
    from dit_pipeline.sample import SampleConfig
    from dit_pipeline.sample.run import run_sampling

    # 3 steps leave the zero-initialised output layers near zero: sample the EMA weights perturbed
    ema = tmp_path / "ema.pt"
    raw = torch.load(tmp_path / "straight" / "checkpoints" / "step-0000002-ema.pt", weights_only=True)
    g = torch.Generator().manual_seed(0)
    torch.save({k: v if "rope" in k else v + 0.3 * torch.randn(v.shape, generator=g) for k, v in raw.items()}, ema)
    record = json.loads((tmp_path / "straight" / "checkpoints" / "step-0000002-ema.json").read_text())
    assert (record["model_config"]["reg_dim"], record["model_config"]["base_model_depth"]) == (32, 1)
    ema.with_suffix(".json").write_text(json.dumps(record))
    common = dict(ckpt=str(ema), vae=str(tiny_vae_dir), class_labels=[0, 1], cfg_scale=2.0, sampler="euler", steps=3,
                  quiet=True)
    run_sampling(SampleConfig(npz=str(tmp_path / "cfg.npz"), **common))
    run_sampling(SampleConfig(npz=str(tmp_path / "ig.npz"), ig_scale=3.0, ig_interval=[0.0, 1.0], **common))
    cfg_only, ig = np.load(tmp_path / "cfg.npz")["arr_0"], np.load(tmp_path / "ig.npz")["arr_0"]
    assert cfg_only.shape == ig.shape == (2, 32, 32, 3)
    assert np.abs(cfg_only.astype(int) - ig.astype(int)).max() > 1  # internal guidance acted

    headless = tmp_path / "headless.pt"  # the same model without the base head
    torch.save({k: v for k, v in torch.load(ema, weights_only=True).items() if not k.startswith("base_final")},
               headless)
    del record["model_config"]["base_model_depth"]
    headless.with_suffix(".json").write_text(json.dumps(record))
    with pytest.raises(UserError, match=r"internal guidance \(--ig-scale\) extrapolates from the model's base head"):
        run_sampling(SampleConfig(**{**common, "ckpt": str(headless)}, npz=str(tmp_path / "x.npz"), ig_scale=2.0))


def test_reg_and_internal_guidance_train_a_text_model_and_sample_it_from_prompts(encoder, tiny_vae_dir, tmp_path):
    """NanoGen's T2I REG configs (t2i-...-reg0.03-...-t4): the class token beside the image and the caption's tokens.
    `dit-train --text --use-reg --base-model-depth 1` trains the in-context DiT-DH on captions with the class token and
    the base head (both terms logged, both recorded with the text encoder), and `dit-sample --prompt` samples its EMA
    file with the class token, internal guidance changing the images."""
    from dit_pipeline.extract import ExtractConfig, run_extract
    from dit_pipeline.extract.text import run_text_extract
    from dit_pipeline.sample import SampleConfig
    from dit_pipeline.sample.run import run_sampling
    from tests._util import make_image_tree
    from tests.captions._tiny import make_tiny_qwen3
    from tests.features.conftest import BASE

    tree = make_image_tree(tmp_path / "images", counts=(2, 2))
    paths = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*.JPEG"))
    (tmp_path / "caps.jsonl").write_text("".join(json.dumps({"path": p, "caption": f"a photo number {i}"}) + "\n"
                                                 for i, p in enumerate(paths)))
    lat, tok, text = tmp_path / "lat", tmp_path / "tok", tmp_path / "text"
    run_extract(ExtractConfig(data_path=str(tree), out=str(lat), vae=str(tiny_vae_dir),
                              captions=str(tmp_path / "caps.jsonl"), **BASE))
    run_extract(ExtractConfig(data_path=str(tree), out=str(tok), encoder=str(encoder), encoder_formula="reg",
                              dtype="float32", **BASE))
    qwen = make_tiny_qwen3(tmp_path / "qwen3")
    run_text_extract(ExtractConfig(data_path=str(lat), out=str(text), text_encoder=str(qwen), text_max_length=16,
                                   batch_size=4, quiet=True))
    args = {"shards": lat, "text": text, "run-dir": tmp_path / "run", **IC, "use-reg": None, "reg-tokens": tok,
            "base-model-depth": 1, "max-steps": 2}
    r = invoke_train([a for k, v in args.items() for a in ([f"--{k}"] if v is None else [f"--{k}", str(v)])])
    assert r.exit_code == 0, r.output
    recs = [rec for rec in read_metrics(tmp_path / "run") if "loss" in rec]
    assert [rec["step"] for rec in recs] == [1, 2] and all(rec["reg"] > 0 and rec["base"] > 0 for rec in recs)
    for rec in recs:  # loss = image + 0.03 x class token + 1 x base head
        assert rec["loss"] == pytest.approx(rec["mse"] + 0.03 * rec["reg"] + rec["base"], rel=1e-5)
    ckpt = load_checkpoint(CheckpointManager(tmp_path / "run" / "checkpoints").latest())
    mc = ckpt["model_config"]
    assert (mc["conditioning"], mc["text_dim"], mc["reg_dim"], mc["base_model_depth"]) == ("text", 32, 32, 1)
    assert ckpt["text"]["encoder"]["source"] == str(qwen) and ckpt["reg"]["reg_dim"] == 32

    ema = tmp_path / "ema.pt"  # 2 steps leave the zero-initialised output layers near zero: perturb the EMA weights
    raw = torch.load(tmp_path / "run" / "checkpoints" / "step-0000002-ema.pt", weights_only=True)
    g = torch.Generator().manual_seed(0)
    torch.save({k: v if "rope" in k else v + 0.3 * torch.randn(v.shape, generator=g) for k, v in raw.items()}, ema)
    ema.with_suffix(".json").write_text((tmp_path / "run" / "checkpoints" / "step-0000002-ema.json").read_text())
    common = dict(ckpt=str(ema), vae=str(tiny_vae_dir), prompts=["a photo number 1", "a dog"], cfg_scale=2.0,
                  sampler="euler", steps=3, quiet=True)
    run_sampling(SampleConfig(npz=str(tmp_path / "cfg.npz"), **common))
    run_sampling(SampleConfig(npz=str(tmp_path / "ig.npz"), ig_scale=3.0, ig_interval=[0.0, 1.0], **common))
    cfg_only, ig = np.load(tmp_path / "cfg.npz")["arr_0"], np.load(tmp_path / "ig.npz")["arr_0"]
    assert cfg_only.shape == ig.shape == (2, 32, 32, 3) and np.abs(cfg_only.astype(int) - ig.astype(int)).max() > 1


def test_reg_settings_that_cannot_act_are_refused_and_the_record_guards_a_resume():
    from dit_pipeline.common.errors import ConfigError, UserError
    from dit_pipeline.train.config import TrainConfig
    from dit_pipeline.train.reg import RegPart

    def problems(**kw):
        with pytest.raises(ConfigError) as e:
            TrainConfig(shards="s", run_dir="r", **kw).validate()
        return str(e.value)

    ic = dict(model="ddt-en28d1152hd72-dn2d2048hd128", objective="flow")
    assert "--use-reg needs the class tokens: --reg-tokens FOLDER" in problems(use_reg=True, **ic)
    assert "NanoGen's REG configs train without REPA" in problems(use_reg=True, reg_tokens="t", repa="x", **ic)
    assert "--reg-tokens is REG's class tokens: add --use-reg" in problems(reg_tokens="t", **ic)
    assert "act on the flow objective" in problems(use_reg=True, reg_tokens="t", model=ic["model"], objective="ddpm")
    assert "built by NanoGen's in-context DiT-DH" in problems(base_model_depth=2, model="DiT-S/2", objective="flow")
    assert "--base-model-coeff weighs internal guidance's base head" in problems(base_model_coeff=0.5, **ic)
    target = {"kind": "features", "model": "vit_base_patch14_reg4_dinov2", "input_size": 224, "layers": 1,
              "model_args": {}, "weights_sha256": "a" * 64}
    saved = {"reg": {"reg_coeff": 0.03, "reg_dim": 768, "target": target}}
    RegPart({"reg_coeff": 0.03, "reg_dim": 768, "target": target}).check(saved, "ckpt")  # the same: continues
    for record, why in (({"reg_coeff": 0.05, "reg_dim": 768, "target": target}, "--reg-coeff 0.03"),
                        ({"reg_coeff": 0.03, "reg_dim": 768, "target": {**target, "weights_sha256": "b" * 64}},
                         "class tokens of another encoder"),
                        (None, "was trained with REG")):
        with pytest.raises(UserError, match=why):
            RegPart(record).check(saved, "ckpt")


def test_the_docs_commands_parse(tmp_path, monkeypatch):
    """Every dit-* command of docs/reg-pixnerd.md is accepted by its command's parser as written."""
    import re
    import shlex

    from dit_pipeline import cli
    from tests._util import REPO

    commands = {"dit-extract": cli.extract_main, "dit-train": cli.train_main, "dit-sample": cli.sample_main}
    text = (REPO / "docs" / "reg-pixnerd.md").read_text(encoding="utf-8")
    lines = [line for m in re.finditer(r"```bash\n(.*?)```", text, re.S) for line in m.group(1).splitlines()]
    assert lines and all(shlex.split(line)[0] in commands for line in lines)
    monkeypatch.chdir(tmp_path)
    for line in lines:
        name, *args = shlex.split(line)
        for a in args:
            if a.startswith(("shards/", "imagenet/")):
                (tmp_path / a).mkdir(parents=True, exist_ok=True)
        cmd = commands[name]
        if name == "dit-sample":
            cmd.commands["run"].make_context(name, list(args))
        else:
            cmd.make_context(name, list(args))


@pytest.mark.sweep
def test_reg_on_two_ranks_killed_and_resumed_is_bit_identical(reg_sets, tmp_path):
    """REG and the base head under DDP (2 gloo ranks): every parameter takes part in every step, and a run killed
    with SIGKILL after step 3 and resumed logs the straight run's exact values and ends with its weights."""
    from tests._util import straight_killed_resumed

    vae, tokens = reg_sets

    def args(run):
        a = {"shards": vae, "run-dir": run, **IC, "use-reg": None, "reg-tokens": tokens, "base-model-depth": 1,
             "max-steps": 4, "global-batch-size": 4, "micro-batch-size": 1}
        return [x for k, v in a.items() for x in ([f"--{k}"] if v is None else [f"--{k}", str(v)])]

    _, a, b = straight_killed_resumed(args, tmp_path, 4, ("step", "loss", "mse", "reg", "base", "grad_norm"),
                                      timeout=900)
    for part in ("model", "ema"):
        assert all(torch.equal(a[part][k], b[part][k]) for k in a[part])
