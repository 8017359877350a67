"""Tiny random stand-ins for the text-to-image evaluators' models, saved with save_pretrained so the real
loading code runs: a CLIP (ViT 32 px, text tower with a word-level tokenizer built with `tokenizers`) and a
Mask2Former (Swin backbone, 6 queries, GenEval's 80 COCO classes) whose class head is tilted towards "dog" and
"cat" so that random images give a mix of detections."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from dit_pipeline.evaluate.geneval_detect import COCO_CLASSES

WORDS = ("a photo of the an and two three four right left above below red orange yellow green blue purple pink "
         "brown black white colored object dog cat teddy bear dogs cats kite").split()


def make_tiny_clip(folder: Path, seed: int = 0, image_size: int = 32, max_length: int = 12) -> Path:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, PreTrainedTokenizerFast

    specials = ["<|startoftext|>", "<|endoftext|>", "[UNK]"]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(list(WORDS) + specials))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    bos, eos = vocab["<|startoftext|>"], vocab["<|endoftext|>"]
    tok.post_processor = processors.TemplateProcessing(single="<|startoftext|> $A <|endoftext|>",
                                                       special_tokens=[("<|startoftext|>", bos), ("<|endoftext|>", eos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|startoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", unk_token="[UNK]", model_max_length=max_length,
                                   model_input_names=["input_ids", "attention_mask"])  # CLIP's (no token_type_ids)
    cfg = CLIPConfig(text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, max_position_embeddings=max_length, bos_token_id=bos,
                                      eos_token_id=eos, pad_token_id=eos),
                     vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                        image_size=image_size, patch_size=8), projection_dim=16)
    torch.manual_seed(seed)
    CLIPModel(cfg).save_pretrained(folder)
    fast.save_pretrained(folder)
    CLIPImageProcessor(size={"shortest_edge": image_size},
                       crop_size={"height": image_size, "width": image_size}).save_pretrained(folder)
    return folder


def make_tiny_mask2former(folder: Path, seed: int = 0) -> Path:
    from transformers import (Mask2FormerConfig, Mask2FormerForUniversalSegmentation, Mask2FormerImageProcessor,
                              SwinConfig)

    backbone = SwinConfig(image_size=224, patch_size=4, embed_dim=8, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1],
                          window_size=7, out_features=["stage1", "stage2", "stage3", "stage4"])
    names = {i: n for i, n in enumerate(COCO_CLASSES)}
    names[62] = "tvmonitor"  # a Pascal-style name GenEval maps back ("tv")
    cfg = Mask2FormerConfig(backbone_config=backbone, feature_size=32, mask_feature_size=32, hidden_dim=32,
                            encoder_feedforward_dim=32, dim_feedforward=32, encoder_layers=1, decoder_layers=2,
                            num_attention_heads=2, num_queries=6, id2label=names,
                            label2id={n: i for i, n in names.items()})
    torch.manual_seed(seed)
    model = Mask2FormerForUniversalSegmentation(cfg).eval()
    with torch.no_grad():
        bias = model.class_predictor.bias
        bias.fill_(-5.0)
        bias[COCO_CLASSES.index("dog")], bias[COCO_CLASSES.index("cat")], bias[-1] = 4.0, 3.0, 0.0
        model.class_predictor.weight.normal_(0, 1.0)
        for p in model.model.transformer_module.decoder.mask_predictor.mask_embedder.layers[-1].parameters():
            p.mul_(10.0)  # confident masks: mask scores near 1, so some detections pass 0.9
    model.save_pretrained(folder)
    Mask2FormerImageProcessor().save_pretrained(folder)
    return folder


def shapes(n: int, size: int, seed: int) -> np.ndarray:
    """n images of a flat background with one square of another color: uint8 [n, size, size, 3]."""
    rng = np.random.default_rng(seed)
    out = np.zeros((n, size, size, 3), np.uint8)
    for k in range(n):
        out[k] = rng.integers(0, 256, 3)
        y, x = rng.integers(0, size * 5 // 8, 2)
        out[k, y:y + size * 3 // 8, x:x + size * 3 // 8] = rng.integers(0, 256, 3)
    return out


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
