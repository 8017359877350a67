"""`dit-train --init WEIGHTS` (issue #34): a new run from pretrained weights, the position table computed for
the new input size, the label table fresh for a new class count, anything else that differs refused; the
path recorded in config.json; `--resume FILE` of a weights file names --init."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from dit_pipeline import dit
from dit_pipeline.cli import train_main
from dit_pipeline.common.errors import UserError
from dit_pipeline.dit.embed import pos_embed_2d
from dit_pipeline.train.init import apply_init, load_init
from tests.train.conftest import shard_dir, tiny_args  # noqa: F401 (fixture)

TINY = {"depth": 2, "hidden_size": 32, "num_heads": 2}


def _weights(input_size: int, num_classes: int = 2, seed: int = 0, **kw) -> dit.DiT:
    model = dit.create_model("DiT-S/2", input_size=input_size, num_classes=num_classes, **{**TINY, **kw})
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "pos_embed":
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """An official-style release file (a bare state_dict) of a 4x4-latent, 2-class tiny DiT."""
    path = tmp_path_factory.mktemp("init") / "DiT-tiny-4.pt"
    torch.save(_weights(4).state_dict(), path)
    return path


def test_a_new_input_size_gets_its_own_position_table_and_every_other_tensor(release):
    kw = {"name": "DiT-S/2", "input_size": 8, "num_classes": 2, **TINY}
    init = load_init(str(release), kw)
    model = dit.create_model(**kw)
    apply_init(model, init)
    old = torch.load(release, weights_only=True)
    sd = model.state_dict()
    assert set(init.state_dict) == set(sd) - {"pos_embed"}
    assert all(torch.equal(sd[k], old[k]) for k in init.state_dict)
    assert sd["pos_embed"].shape == (1, 16, 32)  # 8x8 latents / patch 2, where the file has 4 tokens
    torch.testing.assert_close(sd["pos_embed"][0], torch.from_numpy(pos_embed_2d(32, 4)).float())
    assert "pos_embed (fixed sin-cos/RoPE tables, computed for 8x8 latents)" in init.describe()
    # a new class set: the label table stays the new model's own
    init10 = load_init(str(release), {**kw, "num_classes": 10})
    assert "y_embedder.embedding_table.weight" not in init10.state_dict
    assert "label table (11 rows where the file has 3: a new class set, initialised fresh)" in init10.describe()


def test_another_architecture_is_refused_naming_what_differs(release, tmp_path):
    with pytest.raises(UserError) as e:
        load_init(str(release), {"name": "DiT-S/2", "input_size": 8, "num_classes": 2, **{**TINY, "depth": 3}})
    assert str(e.value).startswith(f"--init {release} (custom: depth 2, hidden 32, patch 2, 4 channels) does not "
                                   "fit this run's custom model: missing blocks.2.")
    assert str(e.value).endswith("Only the input size (the position table) and the class count (the label table) "
                                 "may differ")
    with pytest.raises(UserError, match=r"^--init: weight file .*nope.pt"):
        load_init(str(tmp_path / "nope.pt"), {"name": "DiT-S/2", "input_size": 8, "num_classes": 2, **TINY})


def test_dit_train_init_starts_from_the_weights_and_records_them(shard_dir, release, tmp_path):
    import shutil

    run = tmp_path / "run"
    copy = shutil.copy(release, tmp_path / "init.pt")
    args = [str(a) for a in tiny_args(shard_dir, run, **{"num-workers": 0, "max-steps": 1, "ckpt-every": 1,
                                                             "lr": 1e-9, "init": copy})]
    dry = CliRunner().invoke(train_main, [*args, "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert f"  init        {copy} (custom, official, sha256 " in dry.output
    r = CliRunner().invoke(train_main, args)
    assert r.exit_code == 0, r.output
    assert json.loads((run / "config.json").read_text())["init"] == str(copy)
    ckpt = torch.load(run / "checkpoints" / "step-0000001.pt", weights_only=True)
    old = torch.load(release, weights_only=True)
    for k, v in ckpt["model"].items():  # one step of lr 1e-9 away from the file's weights
        if k != "pos_embed":
            assert (v - old[k]).abs().max() <= 1e-6, k  # an Adam step moves each weight by about lr, whatever its size
    # a resume loads its checkpoint, never the init file again
    (tmp_path / "init.pt").unlink()
    r = CliRunner().invoke(train_main, [*args[:args.index("--max-steps")], "--max-steps", "2",
                                        *args[args.index("--max-steps") + 2:]])
    assert r.exit_code == 0, r.output
    assert (run / "checkpoints" / "step-0000002.pt").is_file()
    # our checkpoints and EMA files init too, and a flow run from a ddpm init
    for weights, source in (("step-0000002.pt", "dit-pipeline"), ("step-0000002-ema.pt", "dit-pipeline")):
        dry = CliRunner().invoke(train_main, [str(a) for a in tiny_args(shard_dir, tmp_path / weights, **{
            "num-workers": 0, "dry-run": True, "objective": "flow", "init": run / "checkpoints" / weights})])
        assert dry.exit_code == 0 and f"(custom, {source}, sha256 " in dry.output, dry.output
        assert "output layer (learned sigma off here, on in the file: initialised as the family does, to zero)" \
            in dry.output
    # --resume with a weights file that is no training checkpoint names --init
    r = CliRunner().invoke(train_main, [str(a) for a in tiny_args(shard_dir, tmp_path / "run2", **{
        "num-workers": 0, "resume": release})])
    assert r.exit_code == 1
    assert f"; to start a new run from the weights of a file, pass --init {release} instead of --resume" in r.output
    r = CliRunner().invoke(train_main, [*args, "--resume", str(release)])
    assert r.exit_code == 2 and "--init starts a new run from weights and --resume" in r.output


def test_a_meanflow_run_from_a_sit_file_and_a_flow_run_back_from_it(shard_dir, tmp_path):
    """Issue 41 item 10: `--init` a MeanFlow run from a SiT (or DiT) file: every tensor of the file copied, the second
    time embedder h_embedder started as the MeanFlow release starts it (Gsunshine/meanflow models/models_dit.py
    TimestepEmbedder 38-44: both weights normal(0.02), biases zero); and the reverse, a flow run from the MeanFlow
    file: its h_embedder dropped, the plan says so."""
    sit = _weights(8, learn_sigma=False)
    path = tmp_path / "sit-tiny.pt"
    torch.save(sit.state_dict(), path)
    kw = {"name": "DiT-S/2", "input_size": 8, "num_classes": 2, "learn_sigma": False, **TINY}
    init = load_init(str(path), {**kw, "conditions": "meanflow"})
    torch.manual_seed(0)
    model = dit.create_model(**kw, conditions="meanflow")
    apply_init(model, init)
    sd = model.state_dict()
    assert set(init.state_dict) == set(sit.state_dict()) - {"pos_embed"}
    assert all(torch.equal(sd[k], v) for k, v in sit.state_dict().items())
    for layer in (model.h_embedder.mlp[0], model.h_embedder.mlp[2]):
        assert layer.weight.std().item() == pytest.approx(0.02, rel=0.15) and not layer.bias.any()
    assert ("the new model's own pos_embed (fixed sin-cos/RoPE tables, computed for 8x8 latents), h_embedder "
            "(MeanFlow's time input h = t - r, not in the file: initialised as the MeanFlow release initialises it, "
            "weights normal(0.02), biases zero)") in init.describe()
    mf = tmp_path / "meanflow-tiny.pt"
    torch.save(sd, mf)
    back = load_init(str(mf), kw)
    assert set(back.state_dict) == set(sit.state_dict()) - {"pos_embed"}
    assert "dropped from the file: h_embedder (the file's meanflow time inputs; this run's objective has none)" \
        in back.describe()
    assert "h_embedder" not in "".join(back.kept)
    ddpm = load_init(str(mf), {**kw, "learn_sigma": True})  # a ddpm run: DiT's learned-sigma output starts fresh
    assert "dropped from the file: h_embedder" in ddpm.describe() and "output layer (learned sigma on here" in \
        ddpm.describe()
    ours = load_init(str(path), {**kw, "conditions": "imf"})  # imf-adaln's embedders, as a new run's
    assert ("omega_embedder, tmin_embedder, tmax_embedder (the imf time inputs, not in the file: first layers "
            "normal(0.02), output layers zero, as a new run's)") in ours.describe()
    # the same through dit-train's plan, the objective's time inputs taken from --objective
    dry = CliRunner().invoke(train_main, [str(a) for a in tiny_args(shard_dir, tmp_path / "mf-run", **{
        "num-workers": 0, "dry-run": True, "objective": "meanflow", "init": path})])
    assert dry.exit_code == 0, dry.output
    assert "h_embedder (MeanFlow's time input h = t - r, not in the file" in dry.output
