"""Text-to-image evaluation end to end with tiny random models (nothing downloaded): a captioned reference folder
-> `dit-eval --make-ref --captions` -> `dit-eval SAMPLES --ref REF --t2i clip-score --t2i geneval --prompts
REF.prompts.jsonl` on a folder of images; FID, the CLIP score and GenEval asserted against values computed
independently: FID from the Inception features and the reference's statistics, the CLIP score through
transformers' CLIPModel and CLIPProcessor as NanoGen calls them (diffusion-bench `src/eval/clipscore.py` lines
56-65), GenEval through transformers' Mask2Former and the transcription of NanoGen's rules
(tests/evaluate/_nanogen_geneval.py, which names the release's files and lines)."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from dit_pipeline.cli import eval_main
from dit_pipeline.evaluate.features import local_features
from dit_pipeline.evaluate.inception import load_inception
from tests._util import FP32_EPS, assert_close_at_scale
from tests.evaluate import _nanogen_geneval as ref
from tests.evaluate._t2i_models import make_tiny_clip, make_tiny_mask2former, shapes, write_jsonl

GENEVAL = [
    {"tag": "single_object", "include": [{"class": "dog", "count": 1}], "prompt": "a photo of a dog"},
    {"tag": "counting", "include": [{"class": "dog", "count": 2}], "exclude": [{"class": "dog", "count": 3}],
     "prompt": "a photo of two dogs"},
    {"tag": "colors", "include": [{"class": "dog", "count": 1, "color": "red"}], "prompt": "a photo of a red dog"},
    {"tag": "position", "include": [{"class": "cat", "count": 1},
                                    {"class": "dog", "count": 1, "position": ["right of", 0]}],
     "prompt": "a photo of a dog right of a cat"},
]
SIZE = 48


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("t2i-models")
    return make_tiny_clip(root / "clip"), make_tiny_mask2former(root / "m2f")


def _independent_geneval(samples, detector_dir, clip_dir, records):
    from transformers import CLIPModel, CLIPProcessor, Mask2FormerForUniversalSegmentation, Mask2FormerImageProcessor

    det = Mask2FormerForUniversalSegmentation.from_pretrained(detector_dir).eval()
    proc = Mask2FormerImageProcessor.from_pretrained(detector_dir)
    clip = CLIPModel.from_pretrained(clip_dir).eval()
    try:
        clip_proc = CLIPProcessor.from_pretrained(clip_dir, backend="pil")
    except TypeError:
        clip_proc = CLIPProcessor.from_pretrained(clip_dir, use_fast=False)
    results = []
    for image, meta in zip(samples, records):
        im = Image.fromarray(image)
        inputs = proc(images=im, return_tensors="pt", size={"shortest_edge": 800, "longest_edge": 1333})
        with torch.no_grad():
            out = det(**inputs)
        cands = ref.candidates(out.class_queries_logits[0], out.masks_queries_logits[0],
                               tuple(inputs["pixel_values"].shape[2:]), (im.height, im.width))
        objects = ref.keep(ref.detections(cands, det.config.id2label, ref_classnames()), meta["tag"])
        ok = ref.correct(meta, objects, lambda name, objs: ref.colors_with(clip, clip_proc, im, name, objs))
        results.append({"tag": meta["tag"], "correct": ok, "metadata": json.dumps(meta)})
    return results


def ref_classnames():
    from dit_pipeline.evaluate.geneval_detect import COCO_CLASSES  # GenEval's object_names.txt, as data

    return list(COCO_CLASSES)


@pytest.mark.skipif(tuple(int(x) for x in __import__("transformers").__version__.split(".")[:2]) < (5, 4),
                    reason="the reference CLIP processor and tokenizer are transformers >= 5.4's (NanoGen runs 5)")
def test_captioned_reference_to_fid_clip_score_and_geneval(tmp_path, models):
    clip_dir, detector_dir = models
    photos = tmp_path / "coco"
    photos.mkdir()
    for i, img in enumerate(shapes(4, 64, seed=5)):
        Image.fromarray(img[:, : 64 - 4 * i]).save(photos / f"{i:03d}.png")  # various widths
    caps = write_jsonl(tmp_path / "captions.jsonl", [{"file_name": f"{i:03d}.png", "caption": g["prompt"]}
                                                     for i, g in enumerate(GENEVAL)])
    inception = ["--random-inception", "0", "--input-size", "75", "--batch-size", "4"]
    refnpz = tmp_path / "ref.npz"
    r = CliRunner().invoke(eval_main, ["--make-ref", str(photos), "--captions", str(caps), "--image-size", str(SIZE),
                                       "--crop", "resize", "--out", str(refnpz), "--quiet", *inception])
    assert r.exit_code == 0, r.output
    prompts = tmp_path / "ref.prompts.jsonl"
    assert [json.loads(x)["prompt"] for x in prompts.read_text().splitlines()] == [g["prompt"] for g in GENEVAL]

    samples = shapes(4, SIZE, seed=1)  # "generated from" the reference's prompts, in their order
    (tmp_path / "samples").mkdir()
    for i, img in enumerate(samples):
        Image.fromarray(img).save(tmp_path / "samples" / f"{i:06d}.png")
    meta = write_jsonl(tmp_path / "evaluation_metadata.jsonl", GENEVAL)
    r = CliRunner().invoke(eval_main, [str(tmp_path / "samples"), "--ref", str(refnpz), "--t2i", "clip-score",
                                       "--t2i", "geneval", "--prompts", str(prompts), "--geneval-metadata", str(meta),
                                       "--clip", str(clip_dir), "--detector", str(detector_dir), "--device", "cpu",
                                       "--quiet", *inception])
    assert r.exit_code == 0, r.output
    result = json.loads((tmp_path / "samples.eval.json").read_text())

    # FID: the samples' Inception features (in dit-eval's batches of 4) against the reference's stored
    # statistics, by the formula of NanoGen's src/eval/fid.py lines 12-27 (scipy's sqrtm, real part)
    import scipy.linalg

    model, _ = load_inception(None, random_seed=0, input_size=75)
    _, feats = local_features(model, [([0, 1, 2, 3], samples)], "cpu")
    pool = feats["pool"].astype(np.float64)
    mu, sigma = pool.mean(axis=0), np.cov(pool, rowvar=False)
    with np.load(refnpz) as z:
        mu_r, sigma_r = z["mu"].astype(np.float64), z["sigma"].astype(np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 4 samples: a singular covariance, as in every tiny FID
        covmean = scipy.linalg.sqrtm(sigma @ sigma_r).real
    fid = float((mu - mu_r) @ (mu - mu_r) + np.trace(sigma + sigma_r - 2 * covmean))
    # a random Inception's distance is stored under its own key, never as fid (evaluate/labels.py)
    assert "fid" not in result and result["fd_rand"] == pytest.approx(fid, rel=1e-4)

    # the CLIP score: NanoGen's computation through transformers
    from transformers import CLIPModel, CLIPProcessor

    clip, proc = CLIPModel.from_pretrained(clip_dir).eval(), CLIPProcessor.from_pretrained(clip_dir)
    with torch.no_grad():
        out = clip(**proc(text=[g["prompt"] for g in GENEVAL], images=[Image.fromarray(s) for s in samples],
                          return_tensors="pt", padding=True, truncation=True))
    cos = (out.image_embeds * out.text_embeds).sum(dim=-1).double()
    cs = result["t2i"]["clip_score"]
    assert (cs["name"], cs["count"]) == ("CLIPScore-4", 4)
    assert_close_at_scale(cs["value"], cos.sum() / 4, rel=16 * FP32_EPS, scale=1.0)

    # GenEval: transformers' Mask2Former and CLIP with NanoGen's rules, transcribed
    theirs = _independent_geneval(samples, detector_dir, clip_dir, GENEVAL)
    expected = ref.summary(theirs)
    ge = result["t2i"]["geneval"]
    rows = [json.loads(x) for x in (tmp_path / "samples.eval.samples.jsonl").read_text().splitlines()]
    assert [row["geneval"]["correct"] for row in rows] == [t["correct"] for t in theirs]
    assert 0 < sum(t["correct"] for t in theirs) < 4   # both outcomes occur
    assert (ge["name"], ge["value"], ge["overall"], ge["tasks"], ge["correct_prompts"]) == \
        ("GenEval-4", expected["nanogen"], expected["overall"], expected["tasks"], expected["correct_prompts"])
    assert ge["models"]["detector"]["name"] == str(detector_dir) and ge["models"]["clip"]["name"] == str(clip_dir)
    lines = r.output.splitlines()
    assert lines[0].startswith("[adm] ADM evaluator (openai/guided-diffusion evaluations/evaluator.py): 4 samples "
                               "vs ref.npz (precomputed), Inception network: RANDOM weights")
    assert lines[1].startswith("IS-rand (not IS): ") and \
        lines[2] == f"FD-rand0-4 (not FID): {round(result['fd_rand'], 6) + 0.0!r}"
    assert lines[6] == (f"CLIPScore-4: {cs['value']:.6f} (mean cosine; 100 x max(cos, 0): {cs['x100_clamped']:.4f}), with "
                        f"clip {clip_dir} (weights sha256 {cs['models']['clip']['weights_sha256'][:12]}...)")
    assert lines[7].startswith(f"GenEval-4: {ge['value']:.6f} (correct images, NanoGen's number); overall ")
    assert lines[-1] == ("names: FD-rand0-4, sFD-rand0-4, CLIPScore-4, GenEval-4 (4 samples vs ref.npz, protocol adm; "
                         "a proxy: the Frechet distance of an Inception network with random weights (seed 0): a smoke "
                         f"test, not FID, comparable with nothing published, prompts from --prompts {prompts})")
