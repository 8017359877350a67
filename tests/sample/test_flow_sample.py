"""Flow models in dit-sample and export: SiT's release and training-checkpoint formats load unchanged with the
objective inferred, the samplers equal an independent integration of the network, per-sample noise makes
samples batch-independent, outputs record objective and sampler, and export refuses what diffusers cannot run."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from dit_pipeline import dit
from dit_pipeline.common.errors import UserError
from dit_pipeline.sample import SampleConfig, run_sampling
from dit_pipeline.sample.config import ExportConfig
from dit_pipeline.sample.export import export
from dit_pipeline.sample.generate import guided_model_fn, make_diffusion, sample_latents
from dit_pipeline.sample.plan import noise_generators
from tests.sample.conftest import LATENT, our_checkpoint, random_dit


@pytest.fixture(scope="module")
def sit_files(tmp_path_factory):
    """SiT's formats, built to the documented layout with random weights: the release file (a bare
    state_dict of DiT's architecture with learn_sigma=True, as SiT-XL-2-256x256.pt; here preset DiT-S/8 on
    8x8 latents in bfloat16 to stay small) and a SiT train.py checkpoint ({model, ema, opt, args} with
    args.model = "SiT-S/8" and learn_sigma=False), plus our own flow checkpoint."""
    root = tmp_path_factory.mktemp("sit")
    release = random_dit(11, name="DiT-S/8", input_size=8, std=0.05, tiny=False, learn_sigma=True)
    trained = random_dit(12, name="DiT-S/8", input_size=8, std=0.05, tiny=False, learn_sigma=False)
    ours = random_dit(13, learn_sigma=False)
    files = {"release": root / "SiT-S-8-64x64.pt", "train": root / "0400000.pt", "ours": root / "flow.pt",
             "plain_named": root / "release-copy.pt"}
    sd = {k: v.to(torch.bfloat16) for k, v in release.state_dict().items()}
    torch.save(sd, files["release"])
    torch.save(sd, files["plain_named"])
    args = argparse.Namespace(model="SiT-S/8", image_size=64, num_classes=10, path_type="Linear",
                              prediction="velocity")
    tsd = {k: v.to(torch.bfloat16) for k, v in trained.state_dict().items()}
    torch.save({"model": tsd, "ema": tsd, "opt": {}, "args": args}, files["train"])
    torch.save({**our_checkpoint(ours, ours), "objective": "flow"}, files["ours"])
    return files


def independent_heun(model: dit.DiT, noise: torch.Tensor, y: torch.Tensor, steps: int) -> torch.Tensor:
    """Heun from t = 0 (noise) to 1 (data), calling the network with t itself; velocity = first C channels."""
    c = noise.shape[1]
    x, h = noise.double(), 1.0 / steps

    def v(x, t):
        out = model(x.float(), torch.full((x.shape[0],), t), y)
        return out[:, :c].double()

    for i in range(steps):
        t = i * h
        d1 = v(x, t)
        d2 = v(x + h * d1, t + h)
        x = x + h / 2 * (d1 + d2)
    return x.float()


def test_sit_release_file_loads_unchanged_and_heun_matches_an_independent_loop(sit_files):
    sd, info = dit.load_dit_weights(sit_files["release"])
    assert info["source"] == "official" and info["model_config"]["learn_sigma"] is True
    assert info["model_config"]["model"] == "DiT-S/8" and "objective" not in info
    from dit_pipeline.sample.load import resolve_objective

    assert resolve_objective(info, sit_files["release"], None) == "flow"  # SiT-* name
    with pytest.raises(UserError, match="no record of how it was trained"):  # no record, no name: never a guess
        resolve_objective(info, sit_files["plain_named"], None)
    assert resolve_objective(info, sit_files["plain_named"], "flow") == "flow"
    model = dit.build_model_from_weights(sd, info)
    y = torch.tensor([1, 7])
    gens = noise_generators(5, [0, 1])
    fn = guided_model_fn(model, cfg_scale=1.0)
    got = sample_latents(model, make_diffusion("heun", 6), y, gens, sampler="heun", model_fn=fn)
    noise = torch.stack([torch.randn(4, 8, 8, generator=g) for g in noise_generators(5, [0, 1])])
    want = independent_heun(model, noise, y, 6)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_sit_training_checkpoint_is_a_flow_model(sit_files):
    sd, info = dit.load_dit_weights(sit_files["train"])
    assert info["objective"] == "flow" and info["model_config"]["learn_sigma"] is False
    assert info["model_config"]["model"] == "DiT-S/8" and info["model_config"]["num_heads"] == 6
    assert dit.canonical_model_name("SiT-XL/2") == "DiT-XL/2"


def test_flow_run_records_objective_and_sampler_and_is_batch_invariant(sit_files, tiny_vae_dir, tmp_path):
    base = dict(ckpt=str(sit_files["ours"]), vae=str(tiny_vae_dir), steps=4, quiet=True, class_labels=[3, 1, 4, 1],
                sampler="euler-maruyama", diffusion_form="SBDM", cfg_scale=2.0)
    run_sampling(SampleConfig(**base, batch_size=4, npz=str(tmp_path / "a.npz"), out=str(tmp_path / "out")))
    run_sampling(SampleConfig(**base, batch_size=1, npz=str(tmp_path / "b.npz")))
    with np.load(tmp_path / "a.npz") as a, np.load(tmp_path / "b.npz") as b:
        # per-sample generators: the same pixels whatever the batch (uint8 after decoding; float kernels may
        # differ in the last bit between batch shapes, which rounding almost always absorbs)
        assert np.abs(a["arr_0"].astype(int) - b["arr_0"].astype(int)).max() <= 1
        assert len({a["arr_0"][i].tobytes() for i in range(4)}) == 3 + (a["arr_0"][1] != a["arr_0"][3]).any()
    fp = json.loads((tmp_path / "out" / "samples.json").read_text())["fingerprint"]
    assert (fp["objective"], fp["sampler"], fp["diffusion_form"], fp["last_step_size"]) == \
        ("flow", "euler-maruyama", "SBDM", 0.04)
    npz_record = json.loads((tmp_path / "a.npz.json").read_text())["fingerprint"]
    assert npz_record["objective"] == "flow"


def test_sampler_must_fit_the_objective(sit_files, tiny_vae_dir, tmp_path, ckpts):
    base = dict(vae=str(tiny_vae_dir), steps=2, quiet=True, class_labels=[1], npz=str(tmp_path / "x.npz"))
    with pytest.raises(UserError, match=r"--sampler ddpm: .*flow.pt is a flow model; pass --sampler euler or heun "
                                        r"or euler-maruyama"):
        run_sampling(SampleConfig(ckpt=str(sit_files["ours"]), sampler="ddpm", **base))
    with pytest.raises(UserError, match=r"--sampler heun: .*ours.pt is a ddpm model; pass --sampler ddpm or ddim"):
        run_sampling(SampleConfig(ckpt=str(ckpts["ours"]), sampler="heun", **base))
    with pytest.raises(UserError, match=r"--objective ddpm, but .*flow.pt records a flow model; drop --objective"):
        run_sampling(SampleConfig(ckpt=str(sit_files["ours"]), sampler="ddim", objective="ddpm", **base))
    assert not (tmp_path / "x.npz").exists()


def test_without_sampler_a_flow_checkpoint_samples_with_sits_sde(sit_files, ckpts, tiny_vae_dir, tmp_path):
    """--sampler defaults from the objective the checkpoint records (flow: SiT's Euler-Maruyama SDE, ddpm: DDPM),
    as if given: the same record and pixels as the explicit flag, said in the log."""
    from dit_pipeline.sample.config import DEFAULT_SAMPLERS

    assert DEFAULT_SAMPLERS == {"ddpm": "ddpm", "flow": "euler-maruyama", "meanflow": "meanflow", "imf": "meanflow",
                                "imf-adaln": "meanflow"}
    for name, sampler in (("ours", "euler-maruyama"), ("release", "euler-maruyama")):
        files = {"ours": sit_files["ours"], "release": sit_files["release"]}
        base = dict(ckpt=str(files[name]), vae=str(tiny_vae_dir), steps=3, class_labels=[1, 2], quiet=True)
        run_sampling(SampleConfig(**base, out=str(tmp_path / f"{name}-default")))
        run_sampling(SampleConfig(**base, sampler=sampler, out=str(tmp_path / f"{name}-given")))
        records = [json.loads((tmp_path / f"{name}-{k}" / "samples.json").read_text()) for k in ("default", "given")]
        assert records[0]["fingerprint"] == records[1]["fingerprint"]
        assert records[0]["fingerprint"]["sampler"] == sampler and records[0]["config"]["sampler"] == sampler
        log = (tmp_path / f"{name}-default" / "logs" / "rank0.log").read_text()
        assert f"--sampler not given: {sampler}, the default for flow models (3 steps)" in log
    run_sampling(SampleConfig(ckpt=str(ckpts["ours"]), vae=str(tiny_vae_dir), steps=3, class_labels=[1], quiet=True,
                              out=str(tmp_path / "ddpm")))
    assert json.loads((tmp_path / "ddpm" / "samples.json").read_text())["fingerprint"]["sampler"] == "ddpm"


def test_export_of_a_flow_model(sit_files, tiny_vae_dir, tmp_path):
    with pytest.raises(UserError, match="--to diffusers: this is a flow model .* Export it with --to safetensors"):
        export(ExportConfig(to="diffusers", output=str(tmp_path / "pipe"), ckpt=str(sit_files["ours"]),
                            vae=str(tiny_vae_dir)))
    assert not (tmp_path / "pipe").exists()
    out = export(ExportConfig(to="safetensors", output=str(tmp_path / "f.safetensors"), ckpt=str(sit_files["ours"])))
    _, info = dit.load_dit_weights(out)
    assert info["objective"] == "flow"
    out = export(ExportConfig(to="safetensors", output=str(tmp_path / "s.safetensors"), ckpt=str(sit_files["release"])))
    assert dit.load_dit_weights(out)[1]["objective"] == "flow"  # the SiT-* guess is written down


def test_export_refuses_block_options_for_diffusers(tiny_vae_dir, tmp_path):
    model = random_dit(3, qk_norm=True)
    torch.save(our_checkpoint(model, model, latent=LATENT), tmp_path / "qk.pt")
    with pytest.raises(UserError, match="--to diffusers: diffusers' DiT blocks have no qk_norm"):
        export(ExportConfig(to="diffusers", output=str(tmp_path / "pipe"), ckpt=str(tmp_path / "qk.pt"),
                            vae=str(tiny_vae_dir)))


def test_old_checkpoints_without_the_key_are_ddpm(ckpts):
    assert dit.load_dit_weights(ckpts["ours"])[1]["objective"] == "ddpm"
