"""An independent transcription, for the tests only, of GenEval as NanoGen scores it, rule by rule from
End2End-Diffusion/diffusionbench-evals (commit 01c437f) `geneval/geneval_evaluator/`:

- `utils.py` lines 51-136 `post_process_instance_segmentation` (the candidates, their scores and masks),
- `evaluator.py` lines 94-132 `_detect_objects` (label mapping, 255-valued masks, boxes, skipping other labels),
- `utils.py` lines 250-257 `_mask_to_bbox`, 223-230 `_compute_iou`, 233-247 `_relative_position`,
- `evaluator.py` lines 135-163 `_filter_detections`, 42-91 `_evaluate_detections`, 282-338 `summarize_results`,
- `utils.py` lines 139-220 (`ImageCrops`, `_zero_shot_classifier`, `_run_classification`, `_color_classification`),
- `constants.py` lines 10 (COLORS), 12-23 (LABEL_MAPPING), 25-33 (DEFAULT_OPTIONS),
and `src/eval/generation.py` lines 180-183 + 51-61 of End2End-Diffusion/diffusion-bench (NanoGen's own number:
the sum of per-image `correct` over the count). Loops are kept as the release runs them, so the transcription
can be read against it line by line; it shares no code with dit_pipeline.
"""
from __future__ import annotations

import numpy as np
import torch

COLORS = ["red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white"]
MAPPING = {"motorbike": "motorcycle", "aeroplane": "airplane", "sofa": "couch", "pottedplant": "potted plant",
           "diningtable": "dining table", "tvmonitor": "tv", "mouse": "computer mouse", "remote": "tv remote",
           "keyboard": "computer keyboard"}
THRESHOLD, COUNTING_THRESHOLD, MAX_OBJECTS, MAX_OVERLAP, POSITION_THRESHOLD = 0.3, 0.9, 16, 1.0, 0.1


def candidates(class_logits, mask_logits, padded_hw, image_hw, threshold=THRESHOLD):
    """utils.py 51-136 for one image: [(label, score, mask float {0,1} [H, W])] in candidate order."""
    up = torch.nn.functional.interpolate(mask_logits[None], size=padded_hw, mode="bilinear", align_corners=False)[0]
    n_cls = class_logits.shape[-1] - 1
    n_q = class_logits.shape[-2]
    probs = torch.nn.functional.softmax(class_logits, dim=-1)[:, :-1]
    label_of = torch.arange(n_cls).unsqueeze(0).repeat(n_q, 1).flatten(0, 1)
    top_scores, top_idx = probs.flatten(0, 1).topk(n_q, sorted=False)
    labels = label_of[top_idx]
    query = torch.div(top_idx, n_cls, rounding_mode="floor")
    logits = up[query]
    binary = (logits > 0).float()
    mscore = (logits.sigmoid().flatten(1) * binary.flatten(1)).sum(1) / (binary.flatten(1).sum(1) + 1e-6)
    scores = top_scores * mscore
    binary = torch.nn.functional.interpolate(binary.unsqueeze(0), size=image_hw, mode="nearest")[0]
    out = []
    for j in range(n_q):
        s = scores[j].item()
        if not torch.all(binary[j] == 0) and s >= threshold:
            out.append((labels[j].item(), round(s, 6), binary[j]))
    return out


def box_of(mask):
    """utils.py 250-257."""
    rows, cols = np.any(mask, axis=1), np.any(mask, axis=0)
    if not np.any(rows) or not np.any(cols):
        return None
    y1, y2 = np.where(rows)[0][[0, -1]]
    x1, x2 = np.where(cols)[0][[0, -1]]
    return np.array([x1, y1, x2, y2], dtype=np.float32)


def detections(cands, id2label, classnames):
    """evaluator.py 94-132: {classname: [(box+score, mask uint8, score)]} for every classname."""
    out = {c: [] for c in classnames}
    for label, score, binary in cands:
        name = MAPPING.get(id2label[label], id2label[label])
        if name not in out:
            continue
        mask = (binary.numpy() * 255).astype(np.uint8)
        box = box_of(mask)
        if box is None:
            continue
        out[name].append((np.append(box, score), mask, score))
    return out


def iou(a, b):
    """utils.py 223-230."""
    def area(x):
        return max(x[2] - x[0] + 1, 0) * max(x[3] - x[1] + 1, 0)
    inter = area([max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])])
    union = area(a) + area(b) - inter
    return inter / union if union else 0


def keep(per_class, tag):
    """evaluator.py 135-163: {classname: [(box, mask)]} for the classes with any left."""
    floor = COUNTING_THRESHOLD if tag == "counting" else THRESHOLD
    out = {}
    for name, dets in per_class.items():
        dets = sorted(dets, key=lambda d: d[2], reverse=True)
        dets = [d for d in dets if d[2] > floor][:MAX_OBJECTS]
        kept = []
        for box, mask, _ in dets:
            if any(MAX_OVERLAP < 1 and iou(box, k[0]) >= MAX_OVERLAP for k in kept):
                continue
            kept.append((box, mask))
        if kept:
            out[name] = kept
    return out


def relations(a, b, threshold=POSITION_THRESHOLD):
    """utils.py 233-247, on two (box, mask) objects."""
    boxes = np.array([a[0], b[0]])[:, :4].reshape(2, 2, 2)
    ca, cb = boxes.mean(axis=-2)
    da, db = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    off = ca - cb
    rev = np.maximum(np.abs(off) - threshold * (da + db), 0) * np.sign(off)
    if np.all(np.abs(rev) < 1e-3):
        return set()
    dx, dy = rev / np.linalg.norm(off)
    rel = set()
    if dx < -0.5:
        rel.add("left of")
    if dx > 0.5:
        rel.add("right of")
    if dy < -0.5:
        rel.add("above")
    if dy > 0.5:
        rel.add("below")
    return rel


def correct(meta, objects, colors_of):
    """evaluator.py 42-91 (reasons left out); colors_of(classname, [(box, mask)]) -> [color]."""
    ok = True
    groups = []
    for req in meta.get("include", []):
        name, count = req["class"], req["count"]
        good = True
        found = objects.get(name, [])[:count]
        if len(found) < count:
            ok = good = False
        else:
            if "color" in req and colors_of(name, found).count(req["color"]) < count:
                ok = good = False
            if "position" in req and good:
                rel, target = req["position"]
                if groups[target] is None:
                    ok = good = False
                else:
                    for obj in found:
                        for other in groups[target]:
                            if rel not in relations(obj, other):
                                ok = good = False
                                break
                        if not good:
                            break
        groups.append(found if good else None)
    for req in meta.get("exclude", []):
        if len(objects.get(req["class"], [])) >= req["count"]:
            ok = False
    return ok


def summary(results):
    """evaluator.py 282-338 (the numbers) and generation.py 180-183 + 51-61 (NanoGen's: sum / count)."""
    tags = {}
    for r in results:
        tags.setdefault(r["tag"], []).append(float(r["correct"]))
    task = {t: float(np.mean(v)) for t, v in tags.items()}
    by_prompt = {}
    for r in results:
        by_prompt[r["metadata"]] = by_prompt.get(r["metadata"], False) or r["correct"]
    return {"nanogen": sum(float(r["correct"]) for r in results) / len(results), "tasks": task,
            "overall": float(np.mean(list(task.values()))), "correct_prompts": float(np.mean(list(by_prompt.values())))}


def colors_with(model, processor, image, name, objects):
    """utils.py 139-220 with a transformers CLIPModel and a PIL-backend CLIPProcessor (use_fast=False)."""
    from PIL import Image

    weights = []
    with torch.no_grad():
        for c in COLORS:
            texts = [f"a photo of a {c} {name}", f"a photo of a {c}-colored {name}", f"a photo of a {c} object"]
            t = processor(text=texts, return_tensors="pt", padding=True)
            e = model.get_text_features(input_ids=t["input_ids"], attention_mask=t["attention_mask"])
            e = getattr(e, "pooler_output", e)
            e = e / e.norm(dim=-1, keepdim=True)
            m = e.mean(dim=0)
            weights.append(m / m.norm())
        w = torch.stack(weights, dim=1)
        rgb = image.convert("RGB")
        blank = Image.new("RGB", image.size, color="#999")
        # tuple(): Pillow 13's crop compares the box with a tuple, which a numpy array cannot answer
        crops = [Image.composite(rgb, blank, Image.fromarray(mask)).crop(tuple(float(v) for v in box[:4]))
                 for box, mask in objects]
        px = processor(images=crops, return_tensors="pt", input_data_format="channels_last")["pixel_values"]
        f = model.get_image_features(pixel_values=px)
        f = getattr(f, "pooler_output", f)
        f = f / f.norm(dim=-1, keepdim=True)
        logits = model.logit_scale.exp() * (f @ w)
    return [COLORS[i.item()] for i in logits.argmax(1)]
