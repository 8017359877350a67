"""The learning-rate schedule: a pure function of the optimizer step, so a resumed run sets exactly the lrs the
uninterrupted run set.

    step < warmup:                    lr x min(1, (step + 1) / warmup)          (--warmup-steps / --warmup-epochs)
    then, with --final-lr:
    step < decay_start:               lr
    decay_start <= step < decay_end:  lr x (1 - (1 - final / lr) x (step - decay_start) / (decay_end - decay_start))
    step >= decay_end:                lr x final / lr

`step` counts the optimizer steps done before this one (0 for the first update). The decay is RAE's
(bytetriper/RAE src/utils/optim_utils.py, `schedule_type: linear`): its config's `warmup_epochs: 40` with
`warmup_from_zero: false` holds the lr constant for 40 epochs (it is no warm-up), then decays linearly to
`final_lr` 2e-5 at `decay_end_epoch` 800 and stays there; with `warmup_from_zero: true` it warms up as
(step + 1) / warmup, which is --warmup-steps here. DiT, SiT, REPA and LightningDiT train at a constant lr.

Lengths may be given in epochs. An epoch of the schedule is floor(samples / global batch) optimizer steps, the
number RAE's `steps_per_epoch` (len(loader) // accumulation) comes to, fixed by the shard set and the global
batch, which a resume cannot change (train.parts), so the schedule does not move when a resume changes the
world size or the readers (whose epochs may hold a few steps fewer: the plan shows both).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.settings import flag_name

PAIRS = (("warmup_steps", "warmup_epochs"), ("lr_decay_start_steps", "lr_decay_start_epochs"),
         ("lr_decay_end_steps", "lr_decay_end_epochs"))


def steps_per_epoch(samples: int, global_batch: int) -> int:
    """The schedule's epoch: floor(samples / global batch) steps (at least 1)."""
    return max(1, samples // global_batch)


def schedule_problems(cfg: Any) -> list[str]:
    """Problems of the schedule settings of a TrainConfig, all at once (those that need the shard set's size
    are found by `build_schedule`)."""
    p: list[str] = []
    for steps, epochs in PAIRS:
        if getattr(cfg, epochs) is not None and getattr(cfg, steps):
            p.append(f"{flag_name(steps)} and {flag_name(epochs)} give the same length twice: keep one")
    for name in ("warmup_epochs", "lr_decay_start_epochs", "lr_decay_end_epochs"):
        v = getattr(cfg, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0):
            p.append(f"{flag_name(name)} must be a number of epochs >= 0, got {v!r}")
    for name in ("lr_decay_start_steps", "lr_decay_end_steps"):
        v = getattr(cfg, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            p.append(f"{flag_name(name)} must be a whole number of steps >= 0, got {v!r}")
    decay = [flag_name(n) for pair in PAIRS[1:] for n in pair if getattr(cfg, n) is not None]
    if cfg.final_lr is None:
        if decay:
            p.append(f"{', '.join(decay)} place the lr decay: add --final-lr (the lr it decays to)")
    elif isinstance(cfg.final_lr, bool) or not isinstance(cfg.final_lr, (int, float)) or not cfg.final_lr >= 0:
        p.append(f"--final-lr must be a learning rate >= 0, got {cfg.final_lr!r}")
    return p


@dataclass(frozen=True)
class LrSchedule:
    """The lr of every optimizer step (module docstring); all lengths in steps."""

    lr: float
    warmup: int = 0
    final_lr: float | None = None
    decay_start: int = 0
    decay_end: int = 0
    steps_per_epoch: int = 1     # the schedule's epoch, for the plan's text only

    def lr_at(self, step: int) -> float:
        if self.warmup and step < self.warmup:
            return self.lr * min(1.0, (step + 1) / self.warmup)  # the trainer's warm-up, as it always was
        if self.final_lr is None or step < self.decay_start:
            return self.lr
        ratio = self.final_lr / self.lr
        if step >= self.decay_end:
            return self.lr * ratio
        progress = (step - self.decay_start) / (self.decay_end - self.decay_start)
        return self.lr * (1.0 - (1.0 - ratio) * progress)

    def describe(self) -> str:
        """The plan's words for it, each length in steps and epochs."""
        def at(step: int) -> str:
            return f"step {step:,} (epoch {step / self.steps_per_epoch:g})"

        parts = [f"warm-up from {self.lr / self.warmup:.3g} to {self.lr:g} over {self.warmup:,} steps"] if self.warmup \
            else [f"{self.lr:g}"]
        if self.final_lr is None:
            parts.append("constant" if not self.warmup else "then constant")
        else:
            if self.decay_start > self.warmup:
                parts.append(f"constant to {at(self.decay_start)}")
            parts.append(f"linear to {self.final_lr:g} at {at(self.decay_end)}, then constant")
        return ", ".join(parts)


def _length(cfg: Any, steps: str, epochs: str, per_epoch: int) -> int | None:
    if getattr(cfg, epochs) is not None:
        return int(getattr(cfg, epochs) * per_epoch)  # RAE's int(epochs x steps_per_epoch)
    return getattr(cfg, steps)


def build_schedule(cfg: Any, samples: int) -> LrSchedule:
    """The schedule of a validated TrainConfig for a shard set of `samples`; UserError when its lengths do not
    fit together. The decay ends by default where the run ends (--max-steps, else --epochs in the schedule's
    epochs)."""
    per_epoch = steps_per_epoch(samples, cfg.global_batch_size)
    warmup = _length(cfg, "warmup_steps", "warmup_epochs", per_epoch) or 0
    if cfg.final_lr is None:
        return LrSchedule(float(cfg.lr), warmup, steps_per_epoch=per_epoch)
    start = _length(cfg, "lr_decay_start_steps", "lr_decay_start_epochs", per_epoch)
    end = _length(cfg, "lr_decay_end_steps", "lr_decay_end_epochs", per_epoch)
    if end is None:
        ends = [cfg.max_steps] if cfg.max_steps is not None else []
        ends += [int(cfg.epochs * per_epoch)] if cfg.epochs is not None else []
        end = min(ends)  # validated: every run has a length once train.preflight.resolve_defaults ran
    start = warmup if start is None else start
    if start < warmup:
        raise UserError(f"the lr decay would start at step {start:,}, inside the warm-up ({warmup:,} steps): start it "
                        "at the warm-up's end or later")
    if end <= start:
        raise UserError(f"the lr decay would end at step {end:,}, not after its start at step {start:,} (an epoch is "
                        f"{per_epoch:,} steps: {samples:,} samples / global batch {cfg.global_batch_size}); move "
                        "--lr-decay-end-* later or --lr-decay-start-* earlier")
    return LrSchedule(float(cfg.lr), warmup, float(cfg.final_lr), start, end, per_epoch)


def schedule_line(schedule: LrSchedule, samples: int, global_batch: int, plan_steps: int) -> str:
    """The plan's line on the lr schedule, with the schedule's epoch against the data plan's."""
    per = schedule.steps_per_epoch
    note = "" if plan_steps == per else f"; the readers' epoch 0 has {plan_steps:,} (samples left out so ranks stay even)"
    return (f"  lr          {schedule.describe()}; an epoch = {per:,} steps ({samples:,} samples / global batch "
            f"{global_batch}){note}")
