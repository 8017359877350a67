"""The latent normalization: how a VAE's raw latent z becomes the latent x a DiT trains on, and back.

One formula, written here once and used by everyone who normalizes (the trainer's loader, `dit-shards stats`)
or inverts (sample grids, FID during training, `dit-sample`):

    x = (z - shift) * scale            z = x / scale + shift

- **scalar** (every set before per-channel statistics; the SD-VAE, SD3, FLUX, DC-AE): `scale` is the VAE
  config's `scaling_factor`, `shift` its `shift_factor` (none for the SD-VAE: `x = z * scale`), as diffusers'
  pipelines encode. Computed exactly as before: one exactly rounded float32 op at a time with the Python
  float factors.
- **per-channel**, a normalization record (docs/FORMAT.md, "normalization"), in one of two forms:
  - `mean_std`: `mean`, `std` vectors and a scalar `multiplier`: x = (z - mean_c) * multiplier / std_c, i.e.
    LightningDiT's `(z - mean) / std * latent_multiplier` (its VA-VAE `latents_stats.pt`, multiplier 1) and
    diffusers' `(z - latents_mean) * scaling_factor / latents_std` (a VAE config with `latents_mean` /
    `latents_std`, multiplier = its scaling_factor);
  - `scale_shift`: `scale`, `shift` vectors as they are.
  - `mean_var` (RAE's feature spaces, issue #32): per channel AND position, `mean` and `var` of shape
    `shape` = [C, h, w] (float32 little-endian, base64 in the JSON) and `eps` (RAE: 1e-5):
    x = (z - mean_chw) / sqrt(var_chw + eps), as RAE's `stat.pt` (keys mean, var) normalizes;
    `scale_chw = float32(1 / sqrt(float64(var) + eps))`, so x agrees with RAE's float32 division to rounding.
  Each becomes float32 arrays once (`shift_c = float32(mean_c)`, `scale_c = float32(multiplier / std_c)`
  computed in float64), and x = (z - shift_c) * scale_c runs as two exactly rounded float32 ops per element
  broadcast over the channel axis (-3), so a sample's values never depend on the batch it is in.

A record also says where its numbers came from (`source`: the VAE config, a statistics file, `dit-shards
stats`); that provenance is not part of `key()`, which is what two runs must share to compute the same latents.
Statistics files, and the records of computed statistics, are common/latent_stats.py's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, TypeVar

import numpy as np

Z = TypeVar("Z")
FORMS = ("mean_std", "scale_shift", "mean_var")
ARRAY_ENCODING = "float32-le-base64"  # how a mean_var record stores its [C, h, w] arrays in JSON
SOURCE_KINDS = ("vae_config", "vae_weights", "file", "stats")
_VECTORS = {"mean_std": ("mean", "std"), "scale_shift": ("scale", "shift")}


def _finite_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def encode_array(a: np.ndarray) -> str:
    """A float array as the base64 of its float32 little-endian bytes (a mean_var record's `mean` / `var`)."""
    import base64

    return base64.b64encode(np.ascontiguousarray(a, dtype="<f4").tobytes()).decode("ascii")


def decode_array(text: Any, shape: Sequence[int]) -> np.ndarray:
    """The float32 [C, h, w] array of `encode_array`; ValueError for anything else."""
    import base64
    import binascii

    if not isinstance(text, str):
        raise ValueError("not a base64 string")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise ValueError("not valid base64") from None
    n = int(np.prod(shape))
    if len(raw) != 4 * n:
        raise ValueError(f"holds {len(raw) // 4} float32 values for shape {list(shape)} ({n})")
    return np.frombuffer(raw, dtype="<f4").reshape(tuple(shape)).astype(np.float32)


def _mean_var_problems(d: dict[str, Any], channels: int | Sequence[int] | None) -> list[str]:
    shape = d.get("shape")
    if not (isinstance(shape, list) and len(shape) == 3 and all(isinstance(v, int) and not isinstance(v, bool)
                                                                 and v > 0 for v in shape)):
        return [f"normalization shape must be 3 positive integers [C, h, w], got {shape!r}"]
    out: list[str] = []
    if d.get("encoding") != ARRAY_ENCODING:
        out.append(f"normalization encoding must be {ARRAY_ENCODING!r}, got {d.get('encoding')!r}")
    if not (_finite_number(d.get("eps")) and d["eps"] >= 0):
        out.append(f"normalization eps must be a finite number >= 0, got {d.get('eps')!r}")
    for name in ("mean", "var"):
        try:
            a = decode_array(d.get(name), shape)
        except ValueError as e:
            out.append(f"normalization {name}: {e}")
            continue
        if not np.isfinite(a).all():
            out.append(f"normalization {name} must be finite everywhere")
        elif name == "var" and not (a.astype(np.float64) + float(d.get("eps") or 0) > 0).all():
            out.append("normalization var + eps must be > 0 at every channel and position")
    if isinstance(channels, int) and shape[0] != channels:
        out.append(f"normalization has shape {shape} for {channels} latent channels")
    elif channels is not None and not isinstance(channels, int) and list(channels) != shape:
        out.append(f"normalization has shape {shape}, the latents have shape {list(channels)} (statistics of "
                   "another encoder or size)")
    return out


def normalization_problems(d: Any, channels: int | Sequence[int] | None = None) -> list[str]:
    """Every problem of a normalization record (empty when valid); `channels`: the latent channels it must fit,
    or the latent shape [C, h, w] (a per-position record must have exactly that shape)."""
    if not isinstance(d, dict):
        return [f"normalization must be an object, got {type(d).__name__}"]
    form = d.get("form")
    if form not in FORMS:
        return [f"normalization form must be one of {', '.join(FORMS)}, got {form!r}"]
    out: list[str] = []
    if form == "mean_var":
        out = _mean_var_problems(d, channels)
        source = d.get("source")
        if not isinstance(source, dict) or source.get("kind") not in SOURCE_KINDS:
            out.append(f"normalization source must be an object with kind one of {', '.join(SOURCE_KINDS)}")
        return out
    if channels is not None and not isinstance(channels, int):
        channels = int(list(channels)[0])
    for name in _VECTORS[form]:
        v = d.get(name)
        if not isinstance(v, list) or not v or not all(_finite_number(x) for x in v):
            out.append(f"normalization {name} must be a non-empty list of finite numbers")
        elif channels is not None and len(v) != channels:
            out.append(f"normalization {name} has {len(v)} values for {channels} latent channels")
        elif name in ("std", "scale") and not all(x > 0 for x in v):
            out.append(f"normalization {name} must be > 0 in every channel")
    if form == "mean_std" and not (_finite_number(d.get("multiplier")) and d["multiplier"] > 0):
        out.append(f"normalization multiplier must be a finite number > 0, got {d.get('multiplier')!r}")
    if not out and len(d[_VECTORS[form][0]]) != len(d[_VECTORS[form][1]]):
        out.append(f"normalization {' and '.join(_VECTORS[form])} differ in length")
    source = d.get("source")
    if not isinstance(source, dict) or source.get("kind") not in SOURCE_KINDS:
        out.append(f"normalization source must be an object with kind one of {', '.join(SOURCE_KINDS)}")
    return out


@dataclass(frozen=True)
class LatentNorm:
    """A latent normalization: scalar (`scaling_factor`, `shift_factor`) or per-channel (`per_channel`, a valid
    normalization record, which then decides; the scalar fields keep the VAE config's values for the record)."""

    scaling_factor: float = 1.0
    shift_factor: float | None = None
    per_channel: dict[str, Any] | None = None
    _cache: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.per_channel is not None:
            problems = normalization_problems(self.per_channel)
            if problems:
                raise ValueError("invalid normalization: " + "; ".join(problems))

    # -- construction ------------------------------------------------------------------------------------
    @classmethod
    def from_record(cls, latent: Mapping[str, Any]) -> "LatentNorm":
        """From a checkpoint's (or sidecar's, export's) `latent` dict: scaling_factor, shift_factor and, when
        per-channel, normalization."""
        shift = latent.get("shift_factor")
        return cls(float(latent["scaling_factor"]), None if shift is None else float(shift),
                   latent.get("normalization"))

    @classmethod
    def of_vae(cls, identity: Mapping[str, Any]) -> "LatentNorm":
        """The VAE's own normalization (common.vae identity): its `normalization` record where it has one (a
        layout's statistics or NanoGen's rule: common/latent_spaces.py), else per-channel when it has
        `latents_mean` and `latents_std` (diffusers' convention, multiplier = scaling_factor), else scalar."""
        scale, shift = float(identity["scaling_factor"]), identity.get("shift_factor")
        shift = None if shift is None else float(shift)
        if identity.get("normalization") is not None:  # the VAE's own record (common/latent_spaces.py)
            return cls(scale, shift, dict(identity["normalization"]))
        mean, std = identity.get("latents_mean"), identity.get("latents_std")
        if mean is None or std is None:
            return cls(scale, shift)
        record = {"form": "mean_std", "mean": [float(v) for v in mean], "std": [float(v) for v in std],
                  "multiplier": scale, "source": {"kind": "vae_config"}}
        return cls(scale, shift, record)

    def with_record(self, record: dict[str, Any] | None) -> "LatentNorm":
        """The same scalar fields with another per-channel record (None: scalar)."""
        return LatentNorm(self.scaling_factor, self.shift_factor, record)

    # -- what it is ---------------------------------------------------------------------------------------
    @property
    def is_per_channel(self) -> bool:
        return self.per_channel is not None

    @property
    def channels(self) -> int | None:
        """The channels a per-channel normalization is for (None: scalar, any)."""
        if self.per_channel is None:
            return None
        if self.per_channel["form"] == "mean_var":
            return int(self.per_channel["shape"][0])
        return len(self.per_channel[_VECTORS[self.per_channel["form"]][0]])

    @property
    def is_per_position(self) -> bool:
        """A mean_var record: per channel and position ([C, h, w])."""
        return self.per_channel is not None and self.per_channel["form"] == "mean_var"

    @property
    def shape(self) -> list[int] | None:
        """The [C, h, w] a per-position normalization is for (None otherwise)."""
        return list(self.per_channel["shape"]) if self.is_per_position else None  # type: ignore[index]

    def vectors(self) -> tuple[np.ndarray, np.ndarray]:
        """(scale, shift) as float32 arrays (the only rounding of the record's numbers): [C] per channel, [C, h, w]
        per channel and position."""
        assert self.per_channel is not None, "a scalar normalization has no vectors"
        if "np" not in self._cache:
            d = self.per_channel
            if d["form"] == "mean_var":
                var = decode_array(d["var"], d["shape"]).astype(np.float64)
                scale = (1.0 / np.sqrt(var + float(d["eps"]))).astype(np.float32)
                shift = decode_array(d["mean"], d["shape"])
            elif d["form"] == "mean_std":
                m = float(d["multiplier"])
                scale = np.array([m / float(s) for s in d["std"]], dtype=np.float64).astype(np.float32)
                shift = np.array(d["mean"], dtype=np.float64).astype(np.float32)
            else:
                scale = np.array(d["scale"], dtype=np.float64).astype(np.float32)
                shift = np.array(d["shift"], dtype=np.float64).astype(np.float32)
            self._cache["np"] = (scale, shift)
        return self._cache["np"]

    def key(self) -> tuple:
        """What decides the latents (two runs compute the same x from the same z exactly when keys are equal)."""
        if self.per_channel is None:
            return ("scalar", float(self.scaling_factor), None if not self.shift_factor else float(self.shift_factor))
        scale, shift = self.vectors()
        if self.is_per_position:
            import hashlib

            digest = hashlib.sha256(scale.tobytes() + shift.tobytes()).hexdigest()
            return ("per-position", tuple(scale.shape), digest)
        return ("per-channel", tuple(scale.tolist()), tuple(shift.tolist()))

    def record(self) -> dict[str, Any]:
        """The `latent` fields checkpoints, sidecars and exports store (normalization only when per-channel, so
        a scalar record is what it always was)."""
        out: dict[str, Any] = {"scaling_factor": float(self.scaling_factor), "shift_factor": self.shift_factor}
        if self.per_channel is not None:
            out["normalization"] = self.per_channel
        return out

    def describe(self) -> str:
        """One line: the formula, with the numbers (ranges for vectors) and where they came from."""
        if self.per_channel is None:
            if self.shift_factor is not None:
                return f"scalar: (z - {self.shift_factor:g}) * {self.scaling_factor:g}"
            return f"scalar: z * {self.scaling_factor:g}"
        d, c = self.per_channel, self.channels
        if d["form"] == "mean_var":
            scale, shift = self.vectors()
            return (f"per-position over {d['shape']}: (z - mean_chw) / sqrt(var_chw + {float(d['eps']):g}) (mean "
                    f"{shift.min():.4g}..{shift.max():.4g}, 1/sqrt(var + eps) {scale.min():.4g}..{scale.max():.4g}), "
                    f"from {describe_source(d['source'])}")
        a, b = _VECTORS[d["form"]]
        ranges = f"{a} {min(d[a]):.4g}..{max(d[a]):.4g}, {b} {min(d[b]):.4g}..{max(d[b]):.4g}"
        if d["form"] == "mean_std":
            formula = f"(z - mean_c) * {float(d['multiplier']):g} / std_c"
        else:
            formula = "(z - shift_c) * scale_c"
        return f"per-channel over {c} channels: {formula} ({ranges}), from {describe_source(d['source'])}"

    # -- the formula ----------------------------------------------------------------------------------------
    def apply(self, z: Z) -> Z:
        """x = (z - shift) * scale. A torch tensor is normalized in place (float32 arithmetic, one exactly
        rounded op at a time) and returned; a numpy array (float32) gives a new array. Channels are axis -3."""
        if hasattr(z, "mul_"):  # torch.Tensor (the shard reader does not import torch)
            t: Any = z
            if self.per_channel is None:
                if self.shift_factor:
                    t.sub_(self.shift_factor)
                return t.mul_(self.scaling_factor)
            scale, shift = self._torch(t.device)
            return t.sub_(shift).mul_(scale)
        if self.per_channel is None:
            if self.shift_factor:
                z = z - np.float32(self.shift_factor)  # type: ignore[operator]
            return z * np.float32(self.scaling_factor)  # type: ignore[operator]
        scale, shift = self._broadcast()
        return (z - shift) * scale  # type: ignore[operator]

    def invert(self, x: Any) -> Any:
        """z = x / scale + shift for a float32 torch tensor [..., C, h, w] (a new tensor), the VAE's input."""
        if self.per_channel is None:
            z = x / float(self.scaling_factor)
            return z + float(self.shift_factor) if self.shift_factor is not None else z
        scale, shift = self._torch(x.device)
        return x / scale + shift

    def _broadcast(self) -> tuple[np.ndarray, np.ndarray]:
        """(scale, shift) shaped to broadcast over [..., C, h, w]: [C, 1, 1], or [C, h, w] per position."""
        scale, shift = self.vectors()
        if scale.ndim == 1:
            return scale[:, None, None], shift[:, None, None]
        return scale, shift

    def _torch(self, device: Any) -> tuple[Any, Any]:
        import torch

        key = f"torch:{device}"
        if key not in self._cache:
            scale, shift = self._broadcast()
            self._cache[key] = (torch.from_numpy(scale.copy()).to(device), torch.from_numpy(shift.copy()).to(device))
        return self._cache[key]


def describe_source(source: Mapping[str, Any]) -> str:
    kind = source.get("kind")
    if kind == "vae_config":
        return "the VAE config's latents_mean/latents_std" + (f" ({source['rule']})" if source.get("rule") else "")
    if kind == "vae_weights":
        return f"the VAE's own statistics ({source.get('what')})"
    if kind == "file":
        sha = str(source.get("sha256") or "")[:12]
        return f"the statistics file {source.get('path')}" + (f" (sha256 {sha}...)" if sha else "")
    if kind == "stats":
        return f"dit-shards stats over {source.get('samples_used')} samples (seed {source.get('seed')})"
    return str(kind)
