"""Tiny DiT checkpoints of every kind dit-sample reads, for the sampling tests.

The tiny DiT (depth 2, hidden 32, 2 heads, 4x4x4 latents, 10 classes) has random weights everywhere
except the fixed pos_embed table (a fresh DiT outputs zeros, which would make every test trivial).
With the tiny VAE (8x upsampling, scaling_factor 0.5) it yields 32x32 images.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from dit_pipeline import dit

TINY = dict(depth=2, hidden_size=32, num_heads=2)
LATENT = {"scaling_factor": 0.5, "shift_factor": None, "vae": {"source": "tiny"}}


def random_dit(seed: int, *, name: str = "DiT-S/2", input_size: int = 4, num_classes: int = 10,
               std: float = 0.2, tiny: bool = True, **overrides) -> dit.DiT:
    """A DiT (tiny dimensions unless tiny=False) with every trainable tensor drawn from N(0, std);
    pos_embed stays the sin-cos table."""
    kw = {**TINY, **overrides} if tiny else overrides
    model = dit.create_model(name, input_size=input_size, num_classes=num_classes, **kw)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname != "pos_embed":
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model.eval()


def our_checkpoint(model: dit.DiT, ema: dit.DiT, step: int = 100, latent: dict | None = None) -> dict:
    """A checkpoint in docs/ARCHITECTURE.md's format (only plain types, loads with weights_only)."""
    return {
        "format": "dit-pipeline.checkpoint", "version": 1,
        "model": model.state_dict(), "ema": ema.state_dict(), "opt": {}, "scaler": None,
        "step": step, "epoch": 0, "data": {"position": 0}, "rng": {},
        "model_config": {**model.config}, "latent": dict(latent or LATENT), "config": {"seed": 0},
        "manifest_fingerprint": "0" * 64,
    }


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """Checkpoint files: "ours" (model != ema weights), "bare" (a bare state_dict as in the official release
    files and our step-N-ema.pt, of a preset-sized DiT-S/8), "reference" ({model, ema, opt, args=Namespace}),
    "pickle" (an arbitrary pickled object: must be refused)."""
    root = tmp_path_factory.mktemp("ckpts")
    paths = {k: root / f"{k}.pt" for k in ("ours", "bare", "reference", "pickle")}
    paths["bare"] = root / "DiT-S-8.pt"  # named as DiT's release files (DiT-XL-2-256x256.pt): a ddpm model
    torch.save(our_checkpoint(random_dit(1), random_dit(2)), paths["ours"])
    # Bare state_dicts carry no head count, so they need preset dimensions: DiT-S/8 on 8x8 latents
    # (one token), stored in bfloat16 to keep the file small.
    s8 = random_dit(3, name="DiT-S/8", input_size=8, std=0.05, tiny=False)
    torch.save({k: v.to(torch.bfloat16) for k, v in s8.state_dict().items()}, paths["bare"])
    args = argparse.Namespace(model="DiT-S/2", image_size=32, num_classes=10, global_batch_size=256,
                              results_dir="results", epochs=1400)
    reference_model = random_dit(4, hidden_size=48, num_heads=6)  # heads come from args.model's preset
    torch.save({"model": random_dit(5, hidden_size=48, num_heads=6).state_dict(),
                "ema": reference_model.state_dict(), "opt": {}, "args": args}, paths["reference"])
    torch.save({"ema": random_dit(1).state_dict(), "payload": Path("/etc/passwd")}, paths["pickle"])
    return paths
