"""The InceptionV3 of the TensorFlow FID graph (`inception-2015-12-05`), in PyTorch, with the three outputs the
ADM evaluator reads (openai/guided-diffusion `evaluations/evaluator.py`).

- `pool`: the 2048 `pool_3` features (FID, precision/recall);
- `spatial`: the first 7 of the 192 channels of `mixed_6/conv` (the 1x1 branch of the fourth 17x17 block,
  torchvision's `Mixed_6d.branch1x1`, after its ReLU), flattened in TensorFlow's NHWC order, 17*17*7 = 2023
  values (sFID; the order matters because the ADM reference batches store `mu_s`/`sigma_s` in it);
- `logits`: pool features times the `softmax/logits` weights **without** the bias, 1008 classes (the
  Inception Score input, as the ADM evaluator and OpenAI's original IS code take it).

Images enter as uint8 NHWC [0, 255] of any size and are resized to 299x299 with TensorFlow 1.x's bilinear rule
(`resize_bilinear`, align_corners=False: source = destination * in/out, no half-pixel offset), then mapped to
[-1, 1] as (x - 128) / 128, as inside the TF graph. `resize="imf"` resizes as iMF's evaluation does instead
(`imf_resize`, evaluate/protocols.py). The network follows the TF graph's deviations from the
paper, documented by pytorch-fid and torch-fidelity: average pools ignore padding, the last block max-pools.

Weights: the TF graph's parameters converted to a PyTorch state_dict, published by torch-fidelity as
`weights-inception-2015-12-05-6726825d.pth` (the same tensors as pytorch-fid's `pt_inception-2015-12-05-
6726825d.pth`). Module names follow that file. `load_inception(path)` reads a local copy with
`torch.load(weights_only=True)`; without a path it is fetched once into torch's hub cache. No network and no
file: one `UserError` saying which file to download and where to put it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import missing_file, sha256_file
from dit_pipeline.evaluate.config import INPUT_SIZE

WEIGHTS_FILE = "weights-inception-2015-12-05-6726825d.pth"
WEIGHTS_URL = f"https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/{WEIGHTS_FILE}"
# Bump when anything changes what `InceptionFeatures` returns for the same pixels; cached features carry it.
EXTRACTOR_VERSION = "tf-inception-2015-12-05.v1"
NETWORK = "inception-2015-12-05"  # the TF graph whose weights every FID protocol here runs (by whatever code)
# torch.hub names a file by the first 8 hex digits of its sha256: the published weights' hash starts so
PUBLISHED_SHA256_PREFIX = "6726825d"
RESIZES = ("tf1", "imf")
SPATIAL_CHANNELS = 7
POOL_DIM, SPATIAL_DIM, LOGITS_DIM = 2048, 17 * 17 * SPATIAL_CHANNELS, 1008


def tf1_resize_bilinear(x: torch.Tensor, size: int) -> torch.Tensor:
    """[N, C, H, W] float -> [N, C, size, size], TensorFlow 1.x `resize_bilinear` (align_corners=False)."""
    n, c, h, w = x.shape

    def axis(in_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scale = torch.tensor(in_len / size, dtype=torch.float32)
        src = torch.arange(size, dtype=torch.float32) * scale
        lo = src.floor().long()
        hi = (lo + 1).clamp(max=in_len - 1)
        return lo.to(x.device), hi.to(x.device), (src - lo.float()).to(x.device, x.dtype)

    y_lo, y_hi, y_frac = axis(h)
    x_lo, x_hi, x_frac = axis(w)
    top, bottom = x[:, :, y_lo, :], x[:, :, y_hi, :]
    top = top[..., x_lo] + (top[..., x_hi] - top[..., x_lo]) * x_frac
    bottom = bottom[..., x_lo] + (bottom[..., x_hi] - bottom[..., x_lo]) * x_frac
    return top + (bottom - top) * y_frac[:, None]


def imf_resize(x: torch.Tensor, size: int) -> torch.Tensor:
    """[N, C, H, W] float -> [N, C, size, size] as Lyy-iiis/imeanflow `utils/jax_fid/resize.py` resizes: an
    identity affine grid through `grid_sample` (bilinear, border padding, align_corners=False). That file
    computes the TF1 offset 1/W - 1/size for the grid's translation but never writes it into theta (`torch.add`,
    not `add_`), so its sampling is the half-pixel rule (source = (dst + 0.5) * in / out - 0.5, clamped to the
    border), not TF1's (source = dst * in / out)."""
    n, c = x.shape[:2]
    theta = torch.eye(2, 3, dtype=x.dtype, device=x.device).unsqueeze(0).repeat(n, 1, 1)
    grid = F.affine_grid(theta, [n, c, size, size], align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


class BasicConv2d(nn.Module):
    """Conv (no bias) -> BatchNorm (eps 1e-3, the TF graph's) -> ReLU."""

    def __init__(self, cin: int, cout: int, kernel: int | tuple[int, int], stride: int = 1,
                 padding: int | tuple[int, int] = 0):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


def _avg_pool(x: torch.Tensor) -> torch.Tensor:
    return F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)  # TF averages real pixels only


class InceptionA(nn.Module):
    """35x35 block: 1x1 | 1x1-5x5 | 1x1-3x3-3x3 | avgpool-1x1."""

    def __init__(self, cin: int, pool_features: int):
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, 64, 1)
        self.branch5x5_1 = BasicConv2d(cin, 48, 1)
        self.branch5x5_2 = BasicConv2d(48, 64, 5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, 1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, padding=1)
        self.branch_pool = BasicConv2d(cin, pool_features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b5 = self.branch5x5_2(self.branch5x5_1(x))
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([self.branch1x1(x), b5, b3, self.branch_pool(_avg_pool(x))], 1)


class InceptionB(nn.Module):
    """35x35 -> 17x17 reduction: 3x3/2 | 1x1-3x3-3x3/2 | maxpool/2."""

    def __init__(self, cin: int):
        super().__init__()
        self.branch3x3 = BasicConv2d(cin, 384, 3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, 1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([self.branch3x3(x), b3, F.max_pool2d(x, 3, stride=2)], 1)


class InceptionC(nn.Module):
    """17x17 block with factorised 7x7 convolutions; `branch1x1` of the fourth one is TF's `mixed_6/conv`."""

    def __init__(self, cin: int, c7: int):
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, 192, 1)
        self.branch7x7_1 = BasicConv2d(cin, c7, 1)
        self.branch7x7_2 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7_3 = BasicConv2d(c7, 192, (7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = BasicConv2d(cin, c7, 1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = BasicConv2d(c7, 192, (1, 7), padding=(0, 3))
        self.branch_pool = BasicConv2d(cin, 192, 1)

    def forward(self, x: torch.Tensor, keep: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        b1 = self.branch1x1(x)
        if keep is not None:
            keep["branch1x1"] = b1
        b7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        d = x
        for layer in (self.branch7x7dbl_1, self.branch7x7dbl_2, self.branch7x7dbl_3, self.branch7x7dbl_4,
                      self.branch7x7dbl_5):
            d = layer(d)
        return torch.cat([b1, b7, d, self.branch_pool(_avg_pool(x))], 1)


class InceptionD(nn.Module):
    """17x17 -> 8x8 reduction."""

    def __init__(self, cin: int):
        super().__init__()
        self.branch3x3_1 = BasicConv2d(cin, 192, 1)
        self.branch3x3_2 = BasicConv2d(192, 320, 3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(cin, 192, 1)
        self.branch7x7x3_2 = BasicConv2d(192, 192, (1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(192, 192, (7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(192, 192, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3_2(self.branch3x3_1(x))
        b7 = self.branch7x7x3_4(self.branch7x7x3_3(self.branch7x7x3_2(self.branch7x7x3_1(x))))
        return torch.cat([b3, b7, F.max_pool2d(x, 3, stride=2)], 1)


class InceptionE(nn.Module):
    """8x8 block with split 1x3/3x1 outputs; the TF graph's last block max-pools where the paper averages."""

    def __init__(self, cin: int, max_pool: bool):
        super().__init__()
        self.max_pool = max_pool
        self.branch1x1 = BasicConv2d(cin, 320, 1)
        self.branch3x3_1 = BasicConv2d(cin, 384, 1)
        self.branch3x3_2a = BasicConv2d(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(384, 384, (3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(cin, 448, 1)
        self.branch3x3dbl_2 = BasicConv2d(448, 384, 3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(384, 384, (3, 1), padding=(1, 0))
        self.branch_pool = BasicConv2d(cin, 192, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3_1(x)
        b3 = torch.cat([self.branch3x3_2a(b3), self.branch3x3_2b(b3)], 1)
        d = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        d = torch.cat([self.branch3x3dbl_3a(d), self.branch3x3dbl_3b(d)], 1)
        pooled = F.max_pool2d(x, 3, stride=1, padding=1) if self.max_pool else _avg_pool(x)
        return torch.cat([self.branch1x1(x), b3, d, self.branch_pool(pooled)], 1)


class InceptionFeatures(nn.Module):
    """uint8 images [N, H, W, 3] -> {"pool": [N, 2048], "spatial": [N, 2023], "logits": [N, 1008]} (float32)."""

    def __init__(self, input_size: int = INPUT_SIZE, resize: str = "tf1") -> None:
        super().__init__()
        if input_size < 75:
            raise ValueError(f"InceptionV3 needs inputs of at least 75x75, got {input_size}")
        if resize not in RESIZES:
            raise ValueError(f"resize must be one of {RESIZES}, got {resize!r}")
        self.input_size = input_size  # 299 for every real use; smaller only to make plumbing tests cheap
        self.resize = resize
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, 3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, 3)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, 3, padding=1)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, 1)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, 3)
        self.Mixed_5b = InceptionA(192, 32)
        self.Mixed_5c = InceptionA(256, 64)
        self.Mixed_5d = InceptionA(288, 64)
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b = InceptionC(768, 128)
        self.Mixed_6c = InceptionC(768, 160)
        self.Mixed_6d = InceptionC(768, 160)
        self.Mixed_6e = InceptionC(768, 192)
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b = InceptionE(1280, max_pool=False)
        self.Mixed_7c = InceptionE(2048, max_pool=True)
        self.fc = nn.Linear(2048, 1008)
        self.requires_grad_(False)
        self.eval()

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(f"expected uint8 images [N, H, W, 3], got {images.dtype} {list(images.shape)}")
        x = images.permute(0, 3, 1, 2).float()
        resized = tf1_resize_bilinear(x, self.input_size) if self.resize == "tf1" else imf_resize(x, self.input_size)
        x = (resized - 128) / 128
        for name in ("Conv2d_1a_3x3", "Conv2d_2a_3x3", "Conv2d_2b_3x3"):
            x = getattr(self, name)(x)
        x = F.max_pool2d(x, 3, stride=2)
        x = F.max_pool2d(self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x)), 3, stride=2)
        for name in ("Mixed_5b", "Mixed_5c", "Mixed_5d", "Mixed_6a", "Mixed_6b", "Mixed_6c"):
            x = getattr(self, name)(x)
        keep: dict[str, torch.Tensor] = {}
        x = self.Mixed_6d(x, keep)
        spatial = keep["branch1x1"][:, :SPATIAL_CHANNELS].permute(0, 2, 3, 1).reshape(len(x), -1)  # NHWC order
        for name in ("Mixed_6e", "Mixed_7a", "Mixed_7b", "Mixed_7c"):
            x = getattr(self, name)(x)
        pool = x.mean(dim=(2, 3))  # pool_3: 8x8 average
        logits = pool @ self.fc.weight.T  # no bias: the IS input of the ADM evaluator
        return {"pool": pool.float(), "spatial": spatial.float(), "logits": logits.float()}


def randomize_(model: InceptionFeatures, seed: int = 0) -> InceptionFeatures:
    """Random weights of the real architecture (tests and benchmarks; no download): He-normal convolutions and
    unit batch norms keep activations of order one through all 94 layers, so features are not degenerate."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            fan_in = m.weight[0].numel()
            m.weight.copy_(torch.randn(m.weight.shape, generator=g) * (2.0 / fan_in) ** 0.5)
        elif isinstance(m, nn.BatchNorm2d):
            m.weight.fill_(1.0)
            m.bias.zero_()
            m.running_mean.zero_()
            m.running_var.fill_(1.0)
    model.fc.weight.copy_(torch.randn(model.fc.weight.shape, generator=g) * 2048 ** -0.5)
    model.fc.bias.zero_()
    return model


def _hub_file() -> Path:
    return Path(torch.hub.get_dir()) / "checkpoints" / WEIGHTS_FILE


def _missing_weights(why: str) -> UserError:
    return UserError(f"the Inception weights are not available ({why}). Download {WEIGHTS_URL} and pass "
                     f"--inception PATH, or put it at {_hub_file()}")


def _fetch() -> Path:
    """The published weights in torch's hub cache, downloaded if missing (its sha256 enters the cache keys)."""
    path = _hub_file()
    if path.is_file():
        return path
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("DIT_OFFLINE") == "1":
        raise _missing_weights("offline")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        torch.hub.download_url_to_file(WEIGHTS_URL, str(path), progress=False)  # temp file, then rename
    except Exception as e:  # noqa: BLE001 - any network failure means the same thing to the user
        raise _missing_weights(f"download failed: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}")
    return path


def load_inception(path: str | Path | None = None, *, device: torch.device | str = "cpu",
                   random_seed: int | None = None, input_size: int = INPUT_SIZE,
                   resize: str = "tf1") -> tuple[InceptionFeatures, dict[str, Any]]:
    """The feature network and its identity (part of cache keys, recorded beside every number): "extractor" (the
    code's version, input size and resize), "weights" (file name or "random-seed-N"), "weights_sha256", and
    "network", "input_size", "resize", "random_seed" (`network_key` compares two identities by them).

    path: a local weights file; None: the hub cache (fetched once). random_seed: random weights instead (tests).
    resize: "tf1" (the TF graph's) or "imf" (iMF's evaluation, `imf_resize`).
    """
    model = InceptionFeatures(input_size, resize)
    version = EXTRACTOR_VERSION if input_size == INPUT_SIZE else f"{EXTRACTOR_VERSION}.input{input_size}"
    version += "" if resize == "tf1" else f".resize-{resize}"
    common = {"network": NETWORK, "implementation": "dit-pipeline evaluate/inception.py", "input_size": input_size,
              "resize": resize}
    if random_seed is not None:
        randomize_(model, random_seed)
        ident = {"extractor": version, "weights": f"random-seed-{random_seed}", "weights_sha256": None,
                 "random_seed": random_seed, **common}
        return model.to(device), ident
    file = Path(path).expanduser() if path is not None else _fetch()
    if not file.is_file():
        raise _missing_weights(f"--inception {file}: {missing_file(file)}")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise UserError(f"--inception {file} is not a readable PyTorch weights file ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200] if str(e) else ''}); expected {WEIGHTS_FILE}") from None
    _load_state(model, state, file)
    ident = {"extractor": version, "weights": file.name, "weights_sha256": sha256_file(file), "random_seed": None,
             **common}
    return model.to(device), ident


def is_random(ident: dict[str, Any] | None) -> bool:
    """Whether an extractor identity is of random weights (a smoke test: its numbers are not FID)."""
    return bool(ident) and (ident.get("random_seed") is not None
                            or str(ident.get("weights", "")).startswith("random-seed-"))


def network_key(ident: dict[str, Any]) -> tuple[str, int]:
    """What must agree between the network that made a reference's statistics and the one evaluating against
    them: the weights (their sha256, or the random seed) and the input size. The code that ran them may differ
    (ours, torch-fidelity's, iMF's JAX port: the same graph and weights, equal to float rounding)."""
    size = int(ident.get("input_size") or _input_size_of(str(ident.get("extractor", ""))))
    if is_random(ident):
        seed = ident.get("random_seed")
        return (str(ident.get("weights")) if seed is None else f"random-seed-{seed}", size)
    sha = str(ident.get("weights_sha256") or "")
    return ("published" if sha.startswith(PUBLISHED_SHA256_PREFIX) or not sha else f"sha256:{sha}", size)


def _input_size_of(extractor: str) -> int:
    """The input size an older identity names in its extractor version ("....input75"), else 299."""
    for part in extractor.split("."):
        if part.startswith("input") and part[5:].isdigit():
            return int(part[5:])
    return INPUT_SIZE


def describe_network(ident: dict[str, Any]) -> str:
    """"inception-2015-12-05 (weights-...pth, sha256 6726825d...)" or "random weights (seed 0), input 75"."""
    size = int(ident.get("input_size") or _input_size_of(str(ident.get("extractor", ""))))
    where = f"{ident.get('implementation', 'dit-pipeline evaluate/inception.py')}, resize {ident.get('resize', 'tf1')}"
    if is_random(ident):
        return f"RANDOM weights ({ident.get('weights')}: not FID), input {size}, {where}"
    sha = str(ident.get("weights_sha256") or "")[:8]
    return f"{ident.get('network', NETWORK)} ({ident.get('weights')}, sha256 {sha}...), input {size}, {where}"


def _load_state(model: InceptionFeatures, state: Any, file: Path) -> None:
    if not isinstance(state, dict):
        raise UserError(f"--inception {file} holds a {type(state).__name__}, not a state_dict; expected {WEIGHTS_FILE}")
    want = {k: v for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}
    got = {k: v for k, v in state.items() if not k.endswith("num_batches_tracked")}
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    shapes = [k for k in want if k in got and tuple(got[k].shape) != tuple(want[k].shape)]
    if missing or extra or shapes:
        raise UserError(f"--inception {file} is not the TF-FID InceptionV3 ({WEIGHTS_FILE}): "
                        f"{len(missing)} missing, {len(extra)} unexpected, {len(shapes)} mis-shaped tensors "
                        f"(first: {(missing + extra + shapes)[0]})")
    model.load_state_dict({**model.state_dict(), **got}, strict=True)
