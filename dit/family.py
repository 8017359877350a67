"""The one interface every model family answers, and the registry of families and their presets.

A family is one module in dit/ (DiT: models.py, LightningDiT: lightningdit.py, DDT: ddt.py, RAE's DiT-DH:
ditdh.py) whose class derives from `DiffusionTransformer` and is registered with `@register_family` (timm's
`register_model` idea: the class carries its presets). The trainer, EMA, checkpoints, samplers, REPA, FID and
export use only this interface, never the family's name:

- `forward(x, t, y, force_drop_ids, generator, return_hidden)` and `forward_with_cfg` (shared here; every method a
  sampler runs the network through is listed in `NETWORK_METHODS`, which a wrapper such as FSDP2 treats as forwards);
- `config` (the checkpoint's `model_config`: "family" for every family but DiT, so DiT's files are as before)
  and `from_config`; `forward_macs(config)`; `infer_config(state_dict, stored, where)` from a file's tensors;
  `fixed_tensors(config)` (tables a file must hold exactly: the sin-cos table, RoPE buffers);
- `blocks` (what per-block compile and activation checkpointing wrap, in forward order), `num_blocks`,
  `set_grad_checkpointing`, `compile_units()`; `hidden_size_at(k)` (the token width after block k: REPA's
  projector input); `num_heads` / `head_dim` (the attention shape the trainer probes);
- the conditioning path `embed_conditions(t, y, ...)` (t, y -> their embeddings), one method for every family.

Adding a family: docs/ARCHITECTURE.md "Model families".
"""
from __future__ import annotations

import importlib
from typing import Any, ClassVar, Iterable, Mapping, cast

import torch
from torch import nn

from .conditioning import DEFAULT_CONDITIONING, Conditioning, conditioning_of
from .conditions import add_conditions, check_time_input, conditions_of, embed_time
from .layers import choose_blocks

FAMILY_MODULES = ("models", "lightningdit", "ddt", "ditdh", "jit", "imf", "incontext",
                  "pixart")  # imported on first use of the registry
# The methods that run the network, besides forward (a sampler's guided pass): a sharded run registers each as an
# FSDP2 forward method (train/parallel.py), so its parameters are gathered when a sampler calls it.
NETWORK_METHODS = ("forward_with_cfg",)
DEFAULT_FAMILY = "DiT"  # a model_config without "family" (every file before families existed)


class DiffusionTransformer(nn.Module):
    """Base of every family: the shared parts of the interface (module docstring)."""

    family: ClassVar[str]
    presets: ClassVar[Mapping[str, Mapping[str, Any]]]  # preset name -> architecture keyword arguments
    aliases: ClassVar[Mapping[str, str]] = {}           # other spellings of preset names (e.g. the release's)
    overrides: ClassVar[tuple[str, ...]]                # constructor arguments a preset may be overridden with
    config_keys: ClassVar[tuple[str, ...]]              # the keys every model_config of the family holds
    default_objective: ClassVar[str] = "flow"           # what its release trains (dit-train's default for it)
    diffusers_class: ClassVar[str | None] = None         # the diffusers transformer holding it (export), if any
    conditionings: ClassVar[tuple[str, ...]] = ("class",)  # what it can be conditioned on (dit/conditioning.py)

    # set by every family's __init__
    input_size: int
    patch_size: int
    in_channels: int
    out_channels: int
    num_classes: int
    class_dropout_prob: float
    learn_sigma: bool
    grid_size: int
    hidden_size: int
    num_heads: int
    blocks: nn.ModuleList
    conditions: str = "t"  # what the time input holds (dit/conditions.py: "t", "meanflow", "imf")
    condition_kind: str = DEFAULT_CONDITIONING  # what else it is conditioned on (dit/conditioning.py)
    text_dim: int = 0  # the width of its text features (condition_kind "text")

    # -- what every family defines ----------------------------------------------------------------------------
    @property
    def config(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "DiffusionTransformer":
        return cls(**{k: config[k] for k in cls.config_keys if k not in ("model", "family")})

    @staticmethod
    def forward_macs(config: Mapping[str, Any]) -> int:
        raise NotImplementedError

    @classmethod
    def infer_config(cls, state_dict: Mapping[str, torch.Tensor], stored: Mapping[str, Any] | None,
                     where: str, hints: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The model_config of a state_dict of this family: what the tensors show, then the file's own `stored`
        record (checked against the tensors), the preset of these dimensions, last the caller's `hints`."""
        raise NotImplementedError

    @classmethod
    def fixed_tensors(cls, config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return {}

    def hidden_size_at(self, k: int) -> int:
        """Width of the tokens after block k (1..num_blocks)."""
        return self.hidden_size

    @classmethod
    def block_widths(cls, config: Mapping[str, Any]) -> list[int]:
        """The width of every block, in order (memory estimates)."""
        return [int(config["hidden_size"])] * int(config["depth"])

    @classmethod
    def describe(cls, config: Mapping[str, Any]) -> str:
        """The architecture in words for plans and logs: "depth 28, hidden 1152, heads 16, patch 2"."""
        return (f"depth {config['depth']}, hidden {config['hidden_size']}, heads {config['num_heads']}, "
                f"patch {config['patch_size']}")

    # -- shared -----------------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def compile_units(self) -> list[nn.Module]:
        """The modules regional compile wraps: every block and the final layer."""
        final = getattr(self, "final_layer", None)
        return [*self.blocks, *([final] if final is not None else [])]

    def set_grad_checkpointing(self, enable: bool | int | Iterable[int] = True) -> None:
        """Recompute blocks in the backward pass: True = all, False/0 = none, an int n = the first n blocks, or an
        iterable of block indices. Parameter names do not change."""
        chosen = choose_blocks(enable, self.num_blocks)
        for i, block in enumerate(self.blocks):
            setattr(block, "grad_checkpointing", i in chosen)

    def embed_conditions(self, t: torch.Tensor, y: torch.Tensor, force_drop_ids: torch.Tensor | None,
                         generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(time embedding [N, D], label embedding [N, D]): the conditioning every family starts from (each adds
        them as its release does). A further conditioning input (e.g. a second time) joins here."""
        y_embedder = cast(nn.Module, self.y_embedder)
        return embed_time(self, t), y_embedder(y, force_drop_ids, generator)

    def condition_config(self) -> dict[str, Any]:
        """The model_config entry of the conditions (dit/conditions.py): none for a plain model, so its config is
        what it always was."""
        return {} if self.conditions == "t" else {"conditions": self.conditions}

    def set_conditions(self, kind: str) -> "DiffusionTransformer":
        """Add the embedders of conditions `kind` (dit/conditions.py) to this freshly built model; returns it."""
        if kind != self.conditions:
            if self.conditions != "t":
                raise ValueError(f"this {self.family} already has conditions {self.conditions!r}")
            add_conditions(self, kind)
        return self

    def conditioning(self, null_text: torch.Tensor | None = None,
                     null_mask: torch.Tensor | None = None) -> Conditioning:
        """Its conditioning (dit/conditioning.py): what the trainer and the samplers ask about its condition input;
        a text model's null condition is the given empty-prompt features."""
        return conditioning_of({"conditioning": self.condition_kind, "num_classes": self.num_classes,
                                "class_dropout_prob": self.class_dropout_prob, "text_dim": self.text_dim},
                               null_text, null_mask)

    def check_return_hidden(self, return_hidden: int | None) -> None:
        if return_hidden is not None and (isinstance(return_hidden, bool) or not isinstance(return_hidden, int)
                                          or not 1 <= return_hidden <= self.num_blocks):
            raise ValueError(f"return_hidden must be a block count in 1..{self.num_blocks}, got {return_hidden!r}")

    def check_inputs(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> None:
        want = (self.in_channels, self.input_size, self.input_size)
        if x.dim() != 4 or tuple(x.shape[1:]) != want:
            raise ValueError(f"{self.family} expects x of shape [N, {want[0]}, {want[1]}, {want[2]}], "
                             f"got {list(x.shape)}")
        if y.shape != x.shape[:1]:
            raise ValueError(f"y must have shape [{x.shape[0]}], got {list(y.shape)}")
        if self.conditions == "t" and t.shape != x.shape[:1]:
            raise ValueError(f"t and y must have shape [{x.shape[0]}], got {list(t.shape)} and "
                             f"{list(y.shape)}")
        check_time_input(self, t, x.shape[0])

    def unpatchify(self, x: torch.Tensor, channels: int | None = None) -> torch.Tensor:
        """[N, T, p*p*Cout] -> [N, Cout, g*p, g*p]; out[n, c, i*p+a, j*p+b] = x[n, i*g+j, (a*p+b)*Cout+c]; Cout the
        model's out_channels unless `channels` is given."""
        n, p, g = x.shape[0], self.patch_size, self.grid_size
        c = self.out_channels if channels is None else int(channels)
        x = x.reshape(n, g, g, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(n, c, g * p, g * p)

    def forward_with_cfg(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None,
                         cfg_scale: float | torch.Tensor = 1.0, guide_channels: int | str | None = 3,
                         **condition: Any) -> torch.Tensor:
        """Classifier-free guidance for a batch [cond half; uncond half (y = null, or the null text)].

        The first half of x is run twice (with the cond and the null conditions, given in `y` or as the
        conditioning's keyword arguments, e.g. text and text_mask); guided eps = uncond + cfg_scale * (cond -
        uncond) is written into both halves. `guide_channels=3` guides the first 3 latent channels only, as the
        reference sampler does for its published FIDs; None or "all" guides every eps channel. Variance channels
        always pass through unguided. A REG model (its `cls_t` among the conditions) returns (out, cls_pred) with
        the class token's prediction guided alike (NanoGen's utils/guidance_utils.py forward_with_cfg).
        """
        if x.shape[0] % 2:
            raise ValueError(f"forward_with_cfg needs an even batch [cond; uncond], got {x.shape[0]}")
        if self.condition_kind == "class" and self.class_dropout_prob <= 0:
            raise ValueError("classifier-free guidance needs the null class: class_dropout_prob > 0")
        if self.condition_kind == "none":
            raise ValueError("classifier-free guidance needs a condition; this model is unconditional")
        if guide_channels is None or guide_channels == "all":
            guide_channels = self.in_channels
        if not isinstance(guide_channels, int) or not 1 <= guide_channels <= self.in_channels:
            raise ValueError(f"guide_channels must be 1..{self.in_channels}, None or 'all', "
                             f"got {guide_channels!r}")
        half = x[: x.shape[0] // 2]
        out = self.forward(torch.cat([half, half], dim=0), t, y, **condition)
        token = None
        if isinstance(out, tuple):  # REG: (out, cls_pred)
            out, token = out
        eps, rest = out[:, :guide_channels], out[:, guide_channels:]
        cond, uncond = eps.chunk(2, dim=0)
        guided = uncond + cfg_scale * (cond - uncond)
        result = torch.cat([torch.cat([guided, guided], dim=0), rest], dim=1)
        if token is None:
            return result
        cond, uncond = token.chunk(2, dim=0)
        return result, torch.cat([uncond + cfg_scale * (cond - uncond)] * 2, dim=0)  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------------------------
# The registry

_FAMILIES: dict[str, type[DiffusionTransformer]] = {}


def register_family(cls: type[DiffusionTransformer]) -> type[DiffusionTransformer]:
    """Class decorator: make a family (and its presets) known by its `family` name."""
    _FAMILIES[cls.family] = cls
    return cls


def families() -> dict[str, type[DiffusionTransformer]]:
    """Every family by name (DiT first), importing the family modules on first use."""
    if len(_FAMILIES) < len(FAMILY_MODULES):
        for name in FAMILY_MODULES:
            importlib.import_module(f"{__package__}.{name}")
    return dict(_FAMILIES)


def family_class(name: str | None) -> type[DiffusionTransformer]:
    """The class of family `name` (None: DiT); ValueError naming the families otherwise."""
    known = families()
    key = DEFAULT_FAMILY if name is None else str(name)
    if key not in known:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(known)}")
    return known[key]


def family_of_config(config: Mapping[str, Any]) -> type[DiffusionTransformer]:
    return family_class(config.get("family"))


def preset_names() -> list[str]:
    """Every preset of every family, DiT's first."""
    return [name for cls in families().values() for name in cls.presets]


def lookup_preset(name: str) -> tuple[type[DiffusionTransformer], str]:
    """(family class, canonical preset) of a name: exact, or with '-' for '/', any case, or a release's
    spelling (SiT-XL/2 is DiT-XL/2: the same network). ValueError naming the presets otherwise."""
    key = name.strip().replace("\\", "/")
    if key.lower().startswith("sit-"):
        key = "DiT-" + key[4:]
    for cls in families().values():
        spellings = {**{p: p for p in cls.presets}, **cls.aliases}
        for spelling, preset in spellings.items():
            if key.lower() in (spelling.lower(), spelling.replace("/", "-").lower()):
                return cls, preset
    raise ValueError(f"unknown DiT model {name!r}; choose one of: {', '.join(preset_names())}; or SiT's names of "
                     f"the DiT networks: {', '.join(sit_names())}")


def sit_names() -> list[str]:
    """SiT's spellings of DiT's presets (SiT-XL/2 is DiT-XL/2's network), which `lookup_preset` accepts."""
    return ["SiT-" + p[4:] for p in family_class(None).presets if p.startswith("DiT-")]


def preset_of(config: Mapping[str, Any]) -> str | None:
    """The preset whose architecture `config` has (None: a custom size)."""
    cls = family_of_config(config)
    for name, arch in cls.presets.items():
        if all(config.get(k) == v for k, v in arch.items()):
            return name
    return None


def create_model(name: str, input_size: int = 32, num_classes: int = 1000, **overrides: Any) -> DiffusionTransformer:
    """A preset of any family ('DiT-XL/2', 'LightningDiT-XL/1', 'DDT-XL/2', 'DiT-DH-XL'; '-' for '/' accepted)
    for `input_size` latents. `overrides` are the family's constructor arguments (learn_sigma,
    class_dropout_prob, in_channels, block options, or architecture fields for small custom models), and
    `conditions` (dit/conditions.py: "meanflow" adds the second time input h = t - r)."""
    cls, preset = lookup_preset(name)
    conditions = str(overrides.pop("conditions", cls.conditions))  # the family's own (iMF: "imf"), else "t"
    kind = str(overrides.get("conditioning", DEFAULT_CONDITIONING))
    if kind not in cls.conditionings:
        able = [f.family for f in families().values() if kind in f.conditionings]
        raise ValueError(f"a {cls.family} is conditioned on {' or '.join(cls.conditionings)}, not {kind}; "
                         f"{kind} conditioning: {', '.join(able) or 'no family'}")
    if kind == DEFAULT_CONDITIONING:
        overrides.pop("conditioning", None)  # every family's default
    allowed = ("input_size", "num_classes", "learn_sigma", "in_channels", "class_dropout_prob", "conditions",
               *cls.overrides)
    unknown = set(overrides) - set(allowed)
    if unknown:
        raise ValueError(f"unknown {cls.family} options {sorted(unknown)}; allowed: {', '.join(allowed)}")
    model = cls(**{**cls.presets[preset], "input_size": input_size, "num_classes": num_classes, **overrides})
    return model.set_conditions(conditions)


def model_from_config(config: Mapping[str, Any]) -> DiffusionTransformer:
    """The model a `model_config` (a checkpoint's; see DiffusionTransformer.config) describes."""
    cls = family_of_config(config)
    missing = [k for k in cls.config_keys if k not in config and k not in ("model", "family")]
    if missing:
        raise ValueError(f"model_config lacks {missing}; a {cls.family} needs "
                         f"{', '.join(k for k in cls.config_keys if k not in ('model', 'family'))}")
    name = config.get("model")
    if name is not None:
        named, preset = lookup_preset(name)
        if named is not cls or any(config.get(k) != v for k, v in cls.presets[preset].items()):
            raise ValueError(f"model_config names {name!r} but has another architecture: "
                             f"{ {k: config.get(k) for k in cls.presets.get(preset, {})} }")
    return cls.from_config(config).set_conditions(conditions_of(config))


def forward_macs(config: Mapping[str, Any]) -> int:
    """Multiply-accumulates of one forward pass for one image of a model_config (any family)."""
    return family_of_config(config).forward_macs(config)
