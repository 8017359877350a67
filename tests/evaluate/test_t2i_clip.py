"""CLIP for the text-to-image evaluators (evaluate/clip.py, evaluate/clipscore.py): the two preprocessing
variants equal transformers' own processors (the torchvision backend NanoGen's CLIP score ran under its
transformers 5.3, and the PIL backend its GenEval color classifier asks for with use_fast=False), and the CLIP
score equals NanoGen's computation (End2End-Diffusion/diffusion-bench `src/eval/clipscore.py` lines 56-65:
`CLIPProcessor(text, images, padding=True, truncation=True)`, `(image_embeds * text_embeds).sum(-1)`;
`src/eval/generation.py` lines 171-174 and 51-61: the sum over the samples divided by their count)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from dit_pipeline.common.errors import UserError
from dit_pipeline.evaluate.clip import load_clip
from dit_pipeline.evaluate.clipscore import ClipScorer
from tests._util import FP32_EPS, assert_close_at_scale
from tests.evaluate._t2i_models import make_tiny_clip


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return make_tiny_clip(tmp_path_factory.mktemp("clip"))


def _processor(folder, backend):
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(folder, backend=backend)
    except TypeError:  # transformers before the `backend` argument
        return AutoImageProcessor.from_pretrained(folder, use_fast=backend == "torchvision")


def _transformers_at_least(major, minor):
    import transformers

    return tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (major, minor)


# NanoGen runs transformers 5, whose CLIP image processors (from 5.4) are the ones evaluate/clip.py reproduces;
# transformers 4 and 5.0-5.3 resize differently (0.015 apart), so they cannot be the reference here
@pytest.mark.skipif(not _transformers_at_least(5, 4), reason="the reference processors are transformers >= 5.4's")
@pytest.mark.parametrize("hw", [(37, 53), (61, 29), (32, 32), (17, 17)])
def test_preprocessing_equals_transformers(clip_dir, hw):
    rng = np.random.default_rng(sum(hw))
    images = rng.integers(0, 256, (3, *hw, 3), dtype=np.uint8)
    clip = load_clip(str(clip_dir))
    fast = _processor(clip_dir, "torchvision")(images=[Image.fromarray(i) for i in images],
                                               return_tensors="pt")["pixel_values"]
    assert_close_at_scale(clip.pixels_torchvision(images), fast, rel=8 * FP32_EPS, what="torchvision")
    slow = _processor(clip_dir, "pil")(images=[Image.fromarray(i) for i in images], return_tensors="pt")
    assert_close_at_scale(clip.pixels_pil([Image.fromarray(i) for i in images]), slow["pixel_values"],
                          rel=8 * FP32_EPS, what="pil")


@pytest.mark.skipif(not _transformers_at_least(5, 4), reason="the reference processor is transformers >= 5.4's")
def test_clip_score_is_nanogens_mean_cosine(clip_dir):
    from transformers import CLIPModel, CLIPProcessor

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (5, 40, 40, 3), dtype=np.uint8)
    prompts = ["a photo of a dog", "a red cat", "two dogs above a kite and a blue teddy bear left of a green cat "
               "and a black dog", "a white object", "cat"]  # the third is longer than the 12 tokens: truncated
    model = CLIPModel.from_pretrained(clip_dir).eval()
    proc = CLIPProcessor.from_pretrained(clip_dir)
    with torch.no_grad():
        out = model(**proc(text=prompts, images=[Image.fromarray(i) for i in images], return_tensors="pt",
                           padding=True, truncation=True))
    expected = (out.image_embeds * out.text_embeds).sum(dim=-1).double()
    scorer = ClipScorer(load_clip(str(clip_dir)))
    per = scorer.score(images, [{"prompt": p} for p in prompts])
    assert_close_at_scale([s["cosine"] for s in per], expected, rel=16 * FP32_EPS, scale=1.0)
    summary = scorer.summarize(per)
    assert summary["value"] == pytest.approx(expected.sum().item() / 5, abs=1e-6)
    assert summary["x100_clamped"] == pytest.approx(float((100 * expected.clamp(min=0)).mean()), abs=1e-4)


def test_the_two_conventions_on_known_cosines():
    s = ClipScorer.summarize([{"cosine": -0.2}, {"cosine": 0.1}, {"cosine": 0.3}])
    assert s["value"] == pytest.approx(0.2 / 3, rel=1e-12)          # NanoGen: the plain mean, negatives count
    assert s["x100_clamped"] == pytest.approx(40 / 3, rel=1e-12)    # torchmetrics: 100 * max(cos, 0)


def test_a_folder_without_clip_is_one_clear_error(tmp_path):
    with pytest.raises(UserError, match=r"--clip .*nothing: cannot load a CLIP model"):
        load_clip(str(tmp_path / "nothing"))


@pytest.mark.determinism
def test_two_ranks_score_every_sample_once_and_as_one_process(clip_dir, tmp_path):
    """5 samples in batches of 2 over 2 ranks (batches 0 and 2 on rank 0, batch 1 on rank 1): the per-sample
    cosines gathered on rank 0 equal one process's, bit for bit (the same batches, the same threads)."""
    from tests._util import run_cli, run_torchrun

    np.savez(tmp_path / "s.npz", arr_0=np.random.default_rng(3).integers(0, 256, (5, 40, 40, 3), dtype=np.uint8))
    (tmp_path / "p.txt").write_text("a dog\na red cat\ntwo dogs\na kite\nthe blue object\n")
    args = [tmp_path / "s.npz", "--t2i", "clip-score", "--prompts", tmp_path / "p.txt", "--clip", clip_dir,
            "--batch-size", "2", "--quiet"]
    one = run_cli("dit-eval", [*args, "--json", tmp_path / "one.json"], timeout=600)
    assert one.returncode == 0, one.stderr
    two = run_torchrun("dit-eval", [*args, "--json", tmp_path / "two.json"], timeout=600)
    assert two.returncode == 0, two.stderr
    rows = [[json.loads(x) for x in (tmp_path / f"{n}.samples.jsonl").read_text().splitlines()] for n in ("one", "two")]
    assert rows[0] == rows[1] and [r["index"] for r in rows[1]] == [0, 1, 2, 3, 4]
    results = [json.loads((tmp_path / f"{n}.json").read_text())["t2i"]["clip_score"] for n in ("one", "two")]
    assert results[0]["value"] == results[1]["value"] and results[1]["name"] == "CLIPScore-5"


def test_the_clip_score_names_its_model_and_weights(clip_dir, tmp_path, monkeypatch):
    """Issue 47 (ok case): the console line names the CLIP model, the JSON records its weights' sha256, and offline
    the error no longer asks for "a hub id such as openai/clip-vit-large-patch14", the id just given."""
    import hashlib

    from dit_pipeline.common.io import sha256_file
    from dit_pipeline.evaluate.clip import DEFAULT_CLIP
    from dit_pipeline.evaluate.t2i import format_t2i

    ident = load_clip(str(clip_dir)).identity
    files = sorted(clip_dir.glob("*.safetensors"))
    assert files and ident["weights_sha256"] == hashlib.sha256(
        "".join(f"{f.name}\t{sha256_file(f)}\n" for f in files).encode()).hexdigest()
    r = {"name": "CLIPScore-4", "value": 0.25, "x100_clamped": 25.0, "models": {"clip": ident}}
    assert format_t2i({"clip_score": r}) == [
        f"CLIPScore-4: 0.250000 (mean cosine; 100 x max(cos, 0): 25.0000), with clip {clip_dir} (weights sha256 "
        f"{ident['weights_sha256'][:12]}...)"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(UserError) as e:
        load_clip(DEFAULT_CLIP)
    assert str(e.value) == (f"--clip {DEFAULT_CLIP}: not a local folder and not in the Hugging Face cache, and the "
                            "hub was not asked (HF_HUB_OFFLINE is set); pass a folder written by save_pretrained, or "
                            f"fill the cache where there is a network (huggingface-cli download {DEFAULT_CLIP})")
