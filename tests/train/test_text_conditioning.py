"""The trainer's side of the condition (train/text.py, train/preflight.py): what a run is conditioned on, the shard
set's empty prompt as the null condition, the checkpoint key `text` and its resume checks, and the refusals (text
asked of a set without text features, a class checkpoint resumed on text, another text encoder, MeanFlow or the
periodic class grids with text) with their messages."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dit_pipeline.common.errors import ConfigError, UserError
from dit_pipeline.dit.conditioning import TextTokens
from dit_pipeline.dit.family import create_model
from dit_pipeline.train import merge_config
from dit_pipeline.train.text import BatchText, TextPart, open_text_set, run_conditioning
from tests.train.conftest import invoke_train, tiny_args

IDENTITY = {"name": "qwen3-0.6b", "revision": "abc", "max_length": 256, "hidden_state": "last", "dim": 8}


def _manifest(identity=IDENTITY):
    """A text set's manifest as the trainer reads it (shards.Manifest.text_encoder, null_text())."""
    return SimpleNamespace(text_encoder=identity, null_text=lambda: np.zeros((0, 8), dtype=np.float32),
                           dtype="bfloat16")


def test_a_text_set_gives_the_model_its_width_and_the_empty_prompt():
    text = open_text_set(_manifest(), "texts")
    assert (text.dim, text.max_length, text.null_text.shape, text.folder) == (8, 256, (0, 8), "texts")
    model = create_model("ddt-en28d1152hd72-dn2d2048hd128", input_size=4, depth=1, hidden_size=32, num_heads=2,
                         head_depth=1, head_hidden_size=32, head_num_heads=2, conditioning="text", text_dim=8,
                         num_c_tokens=256)
    cond = run_conditioning(model, text)
    assert isinstance(cond, TextTokens) and cond.can_guide and cond.null_text.shape == (0, 8)
    rec = text.record("cached")
    assert rec["encoder"] == IDENTITY and rec["features"] == "cached" and rec["null_mask"].dtype == torch.bool


def test_online_features_encode_the_captions_of_each_batch():
    class Encoder:  # common.text_encoders.TextEncoder's interface: encode(captions).as_batch()
        def encode(self, captions):
            return SimpleNamespace(as_batch=lambda dtype=torch.bfloat16: (
                torch.ones(len(captions), 3, 8, dtype=dtype) * len(captions[0]), torch.ones(len(captions), 3, dtype=torch.bool)))

    out = BatchText(Encoder())(SimpleNamespace(captions=["abcd", "x"]))
    assert out.text.shape == (2, 3, 8) and float(out.text[0, 0, 0]) == 4.0 and out.text_mask.all()
    assert out.text.dtype == torch.bfloat16  # the encoder's dtype, not widened (issue 44 item 6)
    cached = SimpleNamespace(text=torch.zeros(1))
    assert BatchText()(cached) is cached
    with pytest.raises(UserError, match="--text-features online needs the captions in the batches"):
        BatchText(Encoder())(SimpleNamespace(latents=None))


def test_the_checkpoint_key_text_refuses_another_condition_or_encoder():
    text = open_text_set(_manifest())
    mine = TextPart(text.record("cached"))
    assert mine.state_dict()["text"]["encoder"]["name"] == "qwen3-0.6b" and TextPart(None).state_dict() == {}
    mine.check({"text": text.record("online")}, "c.pt")  # the same encoder, cached or online: the same features
    with pytest.raises(UserError, match=r"checkpoint c.pt was trained on class labels; this run's shard set gives "
                                        r"text features"):
        mine.check({}, "c.pt")
    with pytest.raises(UserError, match=r"checkpoint c.pt was trained on text features; this run's shard set gives "
                                        r"class labels"):
        TextPart(None).check({"text": text.record("cached")}, "c.pt")
    other = open_text_set(_manifest({**IDENTITY, "revision": "def"})).record("cached")
    with pytest.raises(UserError, match=r"trained with the text encoder 'qwen3-0.6b' \(revision 'def'\); this run's is "
                                        r"'qwen3-0.6b' \(revision 'abc'\)"):
        mine.check({"text": other}, "c.pt")


def test_text_asked_without_a_text_set_is_refused_before_any_work(shard_dir, tmp_path):
    r = invoke_train(tiny_args(shard_dir, tmp_path / "run", **{"conditioning": "text", "dry-run": True}))
    assert r.exit_code != 0
    assert "--conditioning text needs --text FOLDER, the text set of the shards' captions" in r.output
    assert not (tmp_path / "run").exists() or not (tmp_path / "run" / "checkpoints").exists()
    r = invoke_train(tiny_args(shard_dir, tmp_path / "run", **{"text": shard_dir, "dry-run": True}))
    assert r.exit_code != 0 and f"--text {shard_dir}: not a text set" in r.output
    with pytest.raises(ConfigError) as e:
        merge_config({}, {"shards": "s", "run_dir": "r", "conditioning": "captions"}).validate()
    assert "--conditioning must be one of auto, class, text, none" in str(e.value)
    with pytest.raises(ConfigError, match="--text conditions the model on text; --conditioning class does not use it"):
        merge_config({}, {"shards": "s", "run_dir": "r", "conditioning": "class", "text": "t"}).validate()


def test_the_plan_names_the_condition(shard_dir, tmp_path):
    r = invoke_train(tiny_args(shard_dir, tmp_path / "run", **{
        "model": "ddt-en28d1152hd72-dn2d2048hd128", "depth": 1, "hidden-size": 32, "num-heads": 2, "head-depth": 1,
        "head-hidden-size": 32, "head-num-heads": 2, "dry-run": True}))
    assert r.exit_code == 0, r.output
    assert "in context: 4 time tokens, 8 class tokens" in r.output
    assert "  condition   2 classes; dropout 0.1 to the null label 2" in r.output


def test_a_text_set_builds_a_text_model_and_refuses_imf_class_grids_and_fid():
    from dit_pipeline.train.preflight import condition_kwargs

    base = {"shards": "s", "run_dir": "r", "model": "ddt-en28d1152hd72-dn2d2048hd128"}
    text = open_text_set(_manifest(), "t")
    assert condition_kwargs(merge_config({}, base), text) == {"conditioning": "text", "text_dim": 8,
                                                              "num_c_tokens": 256}  # the encoder's max length
    assert condition_kwargs(merge_config({}, base), None) == {}  # no --text: class labels
    with pytest.raises(UserError) as e:
        condition_kwargs(merge_config({}, {**base, "objective": "imf", "sample_every": 10, "fid_every": 10,
                                           "fid_ref": "ref.npz", "fid_labels": "equal"}), text)
    assert str(e.value) == ("--conditioning text: --objective imf trains class-conditional models here; its sample "
                            "grids draw prompts: pass --sample-prompts FILE (one prompt per line); --fid-labels picks "
                            "a class run's FID classes; a text run's FID samples draw prompts (drop it); FID during "
                            "training (--fid-every) of a text run draws prompts: pass --fid-prompts FILE, or a "
                            "captioned --fid-ref (dit-eval --make-ref FOLDER --captions FILE writes REF.prompts.jsonl "
                            "beside REF.npz)")
    with pytest.raises(UserError, match=r"^--fid-prompts: prompts draw a text run's FID samples; this run is "
                                        r"conditioned on class labels \(--fid-labels picks how the classes are drawn\)$"):
        condition_kwargs(merge_config({}, {**base, "fid_every": 10, "fid_ref": "r.npz", "fid_prompts": "p.txt"}), None)
    with pytest.raises(UserError, match=r"^--conditioning text: --sample-classes picks a class run's grids"):
        condition_kwargs(merge_config({}, {**base, "sample_every": 10, "sample_prompts": "p.txt",
                                           "sample_classes": "1"}), text)
    with pytest.raises(UserError, match=r"^--sample-prompts: prompts draw a text run's grids; this run is conditioned "
                                        r"on class labels \(--sample-classes picks the classes\)$"):
        condition_kwargs(merge_config({}, {**base, "sample_every": 10, "sample_prompts": "p.txt"}), None)
    assert condition_kwargs(merge_config({}, {**base, "sample_every": 10, "sample_prompts": "p.txt"}),
                            text)["conditioning"] == "text"  # a text run's grids
