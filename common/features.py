"""Feature encoders: a frozen vision foundation model (DINOv2, DINOv3 through timm) as the shard set's
"VAE encoder", so that `dit-extract --encoder dinov2-b-reg` pays for the encoder once (issue #32, RAE).

The formula (RAE's stage-1 encoder, arXiv:2510.11690): the uint8 crop scaled to [0, 1], resized to the
encoder's input size (bicubic, align_corners False, no antialias; skipped when the crop already has that
size), normalized by the ImageNet mean and std, the ViT's forward, its final LayerNorm applied WITHOUT its
affine weight and bias, and the prefix tokens (CLS and registers) dropped: N patch tokens x C channels ->
[C, h, w]. With `layers=k` (RAEv2's DINOv3 sum) the output is the sum over the last k blocks of each block's
patch tokens through the same affine-free LayerNorm (our reading of RAEv2; with k=1 it is the plain formula).

`load_feature_encoder` returns (module, identity) like `common.vae.load_vae`: the module's `encode(x)` takes
the [0, 1] images (identity `input_range: "0,1"`) and returns an object with `.latent` (a deterministic
encoder, `encoder_output: "latent"`), so extract/encode.py runs it as it runs a VAE without a posterior.

`--encoder` is a preset name (`PRESETS`), one of NanoGen's encoder names (`dinov2-vit-b`, `dinov3-vit-b16`,
`siglip2-vit-b`, `pe-vit-l`, `langpe-vit-l`, `spatialpe-vit-l`: NanoGen's own formula, common/nanogen_encoders.py;
a JSON file {"preset": NAME, "model_args": {...}, "weights": ..., "pretrained": false} builds a custom-sized one),
any timm model name, a JSON file {"model": timm name, "model_args":
{...}, "input_size": ..., "layers": ..., "weights": file relative to the JSON, "pretrained": false} (custom or
tiny architectures; random weights unless it names some), or a weight file (.pth/.pt/
.safetensors) whose tensor shapes pick the preset; `--encoder-weights FILE` loads offline weights into a named
model (timm resamples the position table to the input size as it does for its own downloads).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import sha256_file
from dit_pipeline.common.nanogen_encoders import load_encoder_space

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
WEIGHT_SUFFIXES = (".pth", ".pt", ".bin", ".safetensors")
# "rae": RAE's latents (FORMULA); "repa": exactly the tokens REPA's online teacher aligns to (common/teacher.py:
# normalize before the resize, the final norm with its affine), for `dit-train --repa FOLDER` (cached tokens);
# "reg": NanoGen's REG target, the class token (FORMULA_REG), for `dit-train --use-reg --reg-tokens FOLDER`.
FORMULAS = ("rae", "repa", "reg")
# End2End-Diffusion/diffusion-bench src/encoders/vision_encoder.py DINOv2Encoder: preprocess l.216-223, the final norm
# replaced by nn.LayerNorm(embed_dim, elementwise_affine=False) (torch's eps 1e-5) l.207-210, x_norm_clstoken l.229
FORMULA_REG = ("x/255 in [0,1]; (x - ImageNet mean) / ImageNet std; bicubic resize to input_size (align_corners "
               "False, no antialias); ViT forward; final LayerNorm without affine, eps 1e-5; the class token -> [C, 1, 1]")
REG_NORM_EPS = 1e-5
FORMULA_REPA = ("x/255 in [0,1]; (x - ImageNet mean) / ImageNet std; bicubic resize to input_size (align_corners "
                "False, no antialias); ViT forward with its final LayerNorm (affine kept); prefix tokens dropped")
FORMULA = ("x/255 in [0,1]; bicubic resize to input_size (align_corners False, no antialias); (x - ImageNet mean) "
           "/ ImageNet std; ViT forward; final LayerNorm without affine; prefix tokens dropped; tokens -> [C, h, w]")


@dataclass(frozen=True)
class Preset:
    model: str            # timm name
    input_size: int       # the encoder's input side in pixels
    layers: int = 1       # sum of the last `layers` blocks (1: the final block only)
    note: str = ""


PRESETS: dict[str, Preset] = {
    # RAE: facebook/dinov2-with-registers-base, 224 px -> 16 x 16 tokens x 768.
    "dinov2-b-reg": Preset("vit_base_patch14_reg4_dinov2", 224, 1, "RAE's encoder (DINOv2-B with 4 registers)"),
    "dinov2-b": Preset("vit_base_patch14_dinov2", 224, 1, "DINOv2-B without registers"),
    # RAEv2: DINOv3-L (patch 16) at 256 px -> 16 x 16 tokens x 1024, the sum of the last 7 layers.
    "dinov3-l": Preset("vit_large_patch16_dinov3", 256, 7, "RAEv2's encoder (DINOv3-L, last 7 layers summed)"),
}


class FeatureEncoder(nn.Module):
    """A timm ViT with RAE's formula; `encode(x)` takes [B, 3, H, W] in [0, 1] and returns `.latent` [B, C, h, w]."""

    def __init__(self, model: nn.Module, *, input_size: int, layers: int = 1, formula: str = "rae",
                 mean: tuple[float, ...] = IMAGENET_MEAN, std: tuple[float, ...] = IMAGENET_STD):
        super().__init__()
        if formula not in FORMULAS:
            raise ValueError(f"formula must be one of {', '.join(FORMULAS)}, got {formula!r}")
        self.model = model
        self.formula = formula
        self.input_size = int(input_size)
        self.layers = int(layers)
        dim = int(getattr(model, "num_features", getattr(model, "embed_dim")))
        eps = float(getattr(getattr(model, "norm", None), "eps", 1e-6))
        self.norm = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)  # the final norm without its affine
        self.prefix = int(getattr(model, "num_prefix_tokens", 1))
        self.register_buffer("pix_mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("pix_std", torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)

    @property
    def patch_size(self) -> int:
        p = self.model.patch_embed.patch_size
        return int(p[0] if isinstance(p, (tuple, list)) else p)

    @property
    def grid(self) -> int:
        return self.input_size // self.patch_size

    @property
    def channels(self) -> int:
        return int(self.norm.normalized_shape[0])

    def preprocess(self, x: torch.Tensor) -> torch.Tensor:
        """[0, 1] images -> the ViT's input: resize first (as RAE does), then the ImageNet normalization; "repa":
        normalize, then resize (REPA's online teacher, common/teacher.py)."""
        if self.formula in ("repa", "reg"):
            x = (x - self.pix_mean.to(x.dtype)) / self.pix_std.to(x.dtype)
            return F.interpolate(x, size=(self.input_size, self.input_size), mode="bicubic", align_corners=False,
                                 antialias=False)
        if x.shape[-1] != self.input_size or x.shape[-2] != self.input_size:
            x = F.interpolate(x, size=(self.input_size, self.input_size), mode="bicubic", align_corners=False,
                              antialias=False)
        return (x - self.pix_mean.to(x.dtype)) / self.pix_std.to(x.dtype)

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The patch tokens [B, N, C] of preprocessed input x."""
        if self.formula == "repa":  # the model's own final norm, with its affine (REPA's teacher tokens)
            return self.model.forward_features(x)[:, self.prefix:]
        if self.layers == 1:
            # forward_features of the model whose own final norm became nn.Identity (_strip_final_norm)
            return self.norm(self.model.forward_features(x)[:, self.prefix:])
        outs = self.model.forward_intermediates(x, indices=self.layers, norm=False, output_fmt="NLC",
                                                intermediates_only=True)
        total = self.norm(outs[0])
        for t in outs[1:]:
            total = total + self.norm(t)
        return total

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.formula == "reg":  # the class token through the affine-free final norm: [B, C, 1, 1]
            return self.norm(self.model.forward_features(self.preprocess(x))[:, 0])[:, :, None, None]
        t = self.tokens(self.preprocess(x))
        b, n, c = t.shape
        side = math.isqrt(n)
        return t.transpose(1, 2).reshape(b, c, side, side)

    def encode(self, x: torch.Tensor) -> "_Latent":
        return _Latent(self(x))


@dataclass
class _Latent:
    latent: torch.Tensor


def _strip_final_norm(model: nn.Module) -> nn.Module:
    """forward_features without the final norm (FeatureEncoder applies it without affine); eps kept aside."""
    norm = getattr(model, "norm", None)
    if norm is None or isinstance(norm, nn.Identity):
        raise UserError(f"the timm model {type(model).__name__} has no final norm to use without its affine")
    model._feature_norm_eps = float(getattr(norm, "eps", 1e-6))  # type: ignore[assignment]
    model.norm = nn.Identity()
    return model


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix.lower() == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    obj = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("model", "state_dict", "teacher"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict):
        raise UserError(f"{path}: holds a {type(obj).__name__}, not a state_dict")
    return obj


def _preset_of_weights(sd: dict[str, torch.Tensor], where: str) -> str:
    """The preset whose architecture a timm state_dict has (embed dim, patch size, registers)."""
    w = sd.get("patch_embed.proj.weight")
    if w is None:
        raise UserError(f"{where}: not a timm ViT state_dict (no patch_embed.proj.weight); pass --encoder NAME "
                        "--encoder-weights FILE, or a JSON encoder file naming the timm model")
    dim, patch = int(w.shape[0]), int(w.shape[-1])
    regs = int(sd["reg_token"].shape[1]) if "reg_token" in sd else 0
    for name, p in PRESETS.items():
        pd = {"vit_base_patch14_reg4_dinov2": (768, 14, 4), "vit_base_patch14_dinov2": (768, 14, 0),
              "vit_large_patch16_dinov3": (1024, 16, 4)}[p.model]
        if pd == (dim, patch, regs):
            return name
    raise UserError(f"{where}: a ViT of width {dim}, patch {patch}, {regs} registers matches no preset "
                    f"({', '.join(PRESETS)}); pass --encoder TIMM_NAME --encoder-weights FILE")


def _create(model_name: str, *, model_args: dict[str, Any], input_size: int, weights: Path | None,
            pretrained: bool, spec: str) -> nn.Module:
    import timm

    if not timm.is_model(model_name):
        raise UserError(f"--encoder {spec!r}: timm {timm.__version__} has no model {model_name!r} (presets: "
                        f"{', '.join(PRESETS)}; or a timm ViT name, a JSON encoder file, a weight file)")
    kw: dict[str, Any] = dict(model_args)
    kw.setdefault("img_size", input_size)
    kw.setdefault("num_classes", 0)
    try:
        if weights is not None:
            _check_weights_fit(model_name, kw, weights, spec)
            return timm.create_model(model_name, pretrained=True, pretrained_cfg_overlay={"file": str(weights)}, **kw)
        return timm.create_model(model_name, pretrained=pretrained, **kw)
    except UserError:
        raise
    except Exception as e:  # no network, wrong weights: one line, the whole reason
        reason = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        reason = reason if len(reason) <= 400 else reason[:400] + " ..."
        if weights is not None:
            raise UserError(f"--encoder-weights {weights}: timm {model_name!r} (--encoder {spec!r}) cannot load it "
                            f"({type(e).__name__}: {reason}); pass the weights of that model, or the --encoder "
                            "whose architecture the file holds") from None
        what = "its pretrained weights" if pretrained else "it"
        raise UserError(f"--encoder {spec!r}: cannot build timm {model_name!r} with {what} ({type(e).__name__}: "
                        f"{reason}). Offline: pass --encoder-weights FILE") from None


def _check_weights_fit(model_name: str, kw: dict[str, Any], weights: Path, spec: str) -> None:
    """UserError (complete, one line) when the file's tensors do not fit the model --encoder names: which tensors
    differ, and the preset the file's architecture is, if any. pos_embed may differ (timm resamples it)."""
    import timm

    try:
        with torch.device("meta"):  # the shapes only, no memory
            net = timm.create_model(model_name, pretrained=False, **kw)
    except RuntimeError:  # timm 1.0.3 calls .item() while building (its drop-path schedule): build it on the CPU
        net = timm.create_model(model_name, pretrained=False, **kw)
    want = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    try:
        have = _as_timm_loads(_read_state_dict(weights), net)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - an unreadable file: one line
        raise UserError(f"--encoder-weights {weights}: not a readable state_dict ({type(e).__name__})") from None
    shapes = [f"{k} {list(have[k].shape)} where it needs {list(want[k])}" for k in want
              if k in have and k != "pos_embed" and tuple(have[k].shape) != want[k]]
    missing = [k for k in want if k not in have]
    if not shapes and not missing:
        return
    try:
        guess = f"; the file is {_preset_of_weights(have, str(weights))}'s architecture: pass --encoder " \
                f"{_preset_of_weights(have, str(weights))}"
    except UserError:
        guess = "; pass the --encoder (a timm model name or a JSON encoder file) of the file's architecture"
    first = (shapes or [f"{missing[0]} missing"])[0]
    raise UserError(f"--encoder-weights {weights} does not fit --encoder {spec} (timm {model_name}): {len(shapes)} "
                    f"tensor(s) of other shapes, {len(missing)} missing (first: {first}){guess}")


def _as_timm_loads(sd: dict[str, torch.Tensor], net: nn.Module) -> dict[str, torch.Tensor]:
    """The state_dict as timm's loader sees it: after its model module's own `checkpoint_filter_fn`, which turns an
    original checkpoint into timm's layout (torch.hub's DINOv2 file, what NanoGen loads: `register_tokens`, the
    class position inside `pos_embed`, `mask_token`), as the `pretrained_cfg_overlay` load does. The file as it
    is where the module has no filter or the filter cannot read it (the check then names what differs)."""
    import sys

    convert = getattr(sys.modules.get(type(net).__module__), "checkpoint_filter_fn", None)
    if convert is None:
        return sd
    try:
        return dict(convert(dict(sd), net))
    except Exception:  # noqa: BLE001 - not a layout the filter knows: compared as it is
        return sd


def load_feature_encoder(spec: str, *, weights: str | None = None, layers: int | None = None,
                         device: torch.device | str = "cpu", pretrained: bool = True,
                         image_size: int = 256, formula: str = "rae") -> tuple[FeatureEncoder, dict[str, Any]]:
    """(FeatureEncoder in eval mode on `device`, identity) for `--encoder SPEC` (see the module docstring).

    `pretrained=False` builds random weights (tests and benchmarks: the real cost). The identity carries what
    extract/ reads from a VAE's (`latent_channels`, `downsample_factor` = image_size / token grid,
    `encoder_output`, `scaling_factor` 1) plus the encoder's own (`kind: "features"`, model, input size, patch,
    layers, the formula, the weights' sha256)."""
    from dit_pipeline.common.pixels import is_pixel_space, load_pixel_space

    if is_pixel_space(spec):  # pixels as the latent space: the identity encoder (common/pixels.py)
        return load_pixel_space(image_size, device)  # type: ignore[return-value]
    space = _encoder_space(spec, layers, formula)
    if space is not None:  # NanoGen's encoders by name (common/nanogen_encoders.py); "reg": its REG target
        name, file_args = space
        file_weights, file_pretrained = file_args.pop("weights", None), file_args.pop("pretrained", True)
        return load_encoder_space(name, weights=weights or file_weights, device=device,  # type: ignore[return-value]
                                  pretrained=pretrained and file_pretrained, image_size=image_size,
                                  formula="reg" if formula == "reg" else "nanogen", **file_args)
    with torch.random.fork_rng(devices=[]):
        return _load(spec, weights, layers, device, pretrained, image_size, formula)


def _encoder_space(spec: str, layers: int | None, formula: str) -> tuple[str, dict[str, Any]] | None:
    """(NanoGen's encoder name, the JSON file's settings) when `spec` names one of NanoGen's encoders, directly
    or as a JSON encoder file {"preset": NAME, "model_args": {...}, "weights": FILE, "pretrained": false}; with
    formula "reg" (NanoGen's REG target: its class token) or the default "rae" (NanoGen's own latent)."""
    from dit_pipeline.common.nanogen_encoders import ENCODER_SPACES, is_encoder_space

    found: tuple[str, dict[str, Any]] | None = None
    p = Path(spec).expanduser()
    if is_encoder_space(spec):
        found = (spec, {})
    elif p.is_file() and p.suffix.lower() == ".json":
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
        except ValueError:
            return None  # the generic reader says what is wrong
        if isinstance(d, dict) and d.get("preset") is not None:
            if d["preset"] not in ENCODER_SPACES:
                raise UserError(f"--encoder {spec}: preset {d['preset']!r} is none of NanoGen's encoders "
                                f"({', '.join(ENCODER_SPACES)})")
            args: dict[str, Any] = {"model_args": dict(d.get("model_args") or {}),
                                    "pretrained": bool(d.get("pretrained", True)),
                                    "source": {"spec": str(p.resolve()), "file_sha256": sha256_file(p)}}
            if d.get("weights"):
                args["weights"] = str(p.parent / str(d["weights"]))
            found = (str(d["preset"]), args)
    if found is not None and (layers is not None or formula not in ("rae", "reg")):
        raise UserError(f"--encoder {found[0]} is NanoGen's encoder with NanoGen's formula (its last block; "
                        "--encoder-formula reg: its class token, REG's target); drop --encoder-layers and "
                        "--encoder-formula")
    return found


def _load(spec, weights, layers, device, pretrained, image_size, formula):
    if formula not in FORMULAS:
        raise UserError(f"--encoder-formula must be one of {', '.join(FORMULAS)}, got {formula!r}")
    p = Path(spec).expanduser()
    model_args: dict[str, Any] = {}
    weights_path = Path(weights).expanduser() if weights else None
    if weights_path is not None and not weights_path.is_file():
        raise UserError(f"--encoder-weights {weights}: no such file ({weights_path.absolute()})")
    source: dict[str, Any] = {"spec": spec}
    if spec in PRESETS:
        preset = PRESETS[spec]
    elif p.is_file() and p.suffix.lower() == ".json":
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
            preset = Preset(str(d["model"]), int(d.get("input_size", 224)), int(d.get("layers", 1)))
            model_args = dict(d.get("model_args") or {})
            pretrained = pretrained and bool(d.get("pretrained", False))
            if d.get("weights") and weights_path is None:
                weights_path = (p.parent / str(d["weights"])).expanduser()
                if not weights_path.is_file():
                    raise UserError(f"--encoder {spec}: its weights {weights_path} do not exist")
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"--encoder {spec}: not an encoder file ({type(e).__name__}: {e}); expected JSON "
                            '{"model": TIMM_NAME, "model_args": {...}, "input_size": N, "layers": K}') from None
        source["spec"] = str(p.resolve())
        source["file_sha256"] = sha256_file(p)
    elif p.is_file() and p.suffix.lower() in WEIGHT_SUFFIXES:
        if weights_path is not None:
            raise UserError(f"--encoder {spec} is a weight file already; drop --encoder-weights")
        weights_path = p
        preset = PRESETS[_preset_of_weights(_read_state_dict(p), f"--encoder {spec}")]
    elif spec.lower().endswith(WEIGHT_SUFFIXES + (".json",)) or "/" in spec:
        raise UserError(f"--encoder {spec!r}: no such file ({p.absolute()})")
    else:
        preset = Preset(spec, 224, 1)
    if layers is not None:
        if layers < 1:
            raise UserError(f"--encoder-layers must be >= 1, got {layers}")
        preset = Preset(preset.model, preset.input_size, layers, preset.note)
    model = _create(preset.model, model_args=model_args, input_size=preset.input_size, weights=weights_path,
                    pretrained=pretrained and weights_path is None, spec=spec)
    depth = len(getattr(model, "blocks", []))
    if preset.layers > depth:
        raise UserError(f"--encoder-layers {preset.layers}: {preset.model} has only {depth} blocks")
    if formula in ("repa", "reg") and preset.layers != 1:
        raise UserError(f"--encoder-formula {formula}: the teacher's tokens are the last block's; drop --encoder-layers")
    eps = float(getattr(getattr(model, "norm", None), "eps", 1e-6)) if formula != "reg" else REG_NORM_EPS
    if formula in ("rae", "reg"):
        _strip_final_norm(model)
    enc = FeatureEncoder(model, input_size=preset.input_size, layers=preset.layers, formula=formula)
    enc.norm.eps = eps
    if preset.input_size % enc.patch_size:
        raise UserError(f"--encoder {spec!r}: input size {preset.input_size} is not a multiple of its patch "
                        f"{enc.patch_size}")
    grid = 1 if formula == "reg" else enc.grid  # the class token: one "position" per image
    if image_size % grid:
        raise UserError(f"--image-size {image_size} is not a multiple of the encoder's {grid} x {grid} token grid")
    if weights_path is not None:
        source["weights"] = str(weights_path.resolve())
        source["weights_sha256"] = sha256_file(weights_path)
    elif pretrained and spec_is_named(spec):
        source["weights"] = f"timm:{preset.model} (pretrained)"
    else:
        source["weights"] = "random (not pretrained)"
    identity: dict[str, Any] = {
        "kind": "features", "class": f"timm:{preset.model}", "model": preset.model, "model_args": model_args,
        "input_size": preset.input_size, "patch_size": enc.patch_size, "layers": preset.layers,
        "prefix_tokens": enc.prefix,
        "formula": {"rae": FORMULA, "repa": FORMULA_REPA, "reg": FORMULA_REG}[formula],
        "formula_name": formula, "input_range": "0,1", **source,
        "latent_channels": enc.channels, "downsample_factor": image_size // grid, "encoder_output": "latent",
        "scaling_factor": 1.0, "shift_factor": None,
    }
    enc = enc.to(device).eval().requires_grad_(False)
    return enc, identity


def spec_is_named(spec: str) -> bool:
    return not Path(spec).expanduser().is_file()


def feature_identity_fields(identity: dict[str, Any] | None) -> dict[str, Any] | None:
    """What decides the features, by name (two sets whose fields are equal hold the same encoder's features):
    model, its args, input size, layers and the weights' hash or source; None for an identity of no features."""
    if not identity or identity.get("kind") != "features":
        return None
    return {"model": identity.get("model"), "model_args": json.dumps(identity.get("model_args") or {}, sort_keys=True),
            "input_size": identity.get("input_size"), "layers": identity.get("layers"),
            "weights": identity.get("weights_sha256") or identity.get("weights")}


def feature_identity_key(identity: dict[str, Any] | None) -> tuple | None:
    """`feature_identity_fields` as a comparable, hashable key."""
    fields = feature_identity_fields(identity)
    return None if fields is None else tuple(fields.values())
