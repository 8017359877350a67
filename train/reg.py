"""NanoGen's REG and internal guidance in the trainer: their settings (named after NanoGen's config keys), the cached
class tokens checked before any GPU work, their checkpoint record and the plan line.

The math lives in dit/ (the network: dit/incontext.py `reg_dim`, `base_model_depth`; the loss terms: dit/flow.py with
dit/reg.py). The class tokens are cached at extraction like REPA's teacher tokens (train/repa.py `CachedTeacher`): a
sibling shard set of the same images and views (shards/siblings.py) whose latent is each view's DINOv2 class token
[z, 1, 1] (`dit-extract --encoder dinov2-vit-b --encoder-formula reg`: NanoGen's `target_encoder: dinov2-vit-b`),
joined to the batches by sample key (`train.data.Batch.teacher`, [B, 1, z]).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Mapping

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.settings import setting
from dit_pipeline.dit.reg import REG_COEFF

REG = "REG and internal guidance (NanoGen)"  # the --help section
EXTRACT_HINT = "dit-extract --data-path IMAGES --encoder dinov2-vit-b --encoder-formula reg --dtype float32 --out FOLDER"


@dataclass(kw_only=True)
class RegSettings:
    """NanoGen's `repa.use_reg`, `repa.reg_coeff` and `internal_guidance.*`; dit-train's TrainConfig inherits them."""

    use_reg: bool = setting(
        False, "REG: generate a DINOv2 class token with the image (NanoGen's reg0.03 configs: the token in both "
        "sequences of the in-context DiT-DH, noised with the image's t, trained as a velocity, evolved and guided by "
        "the sampler); needs --reg-tokens", group=REG)
    reg_coeff: float = setting(REG_COEFF, "REG: weight of the class token's velocity loss (logged as reg): loss = "
                               "image loss + coeff x reg", group=REG)
    reg_tokens: str | None = setting(
        None, "REG: a sibling shard folder of each view's class token (" + EXTRACT_HINT + ", from the training "
        "shards' images with the same --image-size, --flip and --samples-per-shard); a data mix names each "
        "source's with reg=", group=REG, shown="none")
    base_model_depth: int | None = setting(
        None, "Internal guidance: train a base head on the encoder's tokens after this block (NanoGen's "
        "internal_guidance.base_model_depth, DiTwDDTHeadIG), which its guidance rule extrapolates from",
        group=REG, shown="off")
    base_model_coeff: float = setting(1.0, "Internal guidance: weight of the base head's velocity loss (logged as "
                                      "base)", group=REG)

    def reg_problems(self, objective: str, model_options: tuple[str, ...], repa: Any, mixed: bool = False
                     ) -> list[str]:
        """Every REG / internal-guidance setting that cannot act; `model_options`: the model family's constructor
        options (the in-context DiT-DH builds the class token and the base head); `mixed`: a data mix, whose
        sources name their class tokens (reg=, checked when the mix is opened: train/mix.py)."""
        p: list[str] = []
        if self.use_reg:
            if not mixed and (not self.reg_tokens or not str(self.reg_tokens).strip()):
                p.append(f"--use-reg needs the class tokens: --reg-tokens FOLDER, made by {EXTRACT_HINT}")
            if not (isinstance(self.reg_coeff, (int, float)) and self.reg_coeff > 0):
                p.append(f"--reg-coeff must be > 0, got {self.reg_coeff!r}")
            if repa is not None:
                p.append("--use-reg with --repa: NanoGen's REG configs train without REPA (use_repa: false); drop one")
        elif self.reg_tokens is not None:
            p.append("--reg-tokens is REG's class tokens: add --use-reg (or drop --reg-tokens)")
        elif self.reg_coeff != REG_COEFF:
            p.append("--reg-coeff weighs REG's class-token loss: add --use-reg")
        if self.base_model_depth is not None and (isinstance(self.base_model_depth, bool)
                                                  or not isinstance(self.base_model_depth, int)
                                                  or self.base_model_depth < 1):
            p.append(f"--base-model-depth must be an encoder block (>= 1), got {self.base_model_depth!r}")
        if self.base_model_depth is None and self.base_model_coeff != 1.0:
            p.append("--base-model-coeff weighs internal guidance's base head: add --base-model-depth")
        if self.base_model_depth is not None and not self.base_model_coeff > 0:
            p.append(f"--base-model-coeff must be > 0, got {self.base_model_coeff!r}")
        on = [f for f, v in (("--use-reg", self.use_reg), ("--base-model-depth", self.base_model_depth)) if v]
        if on and objective != "flow":
            p.append(f"{' and '.join(on)} act on the flow objective (NanoGen's Transport): add --objective flow")
        if on and not {"reg_dim", "base_model_depth"} <= set(model_options):
            p.append(f"{' and '.join(on)}: the class token and the base head are built by NanoGen's in-context "
                     "DiT-DH (--model ddt-en28d1152hd72-dn2d2048hd128 or ddt-en28d1584hd72-dn2d2048hd128)")
        if on and repa is not None and self.base_model_depth:
            p.append("--base-model-depth with --repa is not supported (the alignment head wraps the plain output)")
        return p


@dataclass(frozen=True)
class RegTokens:
    """The cached class tokens of `--reg-tokens FOLDER`: a sibling set whose latent is [z, 1, 1]."""

    folder: str
    manifest: Any
    dim: int
    identity: dict[str, Any]

    @property
    def encoder(self) -> dict[str, Any]:
        """The encoder's identity (what train.mix.check_token_space compares)."""
        return self.identity

    def line(self, coeff: float, mix: Any = None) -> str:
        """The plan's line; `mix` (train.mix.OpenMix): the tokens of each source (reg=), one encoder."""
        enc = self.identity
        where = f"in {self.folder}" if mix is None else \
            "beside each source (" + ", ".join(f"{o.name}: {o.spec.reg}" for o in mix.sources) + ")"
        return (f"  reg         class tokens of {enc.get('model')} ({self.dim} wide, {enc.get('input_size')} px, "
                f"weights {str(enc.get('weights_sha256') or enc.get('weights'))[:24]}) cached {where}; "
                f"loss + {coeff:g} x reg")


def read_reg_tokens(settings: RegSettings, manifest: Any) -> RegTokens | None:
    """--use-reg: the sibling set of class tokens, checked against the training shards' manifest (the same images
    and views, sample for sample) and for what it holds (the `reg` formula's [z, 1, 1] tokens); None without REG."""
    if not settings.use_reg:
        return None
    if manifest is None:
        raise UserError(f"--reg-tokens {settings.reg_tokens}: the cached class tokens need the training shards' "
                        "manifest")
    return open_reg_tokens(str(settings.reg_tokens), manifest, "--reg-tokens")


def open_reg_tokens(folder: str, manifest: Any, flag: str) -> RegTokens:
    """The class tokens in `folder` (given as `flag`: --reg-tokens, or a data mix's source reg=) of the set of
    `manifest`: a sibling of it (shards/siblings.py) holding the `reg` formula's [z, 1, 1] tokens."""
    from dit_pipeline.shards.siblings import read_sibling

    if not (Path(folder).expanduser() / "manifest.json").is_file():
        raise UserError(f"{flag} {folder}: no shard set there (no manifest.json); make it with {EXTRACT_HINT}")
    m = read_sibling(manifest, folder, flag)
    enc = dict(m.extraction.get("encoder") or {})
    c, h, w = m.latent_shape
    if enc.get("formula_name") != "reg" or (h, w) != (1, 1) or m.store != "sample":
        raise UserError(f"{flag} {folder}: holds {c}x{h}x{w} {enc.get('formula_name') or 'VAE'} latents, not "
                        f"class tokens [z, 1, 1]; extract them with {EXTRACT_HINT}")
    return RegTokens(folder, m, int(c), enc)


@dataclass
class RegPart:
    """`reg` (runs with --use-reg): {"reg_coeff", "reg_dim", "target": the class tokens' encoder identity}. Absent
    from checkpoints of runs without REG; a checkpoint and a run must agree on having it and on its values (the
    folder may move; the encoder that made the tokens may not)."""

    record: dict[str, Any] | None
    keys: ClassVar[tuple[str, ...]] = ("reg",)
    required: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def of(cls, cfg: Mapping[str, Any], tokens: RegTokens | None) -> "RegPart":
        if tokens is None:
            return cls(None)
        return cls({"reg_coeff": float(cfg["reg_coeff"]), "reg_dim": tokens.dim, "target": tokens.identity})

    def state_dict(self) -> dict[str, Any]:
        return {} if self.record is None else {"reg": self.record}

    def check(self, ckpt: Mapping[str, Any], where: str) -> None:
        from dit_pipeline.common.features import feature_identity_key

        saved = ckpt.get("reg")
        if (saved is None) != (self.record is None):
            had = "with" if saved is not None else "without"
            raise UserError(f"checkpoint {where} was trained {had} REG (--use-reg); resume it {had} --use-reg, or "
                            "use a new --run-dir")
        if saved is None or self.record is None:
            return
        if float(saved.get("reg_coeff", -1)) != self.record["reg_coeff"]:
            raise UserError(f"checkpoint {where} was trained with --reg-coeff {saved.get('reg_coeff')}, this run "
                            f"asks for {self.record['reg_coeff']:g}; resume with the recorded one or use a new --run-dir")
        if feature_identity_key(saved.get("target")) != feature_identity_key(self.record["target"]):
            raise UserError(f"checkpoint {where} was trained on class tokens of another encoder "
                            f"({(saved.get('target') or {}).get('model')}, weights "
                            f"{(saved.get('target') or {}).get('weights_sha256') or '?'}); pass --reg-tokens of the "
                            "same encoder, or use a new --run-dir")

    def load_state_dict(self, ckpt: Mapping[str, Any]) -> None:
        return None
