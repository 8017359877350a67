"""`dit-sample --protocol NAME` and the model must fit (issue 44, item 7): each protocol row states what it applies to
(dit/protocol_fit.py) and a model it does not fit is refused before any sampling, naming the rows that fit, where it
used to run without a word (NanoGen's latent T2I grid on a pixel text model, a text protocol on a class model, a pixel
protocol on a latent model, DiT's on a PixArt text model, iMF's on a MeanFlow model). RAE's row guides as RAE's
`method: cfg` does when given --cfg-scale; --time-shift replaces a protocol's shift (recorded); NanoGen's per-config
rows run on a model of their latent shape, and the rows needing REG are refused naming it. Every sampler here is
compared with the release's loop written out (file and line)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from dit_pipeline.common.errors import ConfigError, UserError
from dit_pipeline.common.pixels import pixel_identity
from dit_pipeline.dit.family import create_model
from dit_pipeline.sample import SampleConfig, run_sampling
from tests.sample.conftest import random_dit
from tests.sample.test_protocols_sample import (decode, nanogen_pixels, nanogen_release, noise_of, own_checkpoint,
                                                rae_decoder, rae_pixels, same_pixels, sd_vae, tiny)

__all__ = ["rae_decoder", "sd_vae"]  # the fixtures, used here
TEXT_DIM = 32  # the tiny Qwen3's width
PIXELS = {"scaling_factor": 1.0, "shift_factor": None, "vae": pixel_identity(8)}
NANOGEN_SDVAE = "nanogen/ddt-en28d1152hd72-dn2d2048hd128-sdvae-ema-vpred-t4c8"


def in_context(seed, *, channels=4, size=8, std=0.05, **over):
    """A tiny NanoGen in-context DiT-DH with every tensor perturbed."""
    torch.manual_seed(seed)
    net = create_model("ddt-en28d1152hd72-dn2d2048hd128", input_size=size, in_channels=channels, depth=1,
                       hidden_size=32, num_heads=2, head_depth=1, head_hidden_size=32, head_num_heads=2,
                       num_classes=5, **over)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(std * torch.randn(p.shape, generator=g))
    return net.eval()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from dit_pipeline.common.text_encoders import load_text_encoder
    from tests.captions._tiny import make_tiny_qwen3

    folder = make_tiny_qwen3(tmp_path_factory.mktemp("qwen") / "qwen3")
    return folder, load_text_encoder(str(folder), max_length=16)


def text_checkpoint(path, model, encoder, *, objective="flow", latent=None):
    """Our checkpoint of a text model, with its text encoder's record (sample/prompts.py rebuilds it)."""
    ckpt = {"format": "dit-pipeline.checkpoint", "version": 1, "model_config": model.config, "ema": model.state_dict(),
            "objective": objective, "latent": dict(latent or {"scaling_factor": 0.5, "shift_factor": None}),
            "text": {"encoder": encoder.identity, "features": "cached", "null_text": torch.zeros(0, TEXT_DIM),
                     "null_mask": torch.zeros(0, dtype=torch.bool)}}
    torch.save(ckpt, path)
    return path


def run(tmp_path, ckpt, vae, name, **kw):
    """dit-sample (in-process) -> (uint8 images, the record)."""
    npz = tmp_path / f"{name}.npz"
    run_sampling(SampleConfig(ckpt=str(ckpt), vae=str(vae), npz=str(npz), quiet=True, batch_size=4, seed=5, **kw))
    with np.load(npz) as z:
        return z["arr_0"].astype(int), json.loads((tmp_path / f"{name}.npz.json").read_text())


def refused(tmp_path, ckpt, vae, protocol, **kw) -> str:
    """The UserError of dit-sample --protocol on this model; nothing written."""
    npz = tmp_path / "refused.npz"
    kw = {"num_samples": 2, **kw}
    with pytest.raises(UserError) as e:
        run_sampling(SampleConfig(ckpt=str(ckpt), vae=str(vae), protocol=protocol, npz=str(npz), quiet=True, **kw))
    assert not npz.exists() and not (tmp_path / "refused.npz.json").exists()
    return str(e.value)


def nanogen_t2i_release(net, noise, cond, null, *, steps, shift, scale=6.0):
    """End2End-Diffusion/diffusion-bench src/stage2/transport/sampler.py l.10-34 (t = linspace(1, 0, num_steps + 1),
    then s t / (1 + (s - 1) t), NanoGen's t = noise level, x = x - h drift), src/eval/generation.py l.136-147 and
    src/utils/guidance_utils.py l.14-39 (against the empty prompt's features at every step, t_max 1.0), on our network
    called in SiT's time (t = 1 - NanoGen's t, the velocity negated)."""
    grid = torch.linspace(1.0, 0.0, steps + 1)
    grid = shift * grid / (1 + (shift - 1) * grid)
    x, n = noise.clone(), noise.shape[0]
    with torch.no_grad():
        for i in range(steps):
            h, tb = grid[i] - grid[i + 1], torch.full((n,), grid[i].item())
            c = -net(x, 1 - tb, text=cond[0], text_mask=cond[1])
            u = -net(x, 1 - tb, text=null[0].expand(n, -1, -1), text_mask=null[1].expand(n, -1))
            x = x - h * (u + scale * (c - u))
    return x


def test_nanogens_t2i_grid_on_a_pixel_text_model(tmp_path, qwen):
    """--protocol nanogen-t2i shifted a pixel model's grid by sqrt(3 x 8 x 8 / 4096) where NanoGen's pixel T2I configs
    (JiT, PixelGen) are unshifted, and --time-shift 1 was refused: now the protocol is refused naming
    nanogen-t2i-pixels, which samples NanoGen's unshifted loop, and --time-shift S replaces the shift, recorded."""
    folder, encoder = qwen
    net = in_context(21, channels=3, conditioning="text", text_dim=TEXT_DIM, num_c_tokens=16)
    ckpt = text_checkpoint(tmp_path / "t2i-pixels.pt", net, encoder, latent=PIXELS)
    prompts = dict(prompts=["a red sofa", "two dogs"], num_samples=2, steps=3)
    msg = refused(tmp_path, ckpt, "pixels", "nanogen-t2i", **prompts)
    assert msg.startswith("--protocol nanogen-t2i applies to text-conditional flow models on latents; this is a "
                          "text-conditional flow model on 3x8x8 pixels (space pixels (the protocol's: latent)). "
                          "Protocols that fit it: nanogen-t2i-pixels; or drop --protocol")
    cond, null = encoder.encode(prompts["prompts"]).as_batch(), encoder.null().as_batch()
    noise, _ = noise_of(5, 2, (3, 8, 8))
    for shift in (None, 2.0):
        got, record = run(tmp_path, ckpt, "pixels", f"shift-{shift}", protocol="nanogen-t2i-pixels",
                          time_shift=shift, **prompts)
        want = nanogen_t2i_release(net, noise, cond, null, steps=3, shift=shift or 1.0)
        same_pixels(got, nanogen_pixels(want))  # the identity decoder: NanoGen's conversion of the samples
        assert record["protocol"]["grid"]["resolved_shift"] == (shift or 1.0)
        assert record["protocol"]["overrides"] == ["steps 3"] + ([f"shift {shift:g}"] if shift else [])
        assert record["fingerprint"].get("time_shift") == shift


def test_protocols_refuse_models_they_do_not_fit(tmp_path, tiny_vae_dir, qwen):
    _, encoder = qwen
    flow = own_checkpoint(tmp_path / "flow.pt", random_dit(31, learn_sigma=False))
    msg = refused(tmp_path, flow, tiny_vae_dir, "nanogen-t2i")
    assert "this is a class-conditional flow model on 4x4x4 latents (conditioning class (the protocol's: text)). " \
           "Protocols that fit it: sit, repa, lightningdit, ddt, rae, rae-ag, nanogen; or drop --protocol" in msg
    msg = refused(tmp_path, flow, tiny_vae_dir, "nanogen-pixels")
    assert msg.startswith("--protocol nanogen-pixels applies to class-conditional flow models on pixels; this is a "
                          "class-conditional flow model on 4x4x4 latents (space latent (the protocol's: pixels))")
    # DiT's protocol on a PixArt text model: it recorded uniform labels and ImageNet's FID 2.27 for its samples
    pixart = create_model("PixArt-XL/2", input_size=4, depth=2, hidden_size=32, num_heads=4, conditioning="text",
                          text_dim=TEXT_DIM)
    pixart_ckpt = text_checkpoint(tmp_path / "pixart.pt", pixart, encoder, objective="ddpm")
    msg = refused(tmp_path, pixart_ckpt, tiny_vae_dir, "dit", prompts=["a bus"], num_samples=1, steps=2)
    assert msg.startswith("--protocol dit applies to class-conditional ddpm models on latents; this is a "
                          "text-conditional ddpm model on 4x4x4 latents (conditioning text (the protocol's: class)). "
                          "No protocol fits it; or drop --protocol and choose the sampler with dit-sample's flags")
    meanflow = random_dit(32, learn_sigma=False, conditions="meanflow")
    mf = own_checkpoint(tmp_path / "mf.pt", meanflow, objective="meanflow")
    msg = refused(tmp_path, mf, tiny_vae_dir, "imf")
    assert "(objective meanflow (the protocol's: imf or imf-adaln)). Protocols that fit it: meanflow;" in msg
    msg = refused(tmp_path, flow, tiny_vae_dir, NANOGEN_SDVAE + "-cfg1.6-t0.0-0.9")
    assert "(latent shape 4x4x4 (the protocol's: 4x32x32))" in msg  # NanoGen's tuned scale is its latents'


def test_rows_needing_reg_refuse_a_model_without_its_token(tmp_path, tiny_vae_dir):
    reg = "nanogen/ddt-en28d1152hd72-dn2d2048hd128-sdvae-ema-reg0.03-rmsnorm-vpred-t4c8-cfg2.2-t0.0-0.9"
    flow = own_checkpoint(tmp_path / "flow.pt", random_dit(31, learn_sigma=False))
    msg = refused(tmp_path, flow, tiny_vae_dir, reg)
    assert "no REG's class token (model_config reg_dim) (the protocol's model has one)" in msg


def rae_cfg_release(net, noise, y, *, scale, num_steps=50):
    """bytetriper/RAE src/sample_ddp.py l.246-274 with configs/stage2/sampling/ImageNet256/DiTDHXL-DINOv2-B.yaml's
    `method: cfg` (t-min 0.0, t-max 1.0) at a scale > 1: the doubled [z; z] with [y; null] at every step through
    src/stage2/models/DDT.py l.364-389 forward_with_cfg (every channel, where t_min <= t <= t_max, RAE's t = noise
    level); the grid of transport.py l.136-137 and integrators.py l.100-101 shifted by sqrt(C H W / 4096); the first
    half kept."""
    c, h, w = noise.shape[1:]
    s = math.sqrt(c * h * w / 4096)
    t = 1 - torch.linspace(0, 1 - 1 / 1000, num_steps)
    t = s * t / (1 + (s - 1) * t)
    n = noise.shape[0]
    x, labels = torch.cat([noise, noise]), torch.cat([y, torch.full_like(y, net.num_classes)])
    with torch.no_grad():
        for t0, t1 in zip(t[:-1].tolist(), t[1:].tolist()):
            half = x[:n]
            out = net(torch.cat([half, half]), torch.full((2 * n,), t0), labels)[:, :c]
            cond, uncond = out[:n], out[n:]
            guided = uncond + scale * (cond - uncond) if 0.0 <= t0 <= 1.0 else cond
            x = x + (t1 - t0) * torch.cat([guided, guided])
    return x[:n]


def test_raes_protocol_takes_a_cfg_scale(tmp_path, rae_decoder):
    """RAE's config samples with `method: cfg` (scale 1.0); --protocol rae refused --cfg-scale, so no command sampled
    RAE's grid with guidance. Now --cfg-scale 1.5 guides as RAE's forward_with_cfg does."""
    path, decoder = rae_decoder
    net = tiny("DiT-DH", seed=6)
    ckpt = own_checkpoint(tmp_path / "rae.pt", net, convention="repa", latent={"scaling_factor": 1.0,
                                                                                "shift_factor": None})
    got, record = run(tmp_path, ckpt, f"{path},{path.parent / 'config.json'}", "rae-cfg", protocol="rae",
                      cfg_scale=1.5, num_samples=2)
    y = torch.as_tensor(record["labels"])
    noise, _ = noise_of(5, 2, (8, 4, 4))
    want = rae_cfg_release(net, noise, y, scale=1.5)
    same_pixels(got, rae_pixels(decoder, want))
    assert record["protocol"]["guidance"]["rule"] == "cfg" and record["protocol"]["overrides"] == ["scale 1.5"]


def test_nanogens_per_config_rows_run_on_their_latents(tmp_path, tiny_vae_dir, sd_vae):
    """nanogen/<config> on a model of the config's latent shape (SD-VAE's 4x32x32): the tuned row samples NanoGen's
    loop (cfg 1.6 on noise levels [0, 0.9], 50 steps, s = sqrt(4096 / 4096)); the MeanFlow row takes one step, its
    guidance trained in, as the `meanflow` protocol's one step (the same latents, NanoGen's image conversion)."""
    net = in_context(41, size=32)
    ckpt = own_checkpoint(tmp_path / "ng.pt", net, convention="repa")
    got, record = run(tmp_path, ckpt, tiny_vae_dir, "tuned", protocol=NANOGEN_SDVAE + "-cfg1.6-t0.0-0.9",
                      num_samples=2)
    noise, _ = noise_of(5, 2, (4, 32, 32))
    want = nanogen_release(net, noise, torch.as_tensor(record["labels"]), scale=1.6, shift=1.0)
    same_pixels(got, nanogen_pixels(decode(sd_vae, want)))
    assert record["protocol"]["sources"][0] == \
        "configs/stage2/sampling/imagenet/ddt-en28d1152hd72-dn2d2048hd128-sdvae-ema-vpred-t4c8-cfg1.6-t0.0-0.9.yaml"
    mf = own_checkpoint(tmp_path / "mf.pt", in_context(42, size=32, conditions="meanflow"), objective="meanflow")
    got, record = run(tmp_path, mf, tiny_vae_dir, "mf", protocol="nanogen/mf-ddt-en28d1152hd72-dn2d2048hd128-"
                      "sdvae-mse-vpred-t4c8-kappa0.5", num_samples=2)
    plain, plain_record = run(tmp_path, mf, tiny_vae_dir, "meanflow", protocol="meanflow", labels="equal",
                              num_samples=2)
    assert record["fingerprint"]["steps"] == 1 and record["fingerprint"]["cfg_scale"] == 1.0
    assert np.abs(got - plain).max() <= 1 and record["labels"] == plain_record["labels"]
