"""RAE's pixel decoder for feature-space runs (sampling, grids, FID): our own ViT-MAE-style decoder that loads
RAE's released decoder state_dict with its key names unchanged (issue #32).

Why our own and not transformers' ViTMAE: RAE's decoder is its own `GeneralDecoder` module (a trainable CLS
token, its own forward), not a transformers class; its released `config.json` holds `"patch_size": "SHOULD BE
RELOADED"`, which current transformers refuse; and transformers is not a dependency of this project. The module
is small (embed, pre-LN blocks, norm, linear head), written here from its documented structure.

The released layout (ViT-XL decoder: 28 layers, width 1152, 16 heads, MLP 4096, patch 16, LayerNorm eps
1e-12, GELU):
    decoder_embed.{weight,bias}                     [D, C], [D]   (C: the encoder's channels, 768 for DINOv2-B)
    decoder_pos_embed                               [1, 1 + N, D] (fixed sin-cos table, stored)
    trainable_cls_token                             [1, 1, D]
    decoder_layers.{i}.layernorm_before / layernorm_after.{weight,bias}
    decoder_layers.{i}.attention.attention.{query,key,value}.{weight,bias}
    decoder_layers.{i}.attention.output.dense.{weight,bias}
    decoder_layers.{i}.intermediate.dense.{weight,bias}   [MLP, D]
    decoder_layers.{i}.output.dense.{weight,bias}         [D, MLP]
    decoder_norm.{weight,bias}
    decoder_pred.{weight,bias}                      [p * p * 3, D]
Forward: tokens [B, N, C] -> decoder_embed -> the CLS token prepended -> + decoder_pos_embed -> blocks
(x = x + attn(LN(x)); x = x + MLP(LN(x))) -> decoder_norm -> decoder_pred -> the CLS row dropped -> each
token's p*p*3 values are (row, column, colour) of its patch -> [B, 3, h*p, w*p], in ImageNet-normalized pixels:
times the ImageNet std plus the mean gives [0, 1] (RAE's `decode`), and `decode` returns it in [-1, 1] as a
diffusers VAE's `decode(z).sample` does, so `sample.generate.decode_latents` (which first inverts the latent
normalization) treats it as a VAE.

NanoGen's decoders (End2End-Diffusion/diffusion-bench src/stage1/decoders/decoder.py `GeneralDecoder`) have the
same layout, but their stage-1 training fits the decoder's output to the [0, 1] image itself (src/stage1/
engine.py: `(recon - images).abs()`), and NanoGen's RAE.decode (src/stage1/rae.py l.86-95) returns the unpatchified
output as it is, without the ImageNet std and mean. The decoder's `output` says which: "imagenet" (RAE) or
"unit" (NanoGen); `fit_decoder` sets it from the latent space's record (`decoder_output` of a NanoGen feature
encoder's identity, common/nanogen_encoders.py) where the model is decoded.

Why not diffusers' `AutoencoderRAE` (0.37+), whose `RAEDecoder` is the same network (tests/features/
test_rae_decoder_diffusers.py gives it the same weights and gets the same images): (1) it renames the attention
to diffusers' `Attention` (`to_q`, `to_out.0`), so RAE's and NanoGen's released files do not load into it
unchanged; (2) `AutoencoderRAE.decode` undoes its own latent normalization as z * (latents_std + 1e-5) +
latents_mean, which is neither RAE's nor NanoGen's sqrt(var + 1e-5) per channel and position, and without
statistics it still multiplies by 1 + 1e-5 (no identity setting), so our normalization could not be inverted
first; (3) it builds the frozen encoder (a transformers DINOv2/SigLIP2/MAE) with the decoder, memory a decode never
uses; (4) it needs diffusers 0.37, the project's floor is 0.29.2.

`--vae DECODER` (dit-sample, dit-train's grids and FID) loads it: a .pt/.pth/.safetensors file whose tensors
have this layout, optionally `DECODER,CONFIG` or `--vae-config CONFIG` (RAE's config.json: the heads, the eps
and the activation, which the tensors do not show; without one: 16 heads for width 1152 as RAE's ViT-XL, else
width / 64, eps 1e-12, GELU).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.features import IMAGENET_MEAN, IMAGENET_STD
from dit_pipeline.common.io import sha256_file

DECODER_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")
_MARK = "decoder_pred.weight"
_ACTS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu}


@dataclass(frozen=True)
class DecoderConfig:
    in_channels: int       # the encoder's feature width (decoder_embed's input)
    hidden_size: int
    num_layers: int
    num_heads: int
    mlp_size: int
    patch_size: int
    num_patches: int
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    out_channels: int = 3

    @property
    def grid(self) -> int:
        return math.isqrt(self.num_patches)


class _SelfAttention(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)


class _Dense(nn.Module):
    def __init__(self, a: int, b: int):
        super().__init__()
        self.dense = nn.Linear(a, b)


class _Attention(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.attention = _SelfAttention(d)
        self.output = _Dense(d, d)


class DecoderLayer(nn.Module):
    """A pre-LN ViT block in ViT-MAE's names."""

    def __init__(self, c: DecoderConfig):
        super().__init__()
        d = c.hidden_size
        self.heads = c.num_heads
        self.act = _ACTS[c.hidden_act]
        self.attention = _Attention(d)
        self.intermediate = _Dense(d, c.mlp_size)
        self.output = _Dense(c.mlp_size, d)
        self.layernorm_before = nn.LayerNorm(d, eps=c.layer_norm_eps)
        self.layernorm_after = nn.LayerNorm(d, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        h = self.layernorm_before(x)
        a = self.attention.attention
        q, k, v = (lin(h).view(b, n, self.heads, d // self.heads).transpose(1, 2) for lin in (a.query, a.key, a.value))
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        x = x + self.attention.output.dense(o)
        return x + self.output.dense(self.act(self.intermediate.dense(self.layernorm_after(x))))


@dataclass
class _Decoded:
    sample: torch.Tensor  # [-1, 1], as a diffusers VAE's decode(z).sample
    unit: torch.Tensor | None = None  # the decoder's own [0, 1] images (RAE's decode; its FID conversion reads these)


class RAEDecoder(nn.Module):
    """RAE's decoder in its released parameter names; `decode(z [B, C, h, w])` -> `.sample` [B, 3, H, W] in [-1, 1]."""

    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.cfg = c
        d = c.hidden_size
        self.decoder_embed = nn.Linear(c.in_channels, d)
        self.decoder_pos_embed = nn.Parameter(torch.zeros(1, c.num_patches + 1, d), requires_grad=False)
        self.trainable_cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.decoder_layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.decoder_norm = nn.LayerNorm(d, eps=c.layer_norm_eps)
        self.decoder_pred = nn.Linear(d, c.patch_size ** 2 * c.out_channels)
        self.register_buffer("pix_mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("pix_std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)
        self.output = "imagenet"  # or "unit": NanoGen's decoders (the module docstring); set by fit_decoder

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, N, C] feature tokens -> [B, N, p * p * 3] patch values (ImageNet-normalized pixels)."""
        x = self.decoder_embed(tokens)
        x = torch.cat([self.trainable_cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)
        x = x + self.decoder_pos_embed.to(x.dtype)
        for layer in self.decoder_layers:
            x = layer(x)
        return self.decoder_pred(self.decoder_norm(x))[:, 1:]

    def unpatchify(self, patches: torch.Tensor, grid: int) -> torch.Tensor:
        p, c = self.cfg.patch_size, self.cfg.out_channels
        b = patches.shape[0]
        x = patches.reshape(b, grid, grid, p, p, c)          # (row, column) of the token, then (y, x, colour)
        return x.permute(0, 5, 1, 3, 2, 4).reshape(b, c, grid * p, grid * p)

    def decode(self, z: torch.Tensor) -> _Decoded:
        """Raw features [B, C, h, w] (the latent normalization already inverted) -> images in [-1, 1]."""
        b, c, h, w = z.shape
        if c != self.cfg.in_channels or h * w != self.cfg.num_patches or h != w:
            raise UserError(f"the RAE decoder takes [{self.cfg.in_channels}, {self.cfg.grid}, {self.cfg.grid}] "
                            f"features, got {list(z.shape[1:])}")
        x = self.unpatchify(self(z.flatten(2).transpose(1, 2)), h)
        if self.output == "imagenet":
            x = x * self.pix_std.to(x.dtype) + self.pix_mean.to(x.dtype)   # [0, 1], as RAE's decode returns
        return _Decoded(x * 2 - 1, unit=x)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix.lower() == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    for key in ("model", "state_dict", "decoder"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict) and _MARK in obj[key]:
            obj = obj[key]
    if not isinstance(obj, dict):
        raise ValueError(f"holds a {type(obj).__name__}, not a state_dict")
    return obj


def split_spec(spec: str) -> tuple[str, str | None]:
    """`FILE[,CONFIG]` -> (FILE, CONFIG or None)."""
    if "," in spec:
        a, b = spec.rsplit(",", 1)
        return a, b or None
    return spec, None


def is_rae_decoder(spec: str) -> bool:
    """Whether `--vae SPEC` names an RAE decoder file (its tensors have decoder_pred.weight)."""
    path = Path(split_spec(spec)[0]).expanduser()
    if not (path.is_file() and path.suffix.lower() in DECODER_SUFFIXES):
        return False
    try:
        if path.suffix.lower() == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                return _MARK in f.keys()
        return _MARK in _read_tensors(path)
    except Exception:  # not ours to judge: the VAE loader says what is wrong with it
        return False


def _config_file(config: str | Path | None) -> dict[str, Any]:
    if config is None:
        return {}
    p = Path(config).expanduser()
    if p.is_dir():
        p = p / "config.json"
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"the RAE decoder config {config}: cannot read it ({e})") from None
    if not isinstance(d, dict):
        raise UserError(f"the RAE decoder config {config}: not a JSON object")
    return d


def decoder_config(sd: dict[str, torch.Tensor], cfg: dict[str, Any], where: str) -> DecoderConfig:
    """The architecture from the tensors (widths, depth, patch, tokens) and `cfg` (heads, eps, activation: RAE's
    config.json names); UserError naming what is missing or contradicts."""
    need = ["decoder_embed.weight", "decoder_pos_embed", "trainable_cls_token", "decoder_norm.weight", _MARK,
            "decoder_layers.0.intermediate.dense.weight"]
    missing = [k for k in need if k not in sd]
    if missing:
        raise UserError(f"{where}: not an RAE decoder state_dict (missing {', '.join(missing)})")
    d, c = (int(v) for v in sd["decoder_embed.weight"].shape)
    layers = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("decoder_layers."))
    mlp = int(sd["decoder_layers.0.intermediate.dense.weight"].shape[0])
    out = int(sd[_MARK].shape[0])
    channels = int(cfg.get("num_channels", 3))
    p = math.isqrt(out // channels)
    if p * p * channels != out:
        raise UserError(f"{where}: decoder_pred has {out} outputs, not patch * patch * {channels}")
    n = int(sd["decoder_pos_embed"].shape[1]) - 1
    if math.isqrt(n) ** 2 != n:
        raise UserError(f"{where}: decoder_pos_embed holds {n} tokens, not a square grid")
    heads = int(cfg.get("decoder_num_attention_heads", 16 if d == 1152 else max(1, d // 64)))
    # not "hidden_size": RAE overwrites it with the encoder's width before building the decoder (bytetriper/RAE
    # src/stage1/rae.py l.51, decoder_config.hidden_size = self.latent_dim), so its released configs all say 768
    stated = {"decoder_hidden_size": d, "decoder_num_hidden_layers": layers, "decoder_intermediate_size": mlp}
    wrong = [f"{k} {cfg[k]} (the tensors: {v})" for k, v in stated.items()
             if isinstance(cfg.get(k), int) and cfg[k] != v]
    if wrong or d % heads:
        raise UserError(f"{where}: its config does not fit its tensors: {', '.join(wrong) or f'{heads} heads for width {d}'}")
    act = str(cfg.get("hidden_act", "gelu"))
    if act not in _ACTS:
        raise UserError(f"{where}: hidden_act {act!r} is not one of {', '.join(_ACTS)}")
    return DecoderConfig(in_channels=c, hidden_size=d, num_layers=layers, num_heads=heads, mlp_size=mlp,
                         patch_size=p, num_patches=n, layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
                         hidden_act=act, out_channels=channels)


def load_rae_decoder(spec: str, *, config: str | Path | None = None, device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32) -> tuple[RAEDecoder, dict[str, Any]]:
    """(RAEDecoder in eval mode, identity) for `--vae FILE[,CONFIG]`; the identity has what sample/ and the
    hooks read from a VAE's (latent_channels, downsample_factor = the decoder's patch, scaling_factor 1)."""
    path_text, inline = split_spec(spec)
    config = inline or config
    path = Path(path_text).expanduser()
    where = f"--vae {spec}"
    try:
        sd = _read_tensors(path)
    except Exception as e:
        raise UserError(f"{where}: cannot read it ({type(e).__name__}: {e})") from None
    c = decoder_config(sd, _config_file(config), where)
    with torch.random.fork_rng(devices=[]):
        model = RAEDecoder(c)
    own = set(model.state_dict())
    missing, extra = sorted(own - set(sd)), sorted(set(sd) - own)
    if missing:
        raise UserError(f"{where}: the RAE decoder state_dict lacks {len(missing)} tensor(s): {', '.join(missing[:5])}")
    if extra:
        raise UserError(f"{where}: tensors an RAE decoder does not have: {', '.join(extra[:5])}")
    try:
        model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    except RuntimeError as e:
        raise UserError(f"{where}: {' '.join(str(e).splitlines()[:2])}") from None
    identity: dict[str, Any] = {
        "class": "RAEDecoder", "kind": "file", "source": str(path.resolve()), "weights_sha256": sha256_file(path),
        "config": str(Path(config).expanduser().resolve()) if config else None, "decoder": asdict(c),
        "latent_channels": c.in_channels, "downsample_factor": c.patch_size, "scaling_factor": 1.0,
        "shift_factor": None, "grid": c.grid,
    }
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False), identity


OUTPUTS = ("imagenet", "unit")


def fit_decoder(vae: Any, identity: dict[str, Any], latent: dict[str, Any] | None, input_size: int,
                flag: str) -> None:
    """The decoder fitted to the latent space it decodes (a checkpoint's or run's `latent` record): its token
    grid checked (`check_grid`) and, for RAE's decoder, the output convention the space's encoder records
    (`decoder_output`: NanoGen's decoders give [0, 1] images, RAE's ImageNet-normalized ones)."""
    check_grid(identity, input_size, flag)
    if not isinstance(vae, RAEDecoder):
        return
    output = str(((latent or {}).get("encoder") or {}).get("decoder_output") or "imagenet")
    if output not in OUTPUTS:
        raise UserError(f"{flag}: the latent space records decoder output {output!r}, not one of {', '.join(OUTPUTS)}")
    vae.output = output
    identity["output"] = output


def check_grid(identity: dict[str, Any], input_size: int, flag: str) -> None:
    """UserError before any sampling when a decoder's token grid is not the model's latent side (an RAE decoder
    records `grid`; a VAE, which decodes any size, does not)."""
    grid = identity.get("grid")
    if grid is not None and int(grid) != int(input_size):
        raise UserError(f"{flag}: RAE's decoder decodes {grid} x {grid} tokens but the model makes {input_size} x "
                        f"{input_size} latents; pass the decoder of this encoder and image size")


def save_rae_decoder(model: RAEDecoder, path: str | Path) -> Path:
    """The state_dict in RAE's layout (torch.save of a plain dict; .safetensors by suffix)."""
    path = Path(path)
    sd = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if path.suffix.lower() == ".safetensors":
        from safetensors.torch import save_file

        save_file(sd, str(path))
    else:
        torch.save(sd, path)
    return path
