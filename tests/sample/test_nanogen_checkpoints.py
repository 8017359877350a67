"""NanoGen's released checkpoints (End2End-Diffusion/diffusion-bench) load unchanged and `dit-sample --protocol
nanogen/<config>` samples them as NanoGen does (issue 44 item 5): its loops are written out here from its code (file
and line at each rule) and run on the same tiny random weights and the noise dit-sample draws (sample/plan.py).

What a NanoGen file holds, from its code:
- training writes `{step, epoch, model, ema, optimizer, scheduler}`: model.module.state_dict(), ema_model.state_dict(),
  optimizer.state_dict(), scheduler.state_dict() or None (src/utils/checkpoint.py l.65-84 save_stage2_checkpoint), as
  `ep-{epoch:07d}.pt` (src/stage2/engine.py l.97); the EMA is a deepcopy of the bare network (src/train.py l.140), so
  its keys carry no `module.` or `_orig_mod.` prefix;
- a sampling config names its released file in `stage_2.ckpt` (`pretrained_models/<task>/ckpts/<name>-v<n>.pt`), and
  src/offline_eval.py l.108 builds the network with instantiate_from_config, which loads the file's `ema` where it has
  one and otherwise the file itself as a bare state_dict (src/utils/model_utils.py l.33-39): a release is either;
- nothing else: what the network predicts (transport.prediction), the latent space (stage_1) and the text encoder
  (conditioning.text_encoder) are the YAML's only. The JiT and PixNerd networks are the same DiTwDDTHead on pixels
  (configs/stage2/sampling/imagenet/jit-...-xpred-t4c8.yaml l.6-16 and pixnerd-...-vpred-t4c8.yaml l.6-16), one
  predicting x, the other the velocity: a file alone cannot say which.

So the named config's row supplies them (sample/facts.py), the sample record says where each came from, and a file
whose prediction nothing states is refused, never sampled as a velocity model (which `--protocol nanogen-pixels` did to
the JiT file before, exit 0). REG files sample with their class token (dit/incontext.py reg_dim).
"""
from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch

from dit_pipeline import dit
from dit_pipeline.common.errors import ConfigError, UserError
from dit_pipeline.common.vae import load_vae
from dit_pipeline.dit.family import create_model
from dit_pipeline.sample import SampleConfig, run_sampling
from tests._util import make_tiny_vae
from tests.sample.test_protocols_sample import (decode, nanogen_pixels, nanogen_release, noise_of, own_checkpoint,
                                                same_pixels)

N = "ddt-en28d1152hd72-dn2d2048hd128"
JIT = f"nanogen/jit-{N}-xpred-t4c8-cfg2.6-t0.0-0.9"
PIXELGEN = f"nanogen/pixelgen-{N}-xpred-t4c8-0.1lpips-0.01pdino-thresh0.7"
PIXNERD = f"nanogen/pixnerd-{N}-vpred-t4c8"
SDVAE = f"nanogen/{N}-sdvae-ema-vpred-t4c8-cfg1.6-t0.0-0.9"
MEANFLOW = f"nanogen/mf-{N}-sdvae-mse-vpred-t4c8-kappa0.5"
T2I_512 = "nanogen/t2i-ddt-en28d1584hd72-dn2d2048hd128-qwen-vae-vpred-t4-512res"
SD_SCALE = 0.18215  # src/stage1/vae.py l.53-66: sdvae-ema and sdvae-mse, scaling_factor 0.18215, shift 0.0


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def nanogen_net(seed, *, channels=4, size=32, patch=2, std=0.05, meanflow=False, **over):
    """A tiny NanoGen in-context DiT-DH (its release's names and shapes) with every tensor perturbed."""
    torch.manual_seed(seed)
    kw = dict(depth=1, hidden_size=32, num_heads=2, head_depth=1, head_hidden_size=32, head_num_heads=2, num_classes=5)
    net = create_model(N, input_size=size, in_channels=channels, patch_size=patch, **{**kw, **over})
    if meanflow:
        net.set_conditions("meanflow")
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(std * torch.randn(p.shape, generator=g))
    return net.eval()


def release_file(folder, row, net, layout="container"):
    """`net` saved as NanoGen's release of the row's config, `<name>-v<n>.pt` (module docstring): its training
    checkpoint (a real AdamW's and LambdaLR's state, and trained weights other than the EMA) or the bare EMA."""
    name = dit.protocols.protocol(row).model.split(" ")[0]
    path = folder / name
    ema = {k: v.clone() for k, v in net.state_dict().items()}
    if layout == "bare":
        torch.save(ema, path)
        return path
    trained = copy.deepcopy(net)
    opt = torch.optim.AdamW(trained.parameters(), lr=2e-4, betas=(0.9, 0.95), weight_decay=0.0)
    for p in trained.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    torch.save({"step": 4000, "epoch": 80, "model": trained.state_dict(), "ema": ema, "optimizer": opt.state_dict(),
                "scheduler": scheduler.state_dict()}, path)
    return path


def run(tmp_path, ckpt, name, *, n=2, **kw):
    """dit-sample (in-process) -> (uint8 images, labels, the record)."""
    npz = tmp_path / f"{name}.npz"
    run_sampling(SampleConfig(ckpt=str(ckpt), num_samples=n, npz=str(npz), quiet=True, seed=5, batch_size=n, **kw))
    with np.load(npz) as z:
        images, labels = z["arr_0"].astype(int), torch.as_tensor(z["arr_1"])
    return images, labels, json.loads((tmp_path / f"{name}.npz.json").read_text())


def refused(tmp_path, ckpt, **kw) -> str:
    npz = tmp_path / "refused.npz"
    with pytest.raises(UserError) as e:
        run_sampling(SampleConfig(ckpt=str(ckpt), num_samples=2, npz=str(npz), quiet=True, **kw))
    assert not npz.exists() and not (tmp_path / "refused.npz.json").exists()
    return str(e.value)


@pytest.fixture(scope="module")
def flat_vae(tmp_path_factory):
    """A tiny AutoencoderKL without down-sampling (4 latent channels, scaling_factor 0.5): 32 x 32 latents decode
    to 32 x 32 images, cheaply."""
    return make_tiny_vae(tmp_path_factory.mktemp("vae") / "flat", down_block_types=("DownEncoderBlock2D",),
                         up_block_types=("UpDecoderBlock2D",), block_out_channels=(8,))


def from_row(row, key):
    """Where the record says a setting came from: the row and its config's key."""
    return f"--protocol {row} ({dit.protocols.protocol(row).sources[0]} {key})"


# ---- ImageNet on SD-VAE latents --------------------------------------------------------------------------------------

def test_a_released_class_file_samples_as_nanogen(tmp_path, flat_vae, monkeypatch):
    net = nanogen_net(1)
    ckpt = release_file(tmp_path, SDVAE, net)
    assert ckpt.name == f"{N}-sdvae-ema-vpred-t4c8-v0.pt"  # the config's stage_2.ckpt
    (tmp_path / "bare").mkdir()
    bare = release_file(tmp_path / "bare", SDVAE, net, layout="bare")
    (sd, info), (sd_bare, info_bare) = dit.load_dit_weights(ckpt), dit.load_dit_weights(bare)
    assert info["weights"] == "ema" and info["step"] == 4000 and info["release"] == info_bare["release"] == "NanoGen"
    assert sd.keys() == sd_bare.keys() and all(torch.equal(sd[k], sd_bare[k]) for k in sd)
    assert set(info["unstated"]) == set(info_bare["unstated"]) == {"prediction", "vae"}
    # without the config: nothing states the prediction or the latent space
    msg = refused(tmp_path, ckpt)
    assert msg.startswith(f"--ckpt {ckpt}: NanoGen's files do not record what the network predicts")
    assert "name the config: --protocol nanogen/<config> (rows that state it and fit this model: " \
           f"nanogen/{N}-sdvae-ema-vpred-t4c8," in msg
    assert "; and NanoGen's files do not record their latent space (stage_1 of the config); pass --vae" in msg
    # without --vae the row names the decoder (the hub's SD-VAE-EMA, not fetched here)
    import dit_pipeline.sample.run as sample_run

    asked: list[str] = []
    monkeypatch.setattr(sample_run, "load_vae", lambda spec, **kw: asked.append(spec) or (_ for _ in ()).throw(
        UserError("not fetched")))
    refused(tmp_path, ckpt, protocol=SDVAE)
    monkeypatch.undo()
    assert asked == ["stabilityai/sd-vae-ft-ema"]
    got, y, record = run(tmp_path, ckpt, "sdvae", protocol=SDVAE, vae=str(flat_vae))
    noise, _ = noise_of(5, 2, (4, 32, 32))
    # the config's 50 steps, cfg 1.6 on [0, 0.9], the grid unshifted (sqrt(4 x 32 x 32 / 4096) = 1); NanoGen's VAE
    # decodes with its table's scaling_factor (src/stage1/vae.py l.237), not the tiny VAE config's 0.5
    want = nanogen_release(net, noise, y, num_steps=50, scale=1.6, t_max=0.9, shift=1.0)
    vae = load_vae(str(flat_vae))[0]
    same_pixels(got, nanogen_pixels(decode(vae, want, scale=SD_SCALE)))
    assert record["settings_from"] == {"prediction": from_row(SDVAE, "transport.prediction"), "vae": "--vae",
                                       "latent": from_row(SDVAE, "stage_1")}
    assert record["fingerprint"]["prediction"] == {"kind": "v", "t_eps": 0.05}
    assert record["fingerprint"]["scaling_factor"] == SD_SCALE and record["label_sampling"] == "equal"


# ---- pixels: JiT (x), PixelGen (x), PixNerd (velocity): one network --------------------------------------------------

@pytest.fixture(scope="module")
def pixel_file(tmp_path_factory):
    """A tiny NanoGen pixel model (256 x 256 x 3 in 16 x 16 patches, as the JiT, PixelGen and PixNerd configs) saved
    as the JiT release."""
    net = nanogen_net(3, channels=3, size=256, patch=16)
    return net, release_file(tmp_path_factory.mktemp("jit"), JIT, net)


def test_nanogens_jit_file_is_no_longer_sampled_as_a_velocity_model(tmp_path, pixel_file):
    """Before: `--protocol nanogen-pixels` on NanoGen's JiT file recorded no prediction and sampled the x-predicting
    network as a velocity model, exit 0. Now the file is refused until its config (or --prediction) says what it
    predicts, and the config's row samples it as NanoGen does."""
    net, ckpt = pixel_file
    msg = refused(tmp_path, ckpt, protocol="nanogen-pixels", vae="pixels")  # before: sampled, exit 0
    assert msg == (
        f"--ckpt {ckpt}: NanoGen's files do not record what the network predicts (transport.prediction of its config: "
        "x for its JiT and PixelGen models, the velocity for the others, with the same network), and --protocol "
        "nanogen-pixels does not say which (its configs differ in it); name the config: --protocol nanogen/<config> "
        f"(rows that state it and fit this model: nanogen/jit-{N}-xpred-t4c8, {JIT}, {PIXELGEN}, "
        f"{PIXELGEN}-cfg2.0-t0.0-0.9, {PIXNERD}, {PIXNERD}-cfg2.4-t0.0-0.9), or pass --prediction x|velocity")
    assert "no --protocol names its config" in refused(tmp_path, ckpt, vae="pixels", sampler="euler", steps=2)
    got, y, record = run(tmp_path, ckpt, "jit", protocol=JIT)  # the pixel space from the row: no --vae
    noise, _ = noise_of(5, 2, (3, 256, 256))
    # the config: 50 steps, cfg 2.6 on [0, 0.9], unshifted (time_dist_shift_base_eval = the dim); prediction 'x':
    # drift (x_t - out) / t.clamp_min(0.05) (src/stage2/transport/transport.py l.105-111)
    want = nanogen_release(net, noise, y, num_steps=50, scale=2.6, t_max=0.9, shift=1.0, x_pred=True)
    same_pixels(got, nanogen_pixels(want))
    assert record["settings_from"] == {"prediction": from_row(JIT, "transport.prediction"),
                                       "vae": from_row(JIT, "stage_1"), "latent": from_row(JIT, "stage_1")}
    assert record["fingerprint"]["prediction"] == {"kind": "x", "t_eps": 0.05}
    # nanogen-pixels is that config's sampler (here at 10 steps): with --prediction x, NanoGen's x loop
    short, _, generic = run(tmp_path, ckpt, "generic", protocol="nanogen-pixels", prediction="x", steps=10)
    same_pixels(short, nanogen_pixels(nanogen_release(net, noise, y, num_steps=10, scale=2.6, x_pred=True)))
    assert generic["settings_from"]["prediction"] == "--prediction"
    # what the velocity reading gave: other images altogether
    as_velocity = nanogen_pixels(nanogen_release(net, noise, y, num_steps=10, scale=2.6, x_pred=False))
    assert np.abs(as_velocity - short).mean() > 20
    # nor does an export launder it: its safetensors would record no prediction, read as the velocity
    from dit_pipeline.sample.config import ExportConfig
    from dit_pipeline.sample.export import export

    with pytest.raises(UserError, match="NanoGen's files do not record what the network predicts .* an export would "
                                        "record none, which reads as a velocity model, so it is not exported"):
        export(ExportConfig(to="safetensors", output=str(tmp_path / "jit.safetensors"), ckpt=str(ckpt)))
    assert not (tmp_path / "jit.safetensors").exists()
    # a flag that contradicts a file's record is refused (ours record the prediction; none: the velocity)
    ours = own_checkpoint(tmp_path / "ours.pt", net, convention="repa",
                          latent={"scaling_factor": 1.0, "shift_factor": None})
    assert refused(tmp_path, ours, vae="pixels", prediction="x", sampler="euler", steps=2) == (
        f"--ckpt {ours}: --prediction x, but the file records a velocity-predicting network; drop --prediction")


@pytest.mark.parametrize("row,x_pred", [(PIXELGEN, True), (PIXNERD, False)])
def test_pixelgen_and_pixnerd_rows_state_their_prediction(tmp_path, pixel_file, row, x_pred):
    """The same network file, sampled by PixelGen's config (x) and PixNerd's (velocity), each unguided (cfg 1.0)."""
    net, ckpt = pixel_file
    got, y, record = run(tmp_path, ckpt, "pixel", protocol=row, steps=20)
    noise, _ = noise_of(5, 2, (3, 256, 256))
    same_pixels(got, nanogen_pixels(nanogen_release(net, noise, y, num_steps=20, scale=1.0, x_pred=x_pred)))
    assert record["fingerprint"]["prediction"]["kind"] == ("x" if x_pred else "v")
    assert record["protocol"]["overrides"] == ["steps 20"]


# ---- MeanFlow --------------------------------------------------------------------------------------------------------

def test_a_meanflow_file_samples_in_one_step(tmp_path, flat_vae):
    net = nanogen_net(5, meanflow=True)
    ckpt = release_file(tmp_path, MEANFLOW, net)
    _, info = dit.load_dit_weights(ckpt)
    assert (info["objective"], info["model_config"]["conditions"]) == ("meanflow", "meanflow")
    assert info["objective_from"].startswith("NanoGen's MeanFlow file (its t_abs_embedder")
    flow_row = f"nanogen/{N}-sdvae-mse-vpred-t4c8"
    assert "objective meanflow (the protocol's: flow)). Protocols that fit it: meanflow, " \
           f"nanogen/mf-{N}-sdvae-mse-vpred-t4c8-kappa0.0, {MEANFLOW};" in refused(tmp_path, ckpt, protocol=flow_row,
                                                                                  vae=str(flat_vae))
    got, y, record = run(tmp_path, ckpt, "mf", protocol=MEANFLOW, vae=str(flat_vae))
    # src/stage2/transport/sampler.py l.10-34 with num_steps 1: t = [1, 0] (shift sqrt(4096 / 4096) = 1),
    # x = x - h u(x, t); TransportMF.u_fn (transport.py l.167-169): model(x, h, t_abs=t) with h = 1, t = 1
    noise, _ = noise_of(5, 2, (4, 32, 32))
    with torch.no_grad():
        want = noise - 1.0 * net(noise, torch.ones(2, 2), y)  # our time input (t_abs, h) = (1, 1)
    same_pixels(got, nanogen_pixels(decode(load_vae(str(flat_vae))[0], want, scale=SD_SCALE)))
    assert (record["fingerprint"]["sampler"], record["fingerprint"]["steps"]) == ("meanflow", 1)


# ---- text-to-image at 512 px -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen32(tmp_path_factory):
    """A tiny random Qwen3 in float32 (its features reach the network unrounded, whatever the text path's dtype)."""
    from transformers import Qwen3ForCausalLM

    from tests.captions._tiny import make_tiny_qwen3

    folder = make_tiny_qwen3(tmp_path_factory.mktemp("qwen") / "qwen3")
    Qwen3ForCausalLM.from_pretrained(folder).float().save_pretrained(folder)
    return folder


def nanogen_t2i(net, noise, cond, null, *, steps, shift, scale=6.0):
    """src/stage2/transport/sampler.py l.10-34 (t = linspace(1, 0, num_steps + 1), s t / (1 + (s - 1) t), NanoGen's
    t = noise level; x = x - h drift), src/utils/guidance_utils.py l.14-39 forward_with_cfg against the empty prompt's
    features (src/eval/generation.py l.136-147; t_max 1.0: every step), velocity prediction: the network's output."""
    grid = torch.linspace(1.0, 0.0, steps + 1)
    grid = shift * grid / (1 + (shift - 1) * grid)
    x, n = noise.clone(), noise.shape[0]
    with torch.no_grad():
        for i in range(steps):
            h, tb = grid[i] - grid[i + 1], torch.full((n,), grid[i].item())
            c = net(x, tb, text=cond[0], text_mask=cond[1])
            u = net(x, tb, text=null[0].expand(n, -1, -1), text_mask=null[1].expand(n, -1))
            x = x - h * (u + scale * (c - u))
    return x


def test_the_512px_t2i_model(tmp_path, qwen32, monkeypatch):
    """NanoGen's 512 px T2I shape (encoder heads of 72, head heads of 128: en28d1584hd72-dn2d2048hd128; 16 x 64 x 64
    Qwen-Image latents in 2 x 2 patches: 1024 tokens; every prompt padded to 256 text tokens), its text encoder taken
    from the row (Qwen3-0.6B; here the tiny one under that preset's name)."""
    from dit_pipeline.common import text_encoders

    monkeypatch.setitem(text_encoders.PRESETS, "qwen3-0.6b", text_encoders.TextPreset(str(qwen32), 256, "tiny"))
    net = nanogen_net(7, channels=16, size=64, hidden_size=144, head_hidden_size=128, head_num_heads=1,
                      conditioning="text", text_dim=32, num_c_tokens=256)
    c = net.config
    assert (c["hidden_size"] // c["num_heads"], c["head_hidden_size"] // c["head_num_heads"]) == (72, 128)
    ckpt = release_file(tmp_path, T2I_512, net)
    assert ckpt.name == "t2i-ddt-en28d1584hd72-dn2d2048hd128-qwen-vae-vpred-t4-512res-v0.pt"
    prompts = dict(prompts=["a red bus", "two cats"], n=2, steps=3)
    assert "--protocol " + T2I_512 + " names its latent space, qwen-vae: QwenVAE (Qwen/Qwen-Image, subfolder vae), " \
           "which dit-sample does not load by that name: pass it as --vae" in refused(
               tmp_path, ckpt, protocol=T2I_512, prompts=prompts["prompts"], steps=3)
    vae16 = make_tiny_vae(tmp_path / "vae16", latent_channels=16, down_block_types=("DownEncoderBlock2D",),
                          up_block_types=("UpDecoderBlock2D",), block_out_channels=(8,))
    got, ids, record = run(tmp_path, ckpt, "t2i", protocol=T2I_512, vae=str(vae16), **prompts)
    encoder = text_encoders.load_text_encoder(str(qwen32))
    cond, null = encoder.encode(prompts["prompts"]).as_batch(), encoder.null().as_batch()
    noise, _ = noise_of(5, 2, (16, 64, 64))
    want = nanogen_t2i(net, noise, cond, null, steps=3, shift=math.sqrt(16 * 64 * 64 / 4096))
    same_pixels(got, nanogen_pixels(decode(load_vae(str(vae16))[0], want, scale=0.5)))
    assert record["settings_from"] == {"prediction": from_row(T2I_512, "transport.prediction"), "vae": "--vae",
                                       "text_encoder": from_row(T2I_512, "conditioning.text_encoder")}
    assert record["text_encoder"]["source"] == str(qwen32) and record["protocol"]["overrides"] == ["steps 3"]


# ---- REG -------------------------------------------------------------------------------------------------------------

def test_a_reg_file_samples_as_nanogen_evolving_its_class_token(tmp_path, flat_vae):
    """DiTwDDTHead(enable_reg=True) adds cls_in_proj_enc, cls_in_norm_enc, cls_in_proj_dec, cls_in_norm_dec and
    final_layer.cls_linear (src/stage2/models/DDT.py l.117-126): the file loads as a REG model (dit/incontext.py
    reg_dim) and its config's row samples it with the class token drawn after the image noise, evolved and guided
    beside the image (tests/dit/test_reg_nanogen.py transcribes that loop: sampler.py l.10-34, guidance_utils.py
    l.14-45, generation.py l.150-166)."""
    from dit_pipeline.dit.reg import initial_token
    from tests.dit.test_reg_nanogen import nanogen_sample

    row = f"nanogen/{N}-sdvae-ema-reg0.03-rmsnorm-vpred-t4c8-cfg2.2-t0.0-0.9"
    net = nanogen_net(9, reg_dim=12)
    ckpt = release_file(tmp_path, row, net)
    assert ckpt.name == f"{N}-sdvae-ema-reg0.03-rmsnorm-vpred-t4c8-v0.pt"
    sd, info = dit.load_dit_weights(ckpt)
    assert info["model_config"]["reg_dim"] == 12 and "cls_in_proj_enc.weight" in sd
    plain = own_checkpoint(tmp_path / "plain.pt", nanogen_net(1), objective="flow")
    assert "no REG's class token (model_config reg_dim) (the protocol's model has one)" in \
        refused(tmp_path, plain, protocol=row, vae=str(flat_vae))
    got, y, record = run(tmp_path, ckpt, "reg", protocol=row, vae=str(flat_vae))
    noise, gens = noise_of(5, 2, (4, 32, 32))
    with torch.no_grad():
        want = nanogen_sample(net, noise, initial_token(gens, 12, torch.device("cpu")), y, net.num_classes,
                              steps=50, shift=1.0, cfg_scale=2.2, cfg_interval=(0.0, 0.9))
    vae = load_vae(str(flat_vae))[0]
    same_pixels(got, nanogen_pixels(decode(vae, want, scale=SD_SCALE)))
    assert record["settings_from"]["prediction"] == from_row(row, "transport.prediction")
