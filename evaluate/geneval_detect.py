"""GenEval's detector and color classifier as NanoGen runs them (End2End-Diffusion/diffusionbench-evals
`geneval/geneval_evaluator/evaluator.py` `_detect_objects`, `utils.py` `post_process_instance_segmentation`,
`ImageCrops`, `_zero_shot_classifier`, `_color_classification`), written from those facts:

- `facebook/mask2former-swin-small-coco-instance` through transformers (`Mask2FormerForUniversalSegmentation`
  and its image processor at shortest edge 800, longest edge 1333);
- post-processing: mask logits upsampled (bilinear) to the processed input size; class probabilities (softmax,
  "no object" dropped) of every (query, class) pair, the best `num_queries` pairs; a pair's mask is its query's
  logits > 0, its score the class probability times the mean sigmoid inside that mask; masks resized (nearest)
  to the image; a pair is a detection when its mask is not empty and its score (rounded to 6 decimals) is at
  least the threshold; its box spans the mask's first and last rows and columns;
- the model's label names mapped to GenEval's COCO names (`LABEL_MAPPING`), other labels ignored;
- color: the object's masked crop (the mask's box, the rest #999) classified by CLIP among 10 colors against
  the mean of three templates' unit text embeddings, per class.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.evaluate.clip import Clip, load_clip
from dit_pipeline.evaluate.geneval import (COLOR_TEMPLATES, COLORS, Detection, Options, filter_detections, judge,
                                          metadata_key, summarize)

DEFAULT_DETECTOR = "facebook/mask2former-swin-small-coco-instance"
DETECTOR_SIZE = {"shortest_edge": 800, "longest_edge": 1333}
DETECT_BATCH = 8  # images per Mask2Former forward (the masks of one image at 800 px take ~256 MB)
# GenEval's class names: COCO's 80, with "computer mouse", "tv remote", "computer keyboard"
COCO_CLASSES = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "computer mouse", "tv remote",
    "computer keyboard", "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock",
    "vase", "scissors", "teddy bear", "hair drier", "toothbrush")
# the detector's label names (Pascal-style or COCO's short ones) -> GenEval's names
LABEL_MAPPING = {"motorbike": "motorcycle", "aeroplane": "airplane", "sofa": "couch", "pottedplant": "potted plant",
                 "diningtable": "dining table", "tvmonitor": "tv", "mouse": "computer mouse", "remote": "tv remote",
                 "keyboard": "computer keyboard"}


def post_process(class_logits: torch.Tensor, mask_logits: torch.Tensor, input_hw: tuple[int, int],
                 image_hw: tuple[int, int], threshold: float) -> list[tuple[int, float, torch.Tensor]]:
    """One image's detections [(label id, score, bool mask [H, W] at image_hw)] from class logits [Q, C + 1] and
    mask logits [Q, h, w] (see the module docstring), in the order of the candidates' scores."""
    masks = torch.nn.functional.interpolate(mask_logits[None].float(), size=input_hw, mode="bilinear",
                                            align_corners=False)[0]
    q, c = class_logits.shape[0], class_logits.shape[1] - 1
    probs = class_logits.float().softmax(-1)[:, :-1]
    top, idx = probs.flatten().topk(q, sorted=True)
    labels, queries = idx % c, torch.div(idx, c, rounding_mode="floor")
    chosen = masks[queries]
    binary = (chosen > 0).float()
    mask_score = (chosen.sigmoid().flatten(1) * binary.flatten(1)).sum(1) / (binary.flatten(1).sum(1) + 1e-6)
    scores = top * mask_score
    resized = torch.nn.functional.interpolate(binary[None], size=image_hw, mode="nearest")[0] > 0
    out = []
    for j in range(q):
        score = round(float(scores[j]), 6)
        if score >= threshold and bool(resized[j].any()):
            out.append((int(labels[j]), score, resized[j]))
    return out


def mask_box(mask: np.ndarray) -> np.ndarray | None:
    """[x1, y1, x2, y2] (float32) of the first and last rows and columns a mask covers; None when empty."""
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    if not len(rows) or not len(cols):
        return None
    return np.array([cols[0], rows[0], cols[-1], rows[-1]], np.float32)


class Detector:
    def __init__(self, model: Any, processor: Any, device: torch.device, identity: dict[str, Any]):
        self.model, self.processor, self.device, self.identity = model, processor, device, identity
        names = model.config.id2label
        self.names = {int(i): LABEL_MAPPING.get(n, n) for i, n in names.items()}

    @torch.no_grad()
    def detect(self, images: Sequence[Any], opts: Options = Options()) -> list[dict[str, list[Detection]]]:
        """Per RGB PIL image: {GenEval class: [Detection]} (classes without one absent)."""
        out: list[dict[str, list[Detection]]] = []
        for i in range(0, len(images), DETECT_BATCH):
            chunk = images[i:i + DETECT_BATCH]
            inputs = self.processor(images=list(chunk), return_tensors="pt", size=dict(DETECTOR_SIZE))
            pixels = inputs["pixel_values"].to(self.device)
            kwargs = {"pixel_mask": inputs["pixel_mask"].to(self.device)} if "pixel_mask" in inputs else {}
            res = self.model(pixel_values=pixels, **kwargs)
            for k, im in enumerate(chunk):
                found: dict[str, list[Detection]] = {}
                for label, score, mask in post_process(res.class_queries_logits[k], res.masks_queries_logits[k],
                                                       tuple(pixels.shape[-2:]), (im.height, im.width),
                                                       opts.threshold):
                    name = self.names.get(label)
                    if name not in COCO_CLASSES:
                        continue
                    m = mask.cpu().numpy().astype(np.uint8) * 255
                    box = mask_box(m)
                    if box is not None:
                        found.setdefault(name, []).append(Detection(box, score, m))
                out.append(found)
        return out


def load_detector(spec: str, device: torch.device | str = "cpu") -> Detector:
    from transformers import AutoImageProcessor, Mask2FormerForUniversalSegmentation

    try:
        model = Mask2FormerForUniversalSegmentation.from_pretrained(spec)
        processor = AutoImageProcessor.from_pretrained(spec)
    except (OSError, ValueError, ImportError) as e:
        raise UserError(f"--detector {spec}: cannot load a Mask2Former model and its image processor from it "
                        f"({str(e).splitlines()[0][:300]}); give a hub id such as {DEFAULT_DETECTOR} or a folder "
                        "written by save_pretrained") from None
    dev = torch.device(device)
    model = model.float().eval().to(dev)
    model.requires_grad_(False)
    ident = {"name": spec, "class": type(model).__name__, "processor": type(processor).__name__,
             "num_queries": int(model.config.num_queries), "labels": len(model.config.id2label),
             "size": dict(DETECTOR_SIZE), "commit": getattr(model.config, "_commit_hash", None)}
    return Detector(model, processor, dev, ident)


class ColorClassifier:
    """CLIP's zero-shot color of detected objects (see the module docstring); classifiers cached per class."""

    def __init__(self, clip: Clip, opts: Options = Options()):
        self.clip, self.opts = clip, opts
        self._weights: dict[str, torch.Tensor] = {}

    def weights(self, cls: str) -> torch.Tensor:
        """[D, 10]: per color the normalized mean of its templates' unit text embeddings."""
        if cls not in self._weights:
            cols = []
            for c in COLORS:
                e = self.clip.text_embeds([t.format(c=c, cls=cls) for t in COLOR_TEMPLATES], truncation=False)
                m = e.mean(dim=0)
                cols.append(m / m.norm())
            self._weights[cls] = torch.stack(cols, dim=1)
        return self._weights[cls]

    def crops(self, image: Any, dets: Sequence[Detection]) -> list[Any]:
        from PIL import Image

        rgb = image.convert("RGB")
        blank = rgb.copy() if self.opts.bgcolor == "original" else Image.new("RGB", rgb.size, color=self.opts.bgcolor)
        out = []
        for d in dets:
            im = Image.composite(rgb, blank, Image.fromarray(d.mask)) if d.mask is not None else rgb
            if self.opts.crop:
                x1, y1, x2, y2 = (int(round(float(v))) for v in d.box[:4])
                # PIL's crop excludes x2 and y2 (as NanoGen's does); a one-pixel-wide box would be empty there
                im = im.crop((x1, y1, max(x2, x1 + 1), max(y2, y1 + 1)))
            out.append(im)
        return out

    @torch.no_grad()
    def __call__(self, image: Any, cls: str, dets: Sequence[Detection]) -> list[str]:
        feats = self.clip.image_embeds(self.clip.pixels_pil(self.crops(image, dets)))
        logits = self.clip.model.logit_scale.exp() * (feats @ self.weights(cls))
        return [COLORS[int(i)] for i in logits.argmax(dim=1)]


class GenevalScorer:
    """GenEval over images: detection, filtering and the rules (evaluate/geneval.py), colors by CLIP."""

    def __init__(self, detector: str, clip: str, device: str, opts: Options = Options()):
        self.opts = opts
        self.detector = load_detector(detector, device)
        self.colors = ColorClassifier(load_clip(clip, device), opts)
        self.identity = {"detector": self.detector.identity, "clip": self.colors.clip.identity,
                         "options": dataclasses.asdict(opts)}

    def score(self, images: np.ndarray, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        from PIL import Image

        pils = [Image.fromarray(np.ascontiguousarray(i)) for i in images]
        out = []
        for im, rec, found in zip(pils, records, self.detector.detect(pils, self.opts)):
            kept = filter_detections(found, rec.get("tag", ""), self.opts)

            def colors_of(cls: str, dets: Sequence[Detection], im: Any = im) -> list[str]:
                return self.colors(im, cls, dets)
            ok, reasons = judge(rec, kept, colors_of, self.opts)
            out.append({"correct": ok, "tag": rec["tag"], "key": metadata_key(rec), "reasons": reasons,
                        "boxes": {c: [[float(v) for v in d.box] + [d.score] for d in ds] for c, ds in kept.items()}})
        return out

    summarize = staticmethod(summarize)
