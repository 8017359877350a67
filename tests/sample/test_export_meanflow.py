"""Issue 41 item 5: MeanFlow and iMF files exported `--to safetensors` read back with every record (objective, model
conditions, MeanFlow settings, latent, step) and sample identically to the checkpoint; `--to diffusers` refuses them
naming the sampler that samples them. The iMF release's own PyTorch file exports and samples too."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dit_pipeline import dit
from dit_pipeline.common.errors import UserError
from dit_pipeline.sample import ExportConfig, SampleConfig, export, run_sampling
from tests.sample.conftest import our_checkpoint

RECORDS = {"meanflow": {"mf_t_mean": -0.4, "mf_t_scale": 1.0, "mf_data_proportion": None, "mf_omega": 1.0,
                        "mf_kappa": 0.5, "mf_t_start": 0.0, "mf_t_end": 1.0, "mf_norm_p": 1.0, "mf_norm_eps": 0.01},
           "imf": {"mf_t_mean": -0.4, "mf_t_scale": 1.0, "mf_data_proportion": None, "mf_norm_p": 1.0,
                   "mf_norm_eps": 0.01, "mf_s_max": 7.0}}


def _model(objective: str, seed: int):
    torch.manual_seed(seed)
    if objective == "imf":
        m = dit.create_model("iMF-B/2", input_size=4, depth=2, head_depth=1, hidden_size=32, num_heads=2,
                             num_classes=10)
    else:
        m = dit.create_model("DiT-S/2", input_size=4, depth=2, hidden_size=32, num_heads=2, num_classes=10,
                             learn_sigma=False, conditions="meanflow")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name != "pos_embed":
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return m.eval()


@pytest.fixture(scope="module", params=["meanflow", "imf"])
def mf_file(request, tmp_path_factory):
    """(objective, our checkpoint of a tiny random model trained with it)."""
    objective = request.param
    ckpt = our_checkpoint(_model(objective, 1), _model(objective, 2), step=40)
    ckpt.update(objective=objective, meanflow=RECORDS[objective])
    path = tmp_path_factory.mktemp("mf-export") / f"{objective}.pt"
    torch.save(ckpt, path)
    return objective, path


def test_safetensors_export_keeps_every_record_and_samples_the_same(mf_file, tiny_vae_dir, tmp_path):
    objective, path = mf_file
    st = export(ExportConfig(to="safetensors", output=str(tmp_path / "w.safetensors"), ckpt=str(path)))
    sd, info = dit.load_dit_weights(st)
    _, orig = dit.load_dit_weights(path)
    assert info["objective"] == orig["objective"] == objective  # read back as ddpm before issue 41
    assert info["model_config"] == orig["model_config"] and info["meanflow"] == orig["meanflow"] == RECORDS[objective]
    assert info["model_config"]["conditions"] == ("imf" if objective == "imf" else "meanflow")
    assert info["step"] == 40 and all(torch.equal(sd[k], v) for k, v in _model(objective, 2).state_dict().items())
    guidance = dict(cfg_scale=4.0, guidance_interval=[0.2, 0.8]) if objective == "imf" else {}
    images = []
    for i, src in enumerate((path, st)):
        res = run_sampling(SampleConfig(ckpt=str(src), vae=str(tiny_vae_dir), class_labels=[0, 3], steps=2, seed=5,
                                        npz=str(tmp_path / f"{i}.npz"), quiet=True, **guidance))
        with np.load(res.npz) as z:
            images.append(z["arr_0"])
    assert np.array_equal(images[0], images[1]) and images[0].std() > 1


def test_the_diffusers_refusal_names_the_sampler_that_samples_it(mf_file, tmp_path):
    objective, path = mf_file
    with pytest.raises(UserError) as e:
        export(ExportConfig(to="diffusers", output=str(tmp_path / "pipe"), ckpt=str(path)))
    msg = str(e.value)
    assert msg.startswith(f"--to diffusers: this is a {objective} model (a one-step average-velocity model")
    assert msg.endswith("Export it with --to safetensors and sample with dit-sample --sampler meanflow")
    assert "euler" not in msg and not (tmp_path / "pipe").exists()


def test_the_imf_release_file_exports_and_samples_as_it_loads(tiny_vae_dir, tmp_path):
    """The iMF release's PyTorch layout (tests/dit/_imf_reference.py) -> safetensors -> the same samples."""
    from tests.dit import _imf_reference as R

    tree = R.random_tree(np.random.default_rng(0), hidden=32, heads=2, patch=2, channels=4, num_classes=10, shared=1,
                         head_depth=1, v_heads=False)
    pth = tmp_path / "iMF-tiny.pth"
    torch.save(R.torch_branch_state_dict(tree), pth)
    st = export(ExportConfig(to="safetensors", output=str(tmp_path / "r.safetensors"), ckpt=str(pth), input_size=4))
    _, info = dit.load_dit_weights(st)
    assert (info["objective"], info["model_config"]["family"], info["model_config"]["v_head"]) == ("imf", "iMF", False)
    images = []
    for i, (src, size) in enumerate(((pth, 4), (st, None))):
        res = run_sampling(SampleConfig(ckpt=str(src), vae=str(tiny_vae_dir), class_labels=[1], steps=1, seed=2,
                                        cfg_scale=3.0, input_size=size, npz=str(tmp_path / f"r{i}.npz"), quiet=True))
        with np.load(res.npz) as z:
            images.append(z["arr_0"])
    assert np.array_equal(images[0], images[1])
