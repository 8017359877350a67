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

Lengths may be given in epochs: an epoch of the schedule is an epoch of the run, the optimizer steps its readers'
plan gives (train.partition: a few samples short of samples / global batch, so every rank runs the same steps),
as RAE's `steps_per_epoch` is its loader's; `--lr-decay-end-epochs 800` with `--epochs 800` reaches the final lr
at the run's last step. A fractional epoch counts that share of the epoch's steps, rounded down. The schedule is
fixed in steps before training (from the shard set, the global batch and the data layout), so a resume under the
same layout sets exactly the same lrs; a resume that changes the layout (warned: its data order changes too)
moves the epoch boundaries by the few steps in which its epochs differ.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.settings import flag_name

PAIRS = (("warmup_steps", "warmup_epochs"), ("lr_decay_start_steps", "lr_decay_start_epochs"),
         ("lr_decay_end_steps", "lr_decay_end_epochs"))


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
    steps_per_epoch: float = 1.0  # steps of an epoch (the run's first), for the plan's text only
    epoch_of: tuple[tuple[int, float], ...] = ()  # (step, the epoch it was given as), for the plan's text only

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
            given = dict(self.epoch_of)
            epoch = f"epoch {given[step]:g}" if step in given else f"~epoch {step / self.steps_per_epoch:.4g}"
            return f"step {step:,} ({epoch})"

        parts = [f"warm-up from {self.lr / self.warmup:.3g} to {self.lr:g} over {self.warmup:,} steps"] if self.warmup \
            else [f"{self.lr:g}"]
        if self.final_lr is None:
            parts.append("constant" if not self.warmup else "then constant")
        else:
            if self.decay_start > self.warmup:
                parts.append(f"constant to {at(self.decay_start)}")
            parts.append(f"linear to {self.final_lr:g} at {at(self.decay_end)}, then constant")
        return ", ".join(parts)


def build_schedule(cfg: Any, steps_at: Callable[[float], int], run_steps: int) -> LrSchedule:
    """The schedule of a validated TrainConfig, every length in steps: `steps_at(e)` is the optimizer steps
    before epoch e of this run (e may be fractional), `run_steps` the run's length, where the decay ends unless
    told otherwise. UserError when the lengths do not fit together."""
    epoch_of: dict[int, float] = {}

    def length(steps: str, epochs: str) -> int | None:
        if getattr(cfg, epochs) is None:
            return getattr(cfg, steps)
        n = steps_at(float(getattr(cfg, epochs)))
        epoch_of[n] = float(getattr(cfg, epochs))
        return n

    per_epoch = float(steps_at(1.0))
    warmup = length("warmup_steps", "warmup_epochs") or 0
    if cfg.final_lr is None:
        return LrSchedule(float(cfg.lr), warmup, steps_per_epoch=per_epoch, epoch_of=tuple(sorted(epoch_of.items())))
    start = length("lr_decay_start_steps", "lr_decay_start_epochs")
    end = length("lr_decay_end_steps", "lr_decay_end_epochs")
    if end is None:
        end = run_steps
        if cfg.epochs is not None and (cfg.max_steps is None or run_steps < cfg.max_steps):
            epoch_of.setdefault(end, float(cfg.epochs))
    start = warmup if start is None else start
    if start < warmup:
        raise UserError(f"the lr decay would start at step {start:,}, inside the warm-up ({warmup:,} steps): start it "
                        "at the warm-up's end or later")
    if end <= start:
        raise UserError(f"the lr decay would end at step {end:,}, not after its start at step {start:,} (this run's "
                        f"first epoch is {per_epoch:,.0f} steps); move --lr-decay-end-* later or --lr-decay-start-* "
                        "earlier")
    return LrSchedule(float(cfg.lr), warmup, float(cfg.final_lr), start, end, per_epoch,
                      tuple(sorted(epoch_of.items())))


def schedule_line(schedule: LrSchedule) -> str:
    """The plan's line on the lr schedule."""
    return f"  lr          {schedule.describe()}"
