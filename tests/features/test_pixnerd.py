"""NanoGen's PixNerd configs (issue 44 item 4; End2End-Diffusion/diffusion-bench
configs/stage2/training/imagenet/pixnerd-ddt-en28d1152hd72-dn2d2048hd128-vpred-t4c8.yaml and its t2i twin) name no
network of their own: `stage_2.target: stage2.models.DDT.DiTwDDTHead` (line 8), the in-context DiT-DH this project
builds (dit/incontext.py), with `patch_size: [16, 16]` on `stage1.pixel.PixelEncoder` pixels (3 x 256 x 256),
`prediction: 'velocity'` (NanoGen's clamped target) and `time_dist_type: 'logit-normal_-1.94_1.0'`; its sampling
configs sample unshifted (time_dist_shift_base_eval 196608) with guidance 2.4 on [0, 0.9]. Here: a NanoGen file in
that pixel layout loads unchanged and gives NanoGen's outputs (the network transcribed in tests/dit/test_incontext.py),
and dit-extract --encoder pixels -> dit-train with the config's settings -> dit-sample run through the CLIs."""
from __future__ import annotations

import numpy as np
import torch

from dit_pipeline import dit
from dit_pipeline.extract import ExtractConfig, run_extract
from dit_pipeline.train.checkpoint import CheckpointManager, load_checkpoint
from dit_pipeline.train.metrics import read_metrics
from tests._util import assert_close_at_scale
from tests.dit.test_incontext import _nanogen_file, _random_model, nanogen_forward
from tests.train.conftest import invoke_train

FP32_EPS = 2.0 ** -23


def test_a_nanogen_pixnerd_file_loads_unchanged_and_gives_nanogens_outputs(tmp_path):
    model = _random_model(11, in_channels=3, input_size=32, patch_size=8)  # 16 tokens of 8 x 8 x 3 pixels
    sd, info = dit.load_dit_weights(_nanogen_file(model, tmp_path)[0])
    ours = dit.build_model_from_weights(sd, info).eval()
    c = info["model_config"]
    assert (info["family"], info["release"], c["in_channels"], c["input_size"], c["patch_size"]) == \
        ("DiT-DH-IC", "NanoGen", 3, 32, 8)
    assert info["flow_convention"] == "repa" and info.get("prediction") is None  # NanoGen's velocity, as recorded
    g = torch.Generator().manual_seed(12)
    x, t, y = torch.randn(3, 3, 32, 32, generator=g), torch.rand(3, generator=g), torch.tensor([0, 4, 5])
    want = nanogen_forward(ours.state_dict(), x, t, label=y, patch=8, enc_heads=2, dec_heads=4, depth=2, head_depth=1)
    with torch.no_grad():
        got = ours(x, t, y)
    assert want.abs().max() > 1.0
    assert_close_at_scale(got, want, rel=64 * FP32_EPS)


def test_pixnerds_settings_train_and_sample_through_the_clis(tree, tmp_path):
    pixels = tmp_path / "pixels"
    run_extract(ExtractConfig(data_path=str(tree), out=str(pixels), encoder="pixels", image_size=32,
                              samples_per_shard=3, num_workers=0, quiet=True))
    run = tmp_path / "run"
    args = {"shards": pixels, "run-dir": run, "model": "ddt-en28d1152hd72-dn2d2048hd128", "depth": 2,
            "hidden-size": 32, "num-heads": 2, "head-depth": 1, "head-hidden-size": 32, "head-num-heads": 2,
            "patch-size": 8, "objective": "flow", "v-target": "clamped", "t-sampling": "logit-normal",
            "t-mean": 1.94, "t-scale": 1.0, "time-shift": "auto", "global-batch-size": 4, "micro-batch-size": 2,
            "num-workers": 0, "max-steps": 2, "ckpt-every": 2, "log-every": 1, "quiet": None}
    r = invoke_train([a for k, v in args.items() for a in ([f"--{k}"] if v is None else [f"--{k}", str(v)])])
    assert r.exit_code == 0, r.output
    ckpt = load_checkpoint(CheckpointManager(run / "checkpoints").latest())
    assert ckpt["prediction"] == {"kind": "v", "t_eps": 0.05} and ckpt["time_shift"] == (3 * 32 * 32 / 4096) ** 0.5
    assert ckpt["model_config"]["patch_size"] == 8 and [r["step"] for r in read_metrics(run)] == [1, 2]

    from dit_pipeline.sample import SampleConfig
    from dit_pipeline.sample.generate import initial_noise
    from dit_pipeline.sample.load import load_model
    from dit_pipeline.sample.plan import noise_generators
    from dit_pipeline.sample.run import run_sampling

    # 2 steps leave the zero-initialised output layers near zero: sample the EMA weights perturbed
    ema = tmp_path / "ema.pt"
    raw = torch.load(run / "checkpoints" / "step-0000002-ema.pt", weights_only=True)
    g = torch.Generator().manual_seed(0)
    torch.save({k: v if "rope" in k else v + 0.3 * torch.randn(v.shape, generator=g) for k, v in raw.items()}, ema)
    ema.with_suffix(".json").write_text((run / "checkpoints" / "step-0000002-ema.json").read_text())
    npz = tmp_path / "pixnerd.npz"  # NanoGen's pixel grid (unshifted), PixNerd's guidance 2.4 in [0, 0.9]
    run_sampling(SampleConfig(ckpt=str(ema), protocol="nanogen-pixels", cfg_scale=2.4, class_labels=[0, 1],
                              npz=str(npz), quiet=True))
    got = np.load(npz)["arr_0"]

    model = load_model(ema).model.eval()  # ours: SiT's time; NanoGen's network is it in NanoGen's time

    def nanogen_net(x, t, y):
        return -model(x, 1 - t, y)

    with torch.no_grad():  # sampler.py 10-34 on the grid linspace(1, 0, 51), unshifted; guidance_utils.py 14-39
        z = initial_noise(noise_generators(0, [0, 1]), (3, 32, 32), torch.device("cpu"))
        y, null = torch.tensor([0, 1]), torch.full((2,), 2)
        grid = torch.linspace(1.0, 0.0, 51)
        for i in range(50):
            tb = torch.full((2,), grid[i].item())
            cond, uncond = nanogen_net(z, tb, y), nanogen_net(z, tb, null)
            v = uncond + 2.4 * (cond - uncond) if grid[i] <= 0.9 else cond
            z = z - (grid[i] - grid[i + 1]) * v
        want = ((z + 1.0) / 2.0).clamp(0, 1).mul(255).permute(0, 2, 3, 1).to(torch.uint8).numpy()  # generation.py 167-168
    diff = np.abs(got.astype(int) - want.astype(int))
    assert got.shape == (2, 32, 32, 3) and diff.max() <= 1 and diff.mean() < 0.01
    assert want.std() > 10  # images, not a constant
