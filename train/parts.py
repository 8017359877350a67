"""The named stateful parts of a training run: each owns its checkpoint keys.

A part knows three things about its keys (torchtitan's `checkpointer.build(states=...)`, edm2's
`CheckpointIO(net=..., optimizer=..., ema=...)`):
- `state_dict()`: its keys' values for a checkpoint (JSON-compatible values or tensors only, so the file loads
  with `torch.load(weights_only=True)`);
- `check(ckpt, where)`: whether a checkpoint can continue this run, a `UserError` naming the mismatch. Every
  part's check runs before any part loads, so a refused checkpoint never half-loads;
- `load_state_dict(ckpt)`: continue from the checkpoint.
`required` names the keys a complete checkpoint holds for the part; the others may be absent in files written
before the key existed. `train.checkpoint` composes the parts into one file (format name and version, atomic
write, retention, safe read); `build_parts` is the one list of them, so a new checkpoint key is a new part
here (or a key of an existing one) and nothing else.

A part built for checking only (train.resume, before any GPU work) gets a meta-device model and no live
optimizer: its check needs the run's shapes and settings, never live state.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Protocol, Sequence

import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.latent_norm import LatentNorm
from dit_pipeline.common.log import get_logger
from dit_pipeline.common.seeding import rng_state, set_rng_state
from dit_pipeline.dit.family import DiffusionTransformer as DiT  # any family's model
from dit_pipeline.dit.repa import REPAModel
from dit_pipeline.dit.weight_match import check_state_dict
from dit_pipeline.dit.weights import WeightsError
from dit_pipeline.shards import Manifest
from dit_pipeline.train.guard import GuardPart
from dit_pipeline.train.mixpart import MixPart
from dit_pipeline.train.optim import check_state
from dit_pipeline.train.parallel import load_module, load_optimizer, optimizer_state
from dit_pipeline.train.partition import DataLayout, map_position
from dit_pipeline.train.reg import RegPart
from dit_pipeline.train.state import TrainState
from dit_pipeline.train.text import TextPart

Checkpoint = Mapping[str, Any]  # a loaded checkpoint: key -> value


class Part(Protocol):
    keys: ClassVar[tuple[str, ...]]        # the checkpoint keys this part writes
    required: ClassVar[tuple[str, ...]]    # those a complete checkpoint must hold

    def state_dict(self) -> dict[str, Any]: ...

    def check(self, ckpt: Checkpoint, where: str) -> None: ...

    def load_state_dict(self, ckpt: Checkpoint) -> None: ...


class _NoCheck:
    """Mixin for parts whose every saved value can continue any run of this config."""

    def check(self, ckpt: Checkpoint, where: str) -> None:
        return None


def _tensors_fit(state_dict: Any, model_config: dict[str, Any], where: str) -> None:
    try:
        check_state_dict(state_dict, model_config, where=where)
    except WeightsError as e:
        raise UserError(f"{e}. Nothing was loaded.") from None


def _prediction_flags(record: Any) -> str:
    """The dit-train flags of a flow model's prediction record (dit.flow_predictions.prediction_from_record)."""
    if not isinstance(record, dict):
        return "--prediction v" if record is None else f"an unknown prediction {record!r}"
    eps = f" --t-eps {record['t_eps']:g}" if isinstance(record.get("t_eps"), (int, float)) else ""
    if record.get("kind") == "v":
        return "--prediction v" + (f" --v-target clamped{eps}" if eps else "")
    return f"--prediction {record.get('kind')}{eps}"


@dataclass
class ObjectivePart(_NoCheck):
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
class ModelPart:
    """`model` (the raw DiT's state_dict, official names) and `model_config` (DiT.config)."""

    model: DiT
    keys: ClassVar[tuple[str, ...]] = ("model", "model_config")
    required: ClassVar[tuple[str, ...]] = ("model", "model_config")

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "model_config": self.model.config}

    def check(self, ckpt: Checkpoint, where: str) -> None:
        want, have = self.model.config, ckpt["model_config"]
        keys = [k for k in dict.fromkeys([*want, *have]) if k != "model"]  # block options appear only when on
        diff = [f"{k}: checkpoint {have.get(k)!r}, this run {want.get(k)!r}" for k in keys
                if have.get(k) != want.get(k)]
        if diff:
            raise UserError(f"checkpoint {where} is for a different model ({have.get('model') or 'custom'}): "
                            + "; ".join(diff) + ". Use the same --model and overrides, or a new --run-dir.")
        _tensors_fit(ckpt["model"], want, f"{where} [model]")

    def load_state_dict(self, ckpt: Checkpoint) -> None:
        load_module(self.model, ckpt["model"])  # whole tensors, or this rank's shards (train.parallel)


@dataclass
class ShardSetPart(_NoCheck):
    """`manifest_fingerprint` (the shard set trained on) and `latent` (its latent normalization, VAE and class
    names, which dit-sample decodes and labels with; `normalization` only for a per-channel one, so a scalar
    record is what it always was).

    Resuming needs the same normalization (the numbers, common.latent_norm.LatentNorm.key) and the same
    fingerprint: a manifest revision that renormalized the set (`dit-shards stats --write`) is refused by
    name, before the fingerprint check would call it another shard set."""

    fingerprint: str
    latent: dict[str, Any]
    revision: int = 1                  # the manifest's revision (for the refusal's message)
    mixed: bool = False                # a data mix: its sources are compared by the mix's part (train/mixdata.py)
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


@dataclass
class EmaPart:
    """`ema`: the fp32 EMA weights (official names), held by rank 0 only under DDP (`ema` None elsewhere), by
    every rank as its shards under the sharded modes (train.parallel)."""

    ema: DiT | None
    model_config: dict[str, Any]
    keys: ClassVar[tuple[str, ...]] = ("ema",)
    required: ClassVar[tuple[str, ...]] = ("ema",)

    def state_dict(self) -> dict[str, Any]:
        assert self.ema is not None, "the EMA lives on the ranks that write checkpoints"
        return {"ema": self.ema.state_dict()}

    def check(self, ckpt: Checkpoint, where: str) -> None:
        _tensors_fit(ckpt["ema"], self.model_config, f"{where} [ema]")

    def load_state_dict(self, ckpt: Checkpoint) -> None:
        if self.ema is not None:
            load_module(self.ema, ckpt["ema"])


@dataclass
class ProjectorPart:
    """`projector` (runs with --repa): the alignment projectors' state_dict, the aligned block and the teacher.
    Absent from checkpoints of runs without alignment; a checkpoint and a run must agree on having it."""

    head: REPAModel | None              # None: this run trains without --repa
    teacher: dict[str, Any] | None = None  # the teacher's identity (common.teacher), recorded
    keys: ClassVar[tuple[str, ...]] = ("projector",)
    required: ClassVar[tuple[str, ...]] = ()

    def state_dict(self) -> dict[str, Any]:
        if self.head is None:
            return {}
        return {"projector": {"state_dict": self.head.projectors.state_dict(), **self.head.config,
                              "teacher": self.teacher}}

    def check(self, ckpt: Checkpoint, where: str) -> None:
        saved = ckpt.get("projector")
        if self.head is None:
            if saved is not None:
                raise UserError(f"checkpoint {where} was trained with --repa (its projector is in the file); pass "
                                "--repa again to continue it, or use a new --run-dir")
            return
        if saved is None:
            raise UserError(f"checkpoint {where} was trained without --repa; continue it without --repa, or use a "
                            "new --run-dir to train with alignment")
        want = self.head.config
        diff = [f"{k}: checkpoint {saved.get(k)!r}, this run {v!r}" for k, v in want.items() if saved.get(k) != v]
        if diff:
            raise UserError(f"checkpoint {where} aligns differently ({'; '.join(diff)}); use the same --repa-depth "
                            "and teacher, or a new --run-dir")
        mine = self.head.projectors.state_dict()
        theirs = saved["state_dict"]
        if set(theirs) != set(mine) or any(theirs[k].shape != v.shape for k, v in mine.items()):
            raise UserError(f"checkpoint {where}: its projector's tensors do not fit this run's. Nothing was loaded.")

    def load_state_dict(self, ckpt: Checkpoint) -> None:
        if self.head is not None:
            load_module(self.head.projectors, ckpt["projector"]["state_dict"])


@dataclass
class OptimizerPart:
    """`opt`: the optimizer's state_dict over the trainable tensors (the DiT's, then the projector's with
    --repa): AdamW's one parameter group, or with --optimizer muon {"muon": ..., "adamw": ...} (train.optim). A DDP
    run keeps torch's layout (tensors by index); a sharded run's are keyed by parameter name (train.parallel), and
    either continues in either mode."""

    opt: torch.optim.Optimizer | None
    trainable: int                      # trainable tensors of the model
    kind: str = "adamw"                 # --optimizer
    module: torch.nn.Module | None = None  # the module whose trainable tensors it updates (their names)
    keys: ClassVar[tuple[str, ...]] = ("opt",)
    required: ClassVar[tuple[str, ...]] = ("opt",)

    def state_dict(self) -> dict[str, Any]:
        assert self.opt is not None and self.module is not None
        return {"opt": optimizer_state(self.module, self.opt)}

    def check(self, ckpt: Checkpoint, where: str) -> None:
        problem = check_state(ckpt["opt"], self.kind, self.trainable, where)
        if problem:
            raise UserError(problem)

    def load_state_dict(self, ckpt: Checkpoint) -> None:
        assert self.opt is not None and self.module is not None
        load_optimizer(self.module, self.opt, ckpt["opt"])


@dataclass
class ScalerPart(_NoCheck):
    """`scaler`: fp16's GradScaler state (None when the run does not use one)."""

    scaler: torch.amp.GradScaler | None
    keys: ClassVar[tuple[str, ...]] = ("scaler",)
    required: ClassVar[tuple[str, ...]] = ()

    def state_dict(self) -> dict[str, Any]:
        on = self.scaler is not None and self.scaler.is_enabled()
        return {"scaler": self.scaler.state_dict() if on else None}  # type: ignore[union-attr]

    def load_state_dict(self, ckpt: Checkpoint) -> None:
        if self.scaler is not None and self.scaler.is_enabled() and ckpt.get("scaler") is not None:
            self.scaler.load_state_dict(ckpt["scaler"])


@dataclass
class ProgressPart(_NoCheck):
    """`step`, `epoch` and `data`: optimizer steps done and where the data stream continues.

    The data position is (epoch, step in epoch) with the data layout it was made under; the end of an epoch
    is stored as the start of the next. A resume under another layout maps the position
    (`train.partition.map_position`) and says so. Skipped shards (--skip-bad-shards) are kept by name, since
    every later epoch plan leaves them out.
    """

    state: TrainState
    layout: DataLayout
    steps_in: Callable[[int], int]      # epoch -> its optimizer steps (the epoch plan, bad shards left out)
    # whether a saved layout continues the same sample stream (a shard set: all of it; a mix: not the world size)
    same_stream: Callable[[DataLayout, DataLayout], bool] | None = None
    keys: ClassVar[tuple[str, ...]] = ("step", "epoch", "data")
    required: ClassVar[tuple[str, ...]] = ("step", "epoch", "data")

    def position(self) -> tuple[int, int]:
        """(epoch, step_in_epoch) to store."""
        s = self.state
        if s.step_in_epoch >= self.steps_in(s.epoch):
            return s.epoch + 1, 0
        return s.epoch, s.step_in_epoch

    def state_dict(self) -> dict[str, Any]:
        s = self.state
        epoch, in_epoch = self.position()
        layout = s.carried if s.carried is not None and epoch == s.epoch else self.layout  # what reads `epoch`
        return {"step": s.step, "epoch": epoch,
                "data": {"epoch": epoch, "step_in_epoch": in_epoch, **layout.to_dict(),
                         "overflow_steps": s.overflow_steps, "bad_shards": s.bad_shards,
                         "bad_shard_names": list(s.bad_shard_names)}}

    def load_state_dict(self, ckpt: Checkpoint) -> None:
        data, s = ckpt["data"], self.state
        # before the position is mapped: the epoch plans count the skipped shards as empty (a checkpoint
        # written before the names were kept has none: its count stays as it was)
        s.bad_shard_names = [str(n) for n in data.get("bad_shard_names", [])]
        epoch, step_in_epoch, exact = self._map(data)
        s.step, s.epoch, s.step_in_epoch, s.exact = int(ckpt["step"]), epoch, step_in_epoch, exact
        s.overflow_steps = int(data.get("overflow_steps", 0))
        s.bad_shards = max(len(s.bad_shard_names), int(data.get("bad_shards", 0)))

    def _map(self, data: Mapping[str, Any]) -> tuple[int, int, bool]:
        """(epoch, step in epoch, exact) where this run continues. Under another data layout (another world size,
        micro-batch or loader layout) in the middle of an epoch, the rest of that epoch is read as the saved layout
        reads it (`state.carried`, train.handover): the same global sample sequence, said in the log."""
        # a field the checkpoint lacks counts as changed (-1): the position is mapped, never silently reused
        saved = DataLayout(**{k: int(data.get(k, -1)) for k in DataLayout.__dataclass_fields__})
        self.state.carried = None
        steps = self.steps_in(int(data["epoch"]))  # this run's plan of that epoch
        pos = map_position(int(data["epoch"]), int(data["step_in_epoch"]), saved, self.layout, steps)
        if not pos.exact and self.same_stream is not None and self.same_stream(saved, self.layout):
            get_logger().info(f"resuming with world size {saved.world_size} -> {self.layout.world_size} (micro-batch "
                              f"{saved.micro_batch} -> {self.layout.micro_batch}): the mix's global sample sequence "
                              "continues where it stopped, no sample of the epoch seen twice or skipped")
            return pos.epoch, pos.step_in_epoch, True
        if pos.exact or int(data["step_in_epoch"]) == 0:
            return pos.epoch, pos.step_in_epoch, pos.exact
        changed = ", ".join(f"{k} {getattr(saved, k)} -> {getattr(self.layout, k)}"
                            for k in DataLayout.__dataclass_fields__ if getattr(saved, k) != getattr(self.layout, k))
        if all(v >= 0 for v in saved.to_dict().values()):
            self.state.carried = saved  # the saved run's plan of this epoch, from its position on
            self.state.epoch = int(data["epoch"])
            total = self.steps_in(int(data["epoch"]))
            get_logger().info(
                f"resuming with a different data layout ({changed}) at step {data['step_in_epoch']} of {total} of "
                f"epoch {data['epoch']}: the rest of this epoch reads the {saved.world_size} rank stream(s) of the "
                "saved run (train/handover.py), so each step trains on the samples the uninterrupted run's step "
                "would and no sample of the epoch is seen twice or skipped; later epochs are planned for this layout. "
                "The per-rank noise draws differ, so the run is no longer identical to an uninterrupted one.")
            return int(data["epoch"]), int(data["step_in_epoch"]), False
        get_logger().warning(
            f"resuming with a different data layout ({changed}): the reading order of epoch {pos.epoch} "
            f"changes, so training continues at step {pos.step_in_epoch} of {steps} of that epoch in the "
            "new order; within this epoch some samples may be seen twice and others not at all. Later "
            "epochs are complete. The run is no longer identical to an uninterrupted one.")
        return pos.epoch, pos.step_in_epoch, pos.exact


class RngPart(_NoCheck):
    """`rng`: the global torch / numpy / Python (and CUDA) generator states. The training randomness itself
    is derived from integers (common.seeding); these are kept so any code that draws from the global
    generators also continues where it stopped."""

    keys: ClassVar[tuple[str, ...]] = ("rng",)
    required: ClassVar[tuple[str, ...]] = ()

    def state_dict(self) -> dict[str, Any]:
        return {"rng": rng_state()}

    def load_state_dict(self, ckpt: Checkpoint) -> None:
        if ckpt.get("rng"):
            set_rng_state(ckpt["rng"])


# Every part type, in the order their checks run (the first mismatch is the one reported): what the run is
# (objective, model, shard set, global batch) before the state that must fit it.
PART_TYPES: tuple[type[Part], ...] = (ObjectivePart, RegPart, ModelPart, ShardSetPart, ConfigPart, EmaPart,
                                      ProjectorPart, OptimizerPart, ScalerPart, TextPart, ProgressPart, MixPart, RngPart,
                                      GuardPart)
REQUIRED_KEYS: tuple[str, ...] = tuple(k for t in PART_TYPES for k in t.required)


def build_parts(*, objective: str, config: dict[str, Any], shard_set: ShardSetPart,
                model: DiT, ema: DiT | None = None, head: REPAModel | None = None,
                teacher: dict[str, Any] | None = None,
                opt: torch.optim.Optimizer | None = None, scaler: torch.amp.GradScaler | None = None,
                progress: ProgressPart | None = None, guard: GuardPart | None = None,
                text: dict[str, Any] | None = None, reg: RegPart | None = None,
                mix: MixPart | None = None) -> list[Part]:
    """The parts of one run, in PART_TYPES order. For checking only (no live optimizer yet), `model` (and the
    alignment `head` around it) may live on the meta device and ema/opt/scaler/progress be None."""
    trained = head if head is not None else model
    trainable = sum(1 for q in trained.parameters() if q.requires_grad)
    parts: list[Part] = [ObjectivePart(objective, config), reg if reg is not None else RegPart(None),
                         ModelPart(model), shard_set, ConfigPart(config), EmaPart(ema, model.config),
                         ProjectorPart(head, teacher),
                         OptimizerPart(opt, trainable, str(config.get("optimizer", "adamw")), trained),
                         ScalerPart(scaler),
                         TextPart(text)]
    if progress is not None:
        parts.append(progress)
    if mix is not None:  # a data mix's record, counts and history (train/mixdata.py), after the progress it moves
        parts.append(mix)
    if progress is not None:
        parts.append(RngPart())
    if guard is not None:  # the divergence guard's state (train/guard.py)
        parts.append(guard)
    return parts


def compose(parts: Sequence[Part]) -> dict[str, Any]:
    """The checkpoint content of `parts` (without format and version); each key written by one part."""
    out: dict[str, Any] = {}
    for part in parts:
        values = part.state_dict()  # every key of the part, or none of an optional part that is off
        assert set(values) <= set(part.keys) and not set(values) & set(out), type(part).__name__
        out.update(values)
    return out


def check_all(parts: Sequence[Part], ckpt: Checkpoint, where: str) -> None:
    """Every part's resume rule, in order; the first mismatch raises (nothing is loaded before this passes)."""
    for part in parts:
        part.check(ckpt, where)


def load_all(parts: Sequence[Part], ckpt: Checkpoint, where: str) -> None:
    """Continue every part from `ckpt`, after all of their checks passed."""
    check_all(parts, ckpt, where)
    for part in parts:
        part.load_state_dict(ckpt)
