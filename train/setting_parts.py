"""The parts of the training checkpoint that record what the run is (train/parts.py lists them): its objective
(`objective` and what the objective records beside it), its shard set (`manifest_fingerprint`, `latent`) and its
config (`config`). They hold no live state: each is a record and the rule for resuming against it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.latent_norm import LatentNorm
from dit_pipeline.shards import Manifest
from dit_pipeline.train.part_types import Checkpoint, NoCheck


def _prediction_flags(record: Any) -> str:
    """The dit-train flags of a flow model's prediction record (dit.flow_predictions.prediction_from_record)."""
    if not isinstance(record, dict):
        return "--prediction v" if record is None else f"an unknown prediction {record!r}"
    eps = f" --t-eps {record['t_eps']:g}" if isinstance(record.get("t_eps"), (int, float)) else ""
    if record.get("kind") == "v":
        return "--prediction v" + (f" --v-target clamped{eps}" if eps else "")
    return f"--prediction {record.get('kind')}{eps}"


@dataclass
class ObjectivePart(NoCheck):
    """`objective`: what the model learns (dit/objectives.py; a checkpoint without the key is ddpm), and what the
    objective records beside it (`ObjectiveSpec.record`): for flow `time_shift`, the shift of its training times
    (dit/shift.py) that its samplers use (absent: 1, none); for meanflow and imf `meanflow`, its settings, which a
    resume must repeat."""

    objective: str
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    keys: ClassVar[tuple[str, ...]] = ("objective", "time_shift", "meanflow", "prediction", "perceptual",
                                       "internal_guidance")
    required: ClassVar[tuple[str, ...]] = ()

    def state_dict(self) -> dict[str, Any]:
        from dit_pipeline.dit.objectives import spec

        return {"objective": self.objective, **spec(self.objective).record(self.config)}

    def check(self, ckpt: Checkpoint, where: str) -> None:
        from dit_pipeline.dit.objectives import recorded_objective

        # "imf" of a network other than iMF's: this project's variant, recorded so before it was named imf-adaln
        saved = recorded_objective(ckpt.get("objective", "ddpm"), ckpt.get("model_config"))
        if saved != self.objective:
            raise UserError(f"checkpoint {where} was trained with --objective {saved}, this run asks for "
                            f"--objective {self.objective}; resume with the same objective or use a new --run-dir")
        if ckpt.get("prediction") != self.state_dict().get("prediction"):
            raise UserError(f"checkpoint {where} was trained with {_prediction_flags(ckpt.get('prediction'))} "
                            f"(recorded {ckpt.get('prediction')}), this run asks for "
                            f"{_prediction_flags(self.state_dict().get('prediction'))}; resume with the recorded "
                            "--prediction, --v-target and --t-eps or use a new --run-dir")
        if ckpt.get("perceptual") != self.state_dict().get("perceptual"):
            raise UserError(f"checkpoint {where} was trained with perceptual terms {ckpt.get('perceptual')}, this run "
                            f"asks for {self.state_dict().get('perceptual')}; resume with the recorded --lpips, --pdino "
                            "and their weights, or use a new --run-dir")
        if ckpt.get("internal_guidance") != self.state_dict().get("internal_guidance"):
            raise UserError(f"checkpoint {where} was trained with internal guidance's base head "
                            f"{ckpt.get('internal_guidance')}, this run asks for "
                            f"{self.state_dict().get('internal_guidance')}; resume with the recorded "
                            "--base-model-depth and --base-model-coeff, or use a new --run-dir")
        want = self.state_dict().get("meanflow")
        if want is not None and ckpt.get("meanflow") != want:
            from dit_pipeline.dit.objectives import MF_ABSENT

            have = ckpt.get("meanflow") or {}
            # a key absent from either side: what it meant before the setting existed (MF_ABSENT)
            changed = sorted(k for k in {*want, *(k for k in have if k in MF_ABSENT)}
                             if have.get(k, MF_ABSENT.get(k)) != want.get(k, MF_ABSENT.get(k)))
            if changed:
                diffs = [f"--{k.replace('_', '-')} {have.get(k, MF_ABSENT.get(k))} there, "
                         f"{want.get(k, MF_ABSENT.get(k))} here" for k in changed]
                raise UserError(f"checkpoint {where} was trained with other MeanFlow settings ({'; '.join(diffs)}); "
                                "resume with the recorded ones or use a new --run-dir")

    def load_state_dict(self, ckpt: Checkpoint) -> None:
        return None


@dataclass
class ShardSetPart(NoCheck):
    """`manifest_fingerprint` (the shard set trained on) and `latent` (its latent normalization, VAE and class
    names, which dit-sample decodes and labels with; `normalization` only for a per-channel one, so a scalar
    record is what it always was).

    Resuming needs the same normalization (the numbers, common.latent_norm.LatentNorm.key) and the same
    fingerprint: a manifest revision that renormalized the set (`dit-shards stats --write`) is refused by
    name, before the fingerprint check would call it another shard set."""

    fingerprint: str
    latent: dict[str, Any]
    revision: int = 1                  # the manifest's revision (for the refusal's message)
    mixed: bool = False                # a data mix: its sources are compared by the mix's part (train/mixpart.py)
    keys: ClassVar[tuple[str, ...]] = ("manifest_fingerprint", "latent")
    required: ClassVar[tuple[str, ...]] = ("manifest_fingerprint",)

    @classmethod
    def of(cls, manifest: Manifest, fingerprint: str) -> "ShardSetPart":
        latent = {**manifest.norm.record(), "vae": manifest.extraction.get("vae"),
                  "class_names": list(manifest.class_names or [])}
        if manifest.extraction.get("encoder"):  # a feature space (common/features.py): which encoder's features
            latent["encoder"] = manifest.extraction["encoder"]
        return cls(fingerprint, latent, manifest.revision_number)

    def state_dict(self) -> dict[str, Any]:
        return {"manifest_fingerprint": self.fingerprint, "latent": self.latent}

    def check(self, ckpt: Checkpoint, where: str) -> None:
        saved = ckpt.get("latent")
        if isinstance(saved, Mapping) and saved.get("scaling_factor") is not None:
            theirs, mine = LatentNorm.from_record(saved), LatentNorm.from_record(self.latent)
            if theirs.key() != mine.key():
                raise UserError(f"checkpoint {where} was trained on latents normalized as {theirs.describe()}; the "
                                f"shards' manifest (revision {self.revision}) now normalizes them as "
                                f"{mine.describe()}. If the set was renormalized (dit-shards stats --write), resume "
                                "against the manifest it was trained on, kept beside the new one (--manifest "
                                "SHARDS/manifest.json.revN); otherwise pass the --shards it was trained on, or use a "
                                "new --run-dir.")
        if self.mixed:
            return
        if ckpt.get("mix") is not None:
            names = ", ".join(str(src.get("name")) for src in ckpt["mix"].get("sources") or [])
            raise UserError(f"checkpoint {where} was trained on a data mix ({names}); pass its sources (--source / "
                            "--mix) to continue it, or a new --run-dir.")
        if ckpt["manifest_fingerprint"] != self.fingerprint:
            raise UserError(f"checkpoint {where} was trained on a different shard set (manifest fingerprint "
                            f"{str(ckpt['manifest_fingerprint'])[:12]}..., these shards {self.fingerprint[:12]}...). "
                            "Pass the same --shards, or a new --run-dir.")

    def load_state_dict(self, ckpt: Checkpoint) -> None:
        return None


@dataclass
class ConfigPart:
    """`config`: the resolved TrainConfig as a JSON-compatible dict. A resumed run keeps the global batch
    (the data position and the per-step randomness are counted in its steps)."""

    config: dict[str, Any]
    keys: ClassVar[tuple[str, ...]] = ("config",)
    required: ClassVar[tuple[str, ...]] = ("config",)

    def state_dict(self) -> dict[str, Any]:
        return {"config": self.config}

    def check(self, ckpt: Checkpoint, where: str) -> None:
        saved, want = ckpt["config"].get("global_batch_size"), self.config["global_batch_size"]
        if saved != want:
            raise UserError(f"checkpoint {where} was trained with --global-batch-size {saved}, this run asks for "
                            f"{want}; a resumed run must keep the global batch (start a new "
                            "--run-dir to change it)")

    def load_state_dict(self, ckpt: Checkpoint) -> None:
        return None
