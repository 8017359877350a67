"""Tiny RAE-shaped stand-ins: a DINOv2-architecture encoder (patch 14, 4 registers, width 32) saved as a JSON
encoder file + timm state_dict, and a ViT-MAE decoder saved in RAE's released key layout."""
from __future__ import annotations

import json
from pathlib import Path

import torch

TINY_ENCODER = {"embed_dim": 32, "depth": 2, "num_heads": 2}
TINY_INPUT = 56          # 4 x 4 tokens of patch 14
TINY_IMAGE = 32          # crops; resized bicubic to TINY_INPUT by the formula


def tiny_encoder_model(seed: int = 0):
    import timm

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = timm.create_model("vit_base_patch14_reg4_dinov2", pretrained=False, num_classes=0,
                                  img_size=TINY_INPUT, **TINY_ENCODER)
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():  # layer scales and norms of order 1: every part counts
                if name.endswith("gamma") or name.startswith("norm."):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if name == "norm.weight" else 0.0))
    return model.eval()


def make_tiny_encoder(folder: Path, seed: int = 0) -> Path:
    """folder/encoder.json naming folder/encoder.pth; returns the JSON path (`dit-extract --encoder PATH`)."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(tiny_encoder_model(seed).state_dict(), folder / "encoder.pth")
    spec = {"model": "vit_base_patch14_reg4_dinov2", "model_args": TINY_ENCODER, "input_size": TINY_INPUT,
            "weights": "encoder.pth"}
    (folder / "encoder.json").write_text(json.dumps(spec))
    return folder / "encoder.json"

TINY_DECODER = dict(hidden_size=48, num_layers=2, num_heads=3, mlp_size=96, patch_size=8)


def make_tiny_decoder(path: Path, in_channels: int = 32, grid: int = 4, seed: int = 0) -> Path:
    """A random tiny RAE decoder (width 48, 2 layers, patch 8: 4 x 4 tokens -> 32 px) saved in RAE's key layout,
    with a config.json beside it in RAE's (transformers ViTMAE) names; returns the weights' path."""
    from dit_pipeline.common.rae_decoder import DecoderConfig, RAEDecoder, save_rae_decoder

    c = DecoderConfig(in_channels=in_channels, num_patches=grid * grid, **TINY_DECODER)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = RAEDecoder(c)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / "config.json").write_text(json.dumps({
        "decoder_hidden_size": c.hidden_size, "decoder_num_hidden_layers": c.num_layers,
        "decoder_num_attention_heads": c.num_heads, "decoder_intermediate_size": c.mlp_size,
        "hidden_size": in_channels, "layer_norm_eps": 1e-12, "hidden_act": "gelu", "num_channels": 3,
        "patch_size": "SHOULD BE RELOADED"}))
    return save_rae_decoder(model, path)
