"""GenEval's scoring rules as NanoGen states them (diffusionbench-evals `geneval/geneval_evaluator/evaluator.py`
lines 42-91 and 135-163, `utils.py` lines 223-247, `constants.py` lines 25-33), on hand-built detections:
exact outcomes per task, argued from the rule in each case, then the same rules against the independent
transcription (tests/evaluate/_nanogen_geneval.py) on many random detections."""
from __future__ import annotations

import numpy as np
import pytest

from dit_pipeline.evaluate.geneval import Detection, filter_detections, judge, metadata_key, relation, summarize
from tests.evaluate import _nanogen_geneval as ref


def det(x1, y1, x2, y2, score):
    return Detection(np.array([x1, y1, x2, y2], np.float32), score, None)


def no_colors(cls, dets):
    raise AssertionError("no color asked")


def outcome(meta, found, colors=no_colors):
    return judge(meta, filter_detections(found, meta["tag"]), colors)[0]


DOG1 = {"tag": "single_object", "include": [{"class": "dog", "count": 1}], "prompt": "a photo of a dog"}
TWO = {"tag": "counting", "include": [{"class": "dog", "count": 2}], "exclude": [{"class": "dog", "count": 3}],
       "prompt": "a photo of two dogs"}


def test_single_object_needs_a_score_strictly_above_0_3():
    assert outcome(DOG1, {"dog": [det(0, 0, 9, 9, 0.31)]}) is True
    assert outcome(DOG1, {"dog": [det(0, 0, 9, 9, 0.3)]}) is False        # `> threshold`, not >=
    assert outcome(DOG1, {"cat": [det(0, 0, 9, 9, 0.99)]}) is False       # another class does not count
    assert outcome(DOG1, {"dog": [det(0, 0, 9, 9, 0.9), det(5, 5, 20, 20, 0.8)]}) is True  # extra ones are fine


def test_counting_uses_the_0_9_floor_for_both_include_and_exclude():
    assert outcome(TWO, {"dog": [det(0, 0, 5, 5, 0.95), det(9, 9, 15, 15, 0.92), det(0, 9, 5, 15, 0.5)]}) is True
    assert outcome(TWO, {"dog": [det(0, 0, 5, 5, 0.95), det(9, 9, 15, 15, 0.92), det(0, 9, 5, 15, 0.91)]}) is False
    assert outcome(TWO, {"dog": [det(0, 0, 5, 5, 0.95), det(9, 9, 15, 15, 0.85)]}) is False
    # the same detections under another tag use the 0.3 floor: three dogs then
    as_single = {**TWO, "tag": "two_object"}
    assert outcome(as_single, {"dog": [det(0, 0, 5, 5, 0.95), det(9, 9, 15, 15, 0.92), det(0, 9, 5, 15, 0.5)]}) \
        is False


def test_exclude_counts_at_most_16_detections():
    many = {"dog": [det(i, 0, i + 3, 3, 0.95 + i * 1e-3) for i in range(20)]}
    assert outcome({**TWO, "exclude": [{"class": "dog", "count": 17}]}, many) is True    # 16 kept < 17
    assert outcome({**TWO, "exclude": [{"class": "dog", "count": 16}]}, many) is False


def test_two_objects_need_both():
    meta = {"tag": "two_object", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}],
            "prompt": "a photo of a cat and a dog"}
    assert outcome(meta, {"cat": [det(0, 0, 5, 5, 0.5)]}) is False
    assert outcome(meta, {"cat": [det(0, 0, 5, 5, 0.5)], "dog": [det(0, 0, 5, 5, 0.4)]}) is True


POS = {"tag": "position", "include": [{"class": "teddy bear", "count": 1},
                                      {"class": "dog", "count": 1, "position": ["right of", 0]}],
       "prompt": "a photo of a dog right of a teddy bear"}


def test_position_by_shrunk_center_offsets():
    bear = det(0, 0, 10, 10, 0.8)
    assert outcome(POS, {"teddy bear": [bear], "dog": [det(20, 0, 30, 10, 0.8)]}) is True
    # offset 10 shrunk by 0.1 * (10 + 10) = 2 -> 8 of 10: dx = 0.8 > 0.5
    assert outcome(POS, {"teddy bear": [bear], "dog": [det(5, 0, 15, 10, 0.8)]}) is True
    # offset 1 shrunk to 0: no relation at all
    assert outcome(POS, {"teddy bear": [bear], "dog": [det(1, 0, 11, 10, 0.8)]}) is False
    assert outcome(POS, {"teddy bear": [bear], "dog": [det(-20, 0, -10, 10, 0.8)]}) is False  # left of
    assert outcome(POS, {"dog": [det(20, 0, 30, 10, 0.8)]}) is False   # no target found
    # diagonal: offset (10, 10) shrunk by 2 each -> (8, 8) / |(10, 10)| = 0.566 > 0.5 on both axes
    assert relation(np.array([20, 20, 30, 30.]), np.array([10, 10, 20, 20.])) == {"right of", "below"}
    # offset (10, 4): y shrunk to 2 -> 2 / 10.77 = 0.19, no vertical relation
    assert relation(np.array([20, 4, 30, 14.]), np.array([10, 0, 20, 10.])) == {"right of"}


def test_colors_are_counted_on_the_best_count_detections():
    meta = {"tag": "colors", "include": [{"class": "dog", "count": 1, "color": "red"}], "prompt": "a red dog"}
    found = {"dog": [det(0, 0, 5, 5, 0.4), det(0, 0, 5, 5, 0.9)]}
    asked = []

    def colors(cls, dets):
        asked.append((cls, [d.score for d in dets]))
        return ["red"] * len(dets)
    assert outcome(meta, found, colors) is True and asked == [("dog", [0.9])]  # only the best one is classified
    assert outcome(meta, found, lambda c, d: ["blue"]) is False
    attr = {"tag": "color_attr", "include": [{"class": "cat", "count": 1, "color": "red"},
                                             {"class": "dog", "count": 2, "color": "blue"}], "prompt": "x"}
    both = {"cat": [det(0, 0, 5, 5, 0.5)], "dog": [det(0, 0, 5, 5, 0.5), det(6, 6, 9, 9, 0.6)]}
    assert outcome(attr, both, lambda c, d: ["red"] if c == "cat" else ["blue", "blue"]) is True
    assert outcome(attr, both, lambda c, d: ["red"] if c == "cat" else ["blue", "green"]) is False


def test_summary_numbers():
    rows = [("single_object", True, "a"), ("single_object", False, "b"), ("counting", True, "c"),
            ("colors", False, "d"), ("colors", False, "d"), ("colors", True, "e")]
    per = [{"tag": t, "correct": c, "key": k} for t, c, k in rows]
    s = summarize(per)
    assert s["value"] == 3 / 6                                   # NanoGen's number: correct images
    assert s["tasks"] == {"single_object": 0.5, "counting": 1.0, "colors": 1 / 3}
    assert s["overall"] == pytest.approx((0.5 + 1.0 + 1 / 3) / 3, rel=1e-15)  # GenEval's: mean of tasks
    assert (s["prompts"], s["correct_prompts"]) == (5, 3 / 5)   # a, c, e of a..e
    theirs = ref.summary([{"tag": t, "correct": c, "metadata": k} for t, c, k in rows])
    assert (theirs["nanogen"], theirs["tasks"], theirs["overall"], theirs["correct_prompts"]) == \
        (s["value"], s["tasks"], s["overall"], s["correct_prompts"])


def test_metadata_key_ignores_extra_keys():
    assert metadata_key({**DOG1, "file": "x.png"}) == metadata_key(DOG1)


def test_rules_equal_the_transcription_on_random_detections():
    rng = np.random.default_rng(0)
    classes = ["dog", "cat", "teddy bear"]
    metas = [DOG1, TWO, POS,
             {"tag": "position", "include": [{"class": "cat", "count": 2},
                                             {"class": "dog", "count": 1, "position": ["above", 0]}], "prompt": "p"},
             {"tag": "colors", "include": [{"class": "cat", "count": 2, "color": "red"}], "prompt": "q"},
             {"tag": "two_object", "include": [{"class": "cat", "count": 1}, {"class": "teddy bear", "count": 1}],
              "exclude": [{"class": "dog", "count": 1}], "prompt": "r"}]
    agree = outcomes = 0
    for trial in range(400):
        found, theirs = {}, {c: [] for c in classes}
        for c in classes:
            for _ in range(rng.integers(0, 5)):
                x, y = rng.integers(0, 40, 2)
                w, h = rng.integers(1, 20, 2)
                score = float(np.round(rng.choice([rng.uniform(0, 1), 0.3, 0.9]), 6))
                d = det(x, y, x + w, y + h, score)
                found.setdefault(c, []).append(d)
                theirs[c].append((np.append(d.box, score), None, score))
        meta = metas[trial % len(metas)]
        palette = ["red", "blue"]
        color_fn = lambda c, d: [palette[int(x.box[0]) % 2] for x in d]  # noqa: E731
        mine = judge(meta, filter_detections(found, meta["tag"]), color_fn)[0]
        kept = ref.keep(theirs, meta["tag"])
        expected = ref.correct(meta, kept, lambda c, objs: [palette[int(b[0]) % 2] for b, _ in objs])
        agree += mine == expected
        outcomes += mine
    assert agree == 400 and 0 < outcomes < 400   # both outcomes occur
