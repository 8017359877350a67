"""NanoGen's Inception network (evaluate/protocols.py, `nanogen`): torch-fidelity's `inception-v3-compat`, run as
End2End-Diffusion/diffusion-bench `src/eval/fid.py` runs it: uint8 NCHW in, its `2048` (pool) and
`logits_unbiased` (the 1008 logits without the bias) out.

torch-fidelity is an optional extra (`pip install 'dit-pipeline[fidelity]'`); without it `--protocol nanogen` is
refused with that line. Its extractor reads a weights file with `torch.load(weights_only=False)`, so the file is
first read here with `weights_only=True` (the same bytes then unpickle to the same tensors, and nothing else) and
refused if that fails. Random weights (`--random-inception`, a smoke test) are ours (evaluate/inception.py,
`randomize_`: the same module names) written to a temporary file for it.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import missing_file, sha256_file
from dit_pipeline.evaluate import inception as inc

EXTRA = "pip install 'dit-pipeline[fidelity]'"


class FidelityFeatures(nn.Module):
    """uint8 [N, H, W, 3] -> {"pool": [N, 2048], "logits": [N, 1008]} through torch-fidelity's extractor."""

    def __init__(self, extractor: nn.Module):
        super().__init__()
        self.extractor = extractor

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(f"expected uint8 images [N, H, W, 3], got {images.dtype} {list(images.shape)}")
        pool, logits = self.extractor(images.permute(0, 3, 1, 2).contiguous())  # NanoGen: NHWC -> NCHW, uint8
        return {"pool": pool.float(), "logits": logits.float()}


def _import_extractor() -> Any:
    try:
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3
    except ImportError:
        raise UserError(f"--protocol nanogen runs torch-fidelity's inception-v3-compat, which is not installed: "
                        f"{EXTRA}") from None
    return FeatureExtractorInceptionV3


def _weights_file(path: str | Path | None) -> Path:
    """The published weights file (checked to load with weights_only=True), fetched into the hub cache if needed."""
    file = Path(path).expanduser() if path is not None else inc._fetch()
    if not file.is_file():
        raise inc._missing_weights(f"--inception {file}: {missing_file(file)}")
    model = inc.InceptionFeatures()
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise UserError(f"--inception {file} is not a readable PyTorch weights file ({type(e).__name__}); "
                        f"expected {inc.WEIGHTS_FILE}") from None
    inc._load_state(model, state, file)  # the same tensors torch-fidelity's module takes
    return file


def load_fidelity_inception(path: str | Path | None = None, *, device: torch.device | str = "cpu",
                            random_seed: int | None = None,
                            input_size: int = inc.INPUT_SIZE) -> tuple[nn.Module, dict[str, Any]]:
    """torch-fidelity's network and its identity (the keys of evaluate.inception.load_inception's)."""
    extractor_cls = _import_extractor()
    import torch_fidelity

    common = {"network": inc.NETWORK, "implementation": f"torch-fidelity {torch_fidelity.__version__} "
              "inception-v3-compat", "input_size": input_size, "resize": "tf1"}
    version = f"torch-fidelity-inception-v3-compat.v1" + ("" if input_size == inc.INPUT_SIZE else f".input{input_size}")
    if random_seed is not None:
        with tempfile.TemporaryDirectory() as tmp:
            file = Path(tmp) / "random-inception.pth"
            torch.save(inc.randomize_(inc.InceptionFeatures(), random_seed).state_dict(), file)
            net = extractor_cls("inception-v3-compat", ["2048", "logits_unbiased"],
                                feature_extractor_weights_path=str(file))
        ident = {"extractor": version, "weights": f"random-seed-{random_seed}", "weights_sha256": None,
                 "random_seed": random_seed, **common}
    else:
        file = _weights_file(path)
        net = extractor_cls("inception-v3-compat", ["2048", "logits_unbiased"],
                            feature_extractor_weights_path=str(file))
        ident = {"extractor": version, "weights": file.name, "weights_sha256": sha256_file(file), "random_seed": None,
                 **common}
    if input_size != inc.INPUT_SIZE:
        net.INPUT_IMAGE_SIZE = input_size  # test knob, as evaluate/inception.py's (299 for every real number)
    return FidelityFeatures(net).to(device), ident
