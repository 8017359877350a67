"""What the text-to-image evaluation reads: prompt files (common/prompts.py), captions files and the captioned
reference (`dit-eval --make-ref FOLDER --captions FILE`, extract/reference.py), the prompts of the samples
(evaluate/t2i.py), the evaluator registry's refusals, and DPG-Bench's rule on hand-built answers."""
from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from dit_pipeline.cli import eval_main
from dit_pipeline.common.errors import ConfigError, UserError
from dit_pipeline.common.prompts import read_prompts
from dit_pipeline.evaluate import EvalConfig, run_eval
from dit_pipeline.evaluate.inputs import open_source
from dit_pipeline.evaluate.t2i import EVALUATORS, prepare_records, sample_prompts
from dit_pipeline.evaluate.vqa import dpg_scores, dpg_summary
from dit_pipeline.extract.reference import captioned_reference, read_captions
from tests.evaluate._t2i_models import write_jsonl

FAST = ["--random-inception", "0", "--input-size", "75", "--batch-size", "4", "--quiet"]


# ---- prompt files ---------------------------------------------------------------------------------------------

def test_prompt_files_in_every_form(tmp_path):
    gen = {"tag": "counting", "include": [{"class": "dog", "count": 2}], "prompt": "a photo of two dogs"}
    assert read_prompts(write_jsonl(tmp_path / "g.jsonl", [gen, {"prompt": "x"}])) == [gen, {"prompt": "x"}]
    (tmp_path / "m.json").write_text(json.dumps({"a photo of two dogs": {k: v for k, v in gen.items()}}))
    assert read_prompts(tmp_path / "m.json") == [gen]  # NanoGen's metadata.json: keyed by prompt
    (tmp_path / "l.json").write_text(json.dumps(["one", {"prompt": "two", "tag": "t"}]))
    assert read_prompts(tmp_path / "l.json") == [{"prompt": "one"}, {"prompt": "two", "tag": "t"}]
    (tmp_path / "p.txt").write_text("  a cat \n\nthe dog\n")
    assert read_prompts(tmp_path / "p.txt") == [{"prompt": "a cat"}, {"prompt": "the dog"}]


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "a"}\n{"text": "b"}\n', 'line 2: no "prompt" string (keys: text); every record needs its prompt'),
    ('{"prompt": "a"}\nnot json\n', "line 2: not JSON"),
    ("\n\n", "holds no prompts"),
    ('{"prompt": "  "}\n', 'line 1: no "prompt" string'),
])
def test_bad_prompt_files(tmp_path, content, message):
    (tmp_path / "p.jsonl").write_text(content)
    with pytest.raises(UserError, match="--prompts .*p.jsonl") as e:
        read_prompts(tmp_path / "p.jsonl")
    assert message in str(e.value)


# ---- captions and the captioned reference -----------------------------------------------------------------------

@pytest.fixture
def photos(tmp_path):
    rng = np.random.default_rng(0)
    root = tmp_path / "val"
    for rel, (w, h) in {"a/1.png": (40, 30), "a/2.jpg": (33, 70), "b/3.png": (64, 64), "4.png": (50, 41),
                        "5.png": (30, 30)}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / rel)
    return root


def test_captions_files_of_coco_mjhq_csv_and_jsonl(tmp_path, photos):
    coco = {"images": [{"id": 7, "file_name": "1.png"}, {"id": 9, "file_name": "3.png"}],
            "annotations": [{"image_id": 7, "caption": "first"}, {"image_id": 9, "caption": "third"},
                            {"image_id": 7, "caption": "first again"}]}
    (tmp_path / "coco.json").write_text(json.dumps(coco))
    assert read_captions(tmp_path / "coco.json") == [("1.png", ["first"]), ("3.png", ["third"]),
                                                     ("1.png", ["first again"])]
    (tmp_path / "mjhq.json").write_text(json.dumps({"4": {"category": "people", "prompt": "four"}, "5": "five"}))
    ref = captioned_reference(photos, tmp_path / "mjhq.json", 16)   # named by stem
    assert [r for r in ref.records] == [{"prompt": "four", "file": "4.png"}, {"prompt": "five", "file": "5.png"}]
    assert ref.uncaptioned == 3 and ref.images.shape == (2, 16, 16, 3)
    (tmp_path / "c.csv").write_text('file_name,caption\na/2.jpg,"two, with a comma"\nb/3.png,three\n')
    assert read_captions(tmp_path / "c.csv") == [("a/2.jpg", ["two, with a comma"]), ("b/3.png", ["three"])]


def test_captioned_reference_picks_one_caption_per_image_by_seed(tmp_path, photos):
    caps = write_jsonl(tmp_path / "c.jsonl", [{"file": "a/1.png", "caption": ["p", "q", "r", "s", "t"]},
                                              {"image": "3.png", "text": "only"},
                                              {"file": "gone.png", "caption": "lost"}])
    refs = [captioned_reference(photos, caps, 16, seed=s) for s in range(8)]
    first = [r.records[0]["prompt"] for r in refs]
    assert set(first) <= {"p", "q", "r", "s", "t"} and len(set(first)) > 1  # drawn, and the seed matters
    again = captioned_reference(photos, caps, 16, seed=3)
    assert again.records == refs[3].records
    assert refs[0].records[1] == {"prompt": "only", "file": "b/3.png"}
    assert refs[0].skipped == [("gone.png", "named in the captions file but not found under the folder")]


def test_captions_that_name_no_image_are_refused(tmp_path, photos):
    caps = write_jsonl(tmp_path / "c.jsonl", [{"file": "x/1.png", "caption": "a"}, {"file": "zz", "caption": "b"}])
    with pytest.raises(UserError) as e:
        captioned_reference(photos, caps, 16)
    assert str(e.value) == (f"--captions {caps}: none of its 2 captions names an image under {photos} (of 5); an "
                            "image is named by its path relative to the folder, or by its unique file name or stem")


def test_ambiguous_names_are_refused(tmp_path, photos):
    Image.new("RGB", (20, 20)).save(photos / "b" / "1.png")
    caps = write_jsonl(tmp_path / "c.jsonl", [{"file": "1.png", "caption": "x"}])
    with pytest.raises(UserError, match=r"'1.png' could be any of a/1.png, b/1.png; name the image by its path"):
        captioned_reference(photos, caps, 16)


def test_make_ref_with_captions_writes_the_prompts_in_image_order(tmp_path, photos):
    from torchvision import transforms

    caps = write_jsonl(tmp_path / "c.jsonl", [{"file": f, "caption": f"caption of {f}"}
                                              for f in ("5.png", "a/2.jpg", "b/3.png", "4.png")])
    out = tmp_path / "ref.npz"
    r = CliRunner().invoke(eval_main, ["--make-ref", str(photos), "--captions", str(caps), "--image-size", "16",
                                       "--crop", "resize", "--out", str(out), *FAST])
    assert r.exit_code == 0, r.output
    size = out.stat().st_size / 2**20
    assert r.output.splitlines()[-2:] == [f"wrote {out}: 4 images of 16x16 (1 without a caption left out) and their "
                                          f"Inception statistics (random-seed-0), {size:.1f} MiB",
                                          f"wrote {tmp_path / 'ref.prompts.jsonl'}: their 4 captions, one per "
                                          "image (dit-sample --prompts)"]
    order = ["4.png", "5.png", "a/2.jpg", "b/3.png"]
    assert read_prompts(tmp_path / "ref.prompts.jsonl") == [{"prompt": f"caption of {f}", "file": f} for f in order]
    # NanoGen's T2I evaluation transform (diffusion-bench src/data/unified_dataloader.py lines 228-233)
    cut = transforms.Compose([transforms.Resize(16, interpolation=transforms.InterpolationMode.BICUBIC),
                              transforms.CenterCrop(16)])
    with np.load(out) as z:
        for i, f in enumerate(order):
            assert np.array_equal(z["arr_0"][i], np.asarray(cut(Image.open(photos / f).convert("RGB"))))
    (tmp_path / "ref.npz").unlink()
    again = CliRunner().invoke(eval_main, ["--make-ref", str(photos), "--captions", str(caps), "--image-size", "16",
                                           "--out", str(out), *FAST])
    assert again.exit_code == 1 and f"its prompts file {tmp_path / 'ref.prompts.jsonl'} already exists" in again.output
    assert not out.exists()


# ---- the prompts of the samples -------------------------------------------------------------------------------------

def test_prompts_come_from_the_flag_or_the_samples_record(tmp_path):
    np.savez(tmp_path / "s.npz", arr_0=np.zeros((3, 8, 8, 3), np.uint8))
    src = open_source(tmp_path / "s.npz", "SAMPLES")
    with pytest.raises(UserError) as e:
        sample_prompts(src, None)
    assert str(e.value) == (f"SAMPLES {tmp_path / 's.npz'}: no prompts recorded with the samples (looked in "
                            f"{tmp_path / 's.npz.json'}); pass --prompts FILE with one prompt per sample, in the "
                            "samples' order")
    (tmp_path / "s.npz.json").write_text(json.dumps({"prompts": ["a", {"prompt": "b", "tag": "t"}, "c"]}))
    assert sample_prompts(src, None) == ([{"prompt": "a"}, {"prompt": "b", "tag": "t"}, {"prompt": "c"}],
                                         str(tmp_path / "s.npz.json"))
    (tmp_path / "p.txt").write_text("x\ny\n")
    with pytest.raises(UserError) as e:
        sample_prompts(src, str(tmp_path / "p.txt"))
    assert str(e.value).startswith(f"SAMPLES {tmp_path / 's.npz'} has 3 images but --prompts {tmp_path / 'p.txt'} "
                                   "has 2 prompts; they must be aligned, one prompt per sample")
    folder = tmp_path / "out"
    (folder / "images").mkdir(parents=True)
    for i in range(2):
        Image.new("RGB", (8, 8)).save(folder / "images" / f"{i:06d}.png")
    (folder / "samples.json").write_text(json.dumps({"fingerprint": {"format": "dit-pipeline.samples"},
                                                     "prompts": ["p0", "p1"]}))
    assert sample_prompts(open_source(folder, "SAMPLES"), None)[0] == [{"prompt": "p0"}, {"prompt": "p1"}]


def test_t2i_needs_the_images(tmp_path):
    np.savez(tmp_path / "stats.npz", mu=np.zeros(4), sigma=np.eye(4))
    (tmp_path / "p.txt").write_text("a\n")
    r = CliRunner().invoke(eval_main, [str(tmp_path / "stats.npz"), "--t2i", "clip-score", "--prompts",
                                       str(tmp_path / "p.txt"), "--quiet"])
    assert r.exit_code == 1 and (f"SAMPLES {tmp_path / 'stats.npz'} is a statistics file; the text-to-image "
                                 "evaluators need the images (.npz or folder)") in r.output
    r = CliRunner().invoke(eval_main, ["--make-ref", str(tmp_path), "--t2i", "clip-score"])
    assert r.exit_code == 2 and "--make-ref builds a reference batch; it takes no SAMPLES, --ref or --t2i" in r.output


def test_geneval_metadata_by_prompt(tmp_path):
    meta = {"a photo of a dog": {"tag": "single_object", "include": [{"class": "dog", "count": 1}],
                                 "prompt": "a photo of a dog"}}
    (tmp_path / "metadata.json").write_text(json.dumps(meta))
    got = prepare_records(["geneval"], [{"prompt": "a photo of a dog"}], "x", str(tmp_path / "metadata.json"))
    assert got == [meta["a photo of a dog"]]
    with pytest.raises(UserError) as e:
        prepare_records(["geneval"], [{"prompt": "a photo of a dog"}, {"prompt": "a cat"}], "--prompts p.txt", None)
    assert str(e.value) == ("GenEval: sample 0's prompt 'a photo of a dog' (--prompts p.txt) has no GenEval metadata "
                            "(tag, include) (pass --geneval-metadata FILE: GenEval's evaluation_metadata.jsonl or "
                            "NanoGen's metadata.json)")


# ---- settings, registry, refusals ---------------------------------------------------------------------------------

def test_settings_are_checked_together(tmp_path):
    with pytest.raises(ConfigError) as e:
        EvalConfig(samples="s.npz", ref=None, t2i=("clip-score", "fid"), fd_dinov2=True,
                   geneval_metadata="m.json").validate()
    assert e.value.problems == ["--t2i fid: unknown; choose from clip-score, geneval, dpg-bench, vqascore",
                                "--fd-dinov2 needs --ref (a distance between the samples and a reference)",
                                "--geneval-metadata is read by GenEval; add --t2i geneval"]
    with pytest.raises(ConfigError) as e:
        EvalConfig(samples="s.npz", prompts="p.txt").validate()
    assert e.value.problems == ["--ref is missing: give the reference batch, e.g. VIRTUAL_imagenet256_labeled.npz "
                                "(or only text-to-image scores with --t2i NAME)",
                                "--prompts is read by the text-to-image evaluators; add --t2i NAME (e.g. clip-score)"]


@pytest.mark.parametrize("name, package, what", [("dpg-bench", "dpg_evaluator", "DPG-Bench"),
                                                 ("vqascore", "t2v_metrics", "VQAScore")])
def test_vqa_evaluators_refuse_without_their_package_before_any_work(tmp_path, monkeypatch, name, package, what):
    monkeypatch.setitem(sys.modules, package, None)  # not importable, whatever is installed
    np.savez(tmp_path / "s.npz", arr_0=np.zeros((2, 8, 8, 3), np.uint8))
    (tmp_path / "p.txt").write_text("a\nb\n")
    r = CliRunner().invoke(eval_main, [str(tmp_path / "s.npz"), "--t2i", name, "--prompts", str(tmp_path / "p.txt"),
                                       "--quiet"])
    assert r.exit_code == 1
    assert f"{what} needs the `{package}` package, which brings its VQA model" in r.output
    assert EVALUATORS[name].install in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.txt", "s.npz"]  # nothing written


def test_dpg_rule_on_hand_built_answers():
    # questions 1, 2 roots; 3 depends on 1; 4 on 3 and 2 (diffusionbench-evals dpgbench/dpg_evaluator/evaluator.py
    # lines 38-48: a question is zeroed when a parent other than 0 is scored 0, in question order)
    deps = {1: [0], 2: [0], 3: [1], 4: [3, 2]}
    assert dpg_scores({1: "yes", 2: "yes", 3: "yes", 4: "yes"}, deps) == (1.0, {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0})
    assert dpg_scores({1: "no", 2: "yes", 3: "yes", 4: "yes"}, deps)[0] == 1 / 4      # 3 zeroed, then 4
    assert dpg_scores({1: "yes", 2: "no", 3: "yes", 4: "yes"}, deps)[0] == 2 / 4      # 4 zeroed
    assert dpg_scores({1: "Yes", 2: "yes", 3: "yes", 4: "yes"}, deps)[0] == 1 / 4      # only "yes" counts
    per = [{"score": 0.5, "raw": {1: 1.0, 2: 0.0}, "tuples": {1: "entity - whole (dog)", 2: "attribute - color (dog, red)"}},
           {"score": 1.0, "raw": {1: 1.0, 2: 1.0}, "tuples": {1: "entity - whole (cat)", 2: "attribute - size (cat, big)"}}]
    assert dpg_summary(per) == {"value": 0.75, "level1": {"entity": 1.0, "attribute": 0.5},
                                "level2": {"entity - whole": 1.0, "attribute - color": 0.0, "attribute - size": 1.0}}


def test_dpg_and_vqascore_run_through_their_packages(tmp_path, monkeypatch):
    """With the packages present (stand-ins here: the real ones bring multi-GB models), the scores flow through
    dit-eval's run, named with their sample count."""
    asked = []

    class MPLUG:
        def __init__(self, device):
            pass

        def batch_vqa(self, images, questions):
            asked.append(questions)
            return ["yes" if "dog" in q else "no" for q in questions]
    items = {"7": {"qid2question": {1: "is there a dog?", 2: "is the cat red?"}, "qid2dependency": {1: [0], 2: [0]},
                   "qid2tuple": {1: "entity - whole (dog)", 2: "attribute - color (cat, red)"}}}
    dpg = types.SimpleNamespace(MPLUG=MPLUG, load_prompt2id=lambda: {"p0": "7", "p1": "7"},
                                load_dpg_metadata=lambda: items)

    class VQAScore:
        def __init__(self, model, device):
            assert model == "clip-flant5-xxl"

        def __call__(self, images, texts):
            return np.array([0.25 if t == "p0" else 0.75 for t in texts])
    monkeypatch.setitem(sys.modules, "dpg_evaluator", dpg)
    monkeypatch.setitem(sys.modules, "t2v_metrics", types.SimpleNamespace(VQAScore=VQAScore))
    np.savez(tmp_path / "s.npz", arr_0=np.zeros((2, 8, 8, 3), np.uint8))
    (tmp_path / "p.txt").write_text("p0\np1\n")
    result = run_eval(EvalConfig(samples=str(tmp_path / "s.npz"), t2i=("dpg-bench", "vqascore"),
                                 prompts=str(tmp_path / "p.txt"), quiet=True, device="cpu"))
    assert result["t2i"]["dpg_bench"]["value"] == 0.5 and result["t2i"]["dpg_bench"]["name"] == "DPG-Bench-2"
    assert result["t2i"]["dpg_bench"]["level1"] == {"entity": 1.0, "attribute": 0.0}
    assert result["t2i"]["vqascore"]["value"] == 0.5 and result["t2i"]["vqascore"]["name"] == "VQAScore-2"
    assert asked == [["is there a dog?", "is the cat red?"]] * 2
    rows = [json.loads(line) for line in (tmp_path / "s.npz.eval.samples.jsonl").read_text().splitlines()]
    assert [r["vqascore"]["score"] for r in rows] == [0.25, 0.75]


def test_names_carry_the_sample_count():
    from dit_pipeline.evaluate.labels import t2i_metric_name

    assert [t2i_metric_name(s, n) for s, n in (("CLIPScore", 30_000), ("GenEval", 2212), ("DPG-Bench", 4260))] == \
        ["CLIPScore-30K", "GenEval-2212", "DPG-Bench-4260"]


def test_prompts_in_another_order_than_the_recorded_ones_are_refused(tmp_path):
    """Issue 47, bad case 6: `cat f f` in place of each prompt repeated has the right count; the samples' record
    names each sample's prompt, so the pairs are compared and the first differing index named, before any model."""
    np.savez(tmp_path / "s.npz", arr_0=np.zeros((4, 8, 8, 3), np.uint8))
    (tmp_path / "s.npz.json").write_text(json.dumps({"prompts": [{"prompt": "a dog"}, {"prompt": "a dog"},
                                                                 {"prompt": "a cat"}, {"prompt": "a cat"}]}))
    (tmp_path / "p.txt").write_text("a dog\na cat\na dog\na cat\n")
    r = CliRunner().invoke(eval_main, [str(tmp_path / "s.npz"), "--t2i", "clip-score", "--prompts",
                                       str(tmp_path / "p.txt"), "--clip", str(tmp_path / "no-clip"), "--json",
                                       str(tmp_path / "r.json"), "--quiet"])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert r.output.strip() == (f"error: --prompts {tmp_path / 'p.txt'}: sample 1 was generated from 'a dog' "
                                f"({tmp_path / 's.npz.json'}), but the file gives 'a cat'; give the prompts in the "
                                "samples' order (each prompt once per sample made from it), or drop --prompts to "
                                "score with the recorded ones")
    assert not (tmp_path / "r.json").exists()
    (tmp_path / "q.jsonl").write_text("".join(json.dumps({"prompt": p, "tag": "t"}) + "\n"
                                              for p in ("a dog", "a dog", "a cat", " a cat")))
    records, _ = sample_prompts(open_source(tmp_path / "s.npz", "SAMPLES"), str(tmp_path / "q.jsonl"))
    assert [r["tag"] for r in records] == ["t"] * 4  # the same prompts: the file's metadata is used
