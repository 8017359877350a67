"""The divergence guard (`--on-divergence stop|skip|rollback`): what a step with a non-finite loss or gradient,
or a gradient-norm spike, does to a long run.

- `stop` (the default, the trainer's behaviour before the guard existed): every rank stops before the
  optimizer update; the last checkpoint is intact.
- `skip`: the step is not applied (no optimizer update, no EMA update; the step and its batch are consumed,
  as a GradScaler skips an fp16 overflow). A step is also skipped when its gradient norm exceeds
  `--spike-factor` times the running median of the last `--spike-window` applied steps (the test starts once
  the window is full). After `--max-skips` skipped steps within `--skip-window` steps the run stops.
- `rollback`: as `skip`, but after `--max-skips` skipped steps within `--skip-window` steps the run goes back
  to the newest checkpoint that passed (one written with no skipped step in its window) and continues with the
  data stream advanced past every batch read since that checkpoint: large-model practice for loss spikes
  (PaLM, Chowdhery et al. 2022, sec. 5.1: restart about 100 steps before the spike and skip the batches
  around it). A second rollback to the same checkpoint stops the run with one line.

Every rank decides alike: the verdict is a function of the all-reduced loss and the gradient norm every rank
shares, taken before the optimizer step (train/loop.py). The data position after rollbacks is a pure function
of the recorded rollbacks (data batch = optimizer step + the batches each rollback skipped), and the guard's
state (the median window, the skips, the rollbacks, the newest passed checkpoint) is a checkpoint part, so a
run killed at any stage and resumed continues exactly as the uninterrupted one. A rollback rewrites the
checkpoint it returns to (same weights, the advanced data position, the rollback recorded) and sets the
checkpoints of the abandoned steps aside in `checkpoints/rolled-back/`, so `--resume auto` continues the new
path and a kill during the rollback repeats it.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping

from dit_pipeline.common.faults import fault_at
from dit_pipeline.common.settings import choice, flag_name, positive, setting

GUARD = "Divergence guard"
POLICIES = ("stop", "skip", "rollback")
MAX_EVENTS = 1000            # skip and rollback events kept in the checkpoint (the counts are kept whole)
SPIKE = 1e4                  # the loss factor of an injected gradient spike (tests)


@dataclass(kw_only=True)
class GuardSettings:
    """The divergence guard's settings (TrainConfig inherits them; module docstring)."""

    on_divergence: str = setting(
        "stop", "A non-finite loss or gradient: stop every rank before the update; skip the step (and gradient-norm "
        "spikes), stopping after --max-skips in --skip-window steps; or rollback: skip, and after --max-skips in "
        "--skip-window steps return to the newest checkpoint that passed, past the batches read since",
        group=GUARD, choices=POLICIES)
    spike_factor: float = setting(10.0, "skip / rollback: also skip a step whose gradient norm exceeds this many "
                                  "times the running median of the last --spike-window applied steps", group=GUARD)
    spike_window: int = setting(100, "Applied steps in the gradient norm's running median (spikes are tested once "
                                "it is full)", group=GUARD)
    max_skips: int = setting(3, "Skipped steps within --skip-window steps that stop (skip) or roll back (rollback) "
                             "the run", group=GUARD)
    skip_window: int = setting(200, "Steps in which --max-skips skipped steps count", group=GUARD)

    def guard_problems(self) -> list[str]:
        p = choice(self, "on_divergence", POLICIES) + positive(self, "spike_window", "max_skips", "skip_window")
        if not (isinstance(self.spike_factor, (int, float)) and self.spike_factor > 1):
            p.append(f"{flag_name('spike_factor')} must be > 1, got {self.spike_factor!r}")
        return p


@dataclass(frozen=True)
class Verdict:
    kind: str        # "apply" | "skip" | "rollback" | "stop"
    reason: str = ""


class Guard:
    """The guard's state and decisions (one per rank, identical on every rank)."""

    def __init__(self, settings: GuardSettings):
        self.s = settings
        self.norms: list[float] = []         # gradient norms of the last spike_window applied steps, oldest first
        self.window: list[int] = []          # skipped steps that count towards max_skips (within skip_window)
        self.skipped = 0                     # steps skipped by the guard, over the whole run
        self.events: list[dict[str, Any]] = []    # the last MAX_EVENTS skips and rollbacks, oldest first
        self.rollbacks: list[dict[str, int]] = []  # {"step": where, "to": the checkpoint's step, "batches": skipped}
        self.last_clean: int | None = None   # the newest checkpoint written with no skipped step in its window

    @property
    def data_offset(self) -> int:
        """Batches the data stream is ahead of the optimizer step: those read before each rollback and dropped."""
        return sum(r["batches"] for r in self.rollbacks)

    def problem(self, loss: float, norm: float, bad_ranks: list[int]) -> str | None:
        """Why a step with this (all-rank) loss and gradient norm must not be applied, or None."""
        if bad_ranks or not (math.isfinite(loss) and math.isfinite(norm)):
            where = f" on rank(s) {bad_ranks}" if bad_ranks else ""
            return f"non-finite loss or gradient{where} (loss {loss}, grad norm {norm})"
        if self.s.on_divergence != "stop" and len(self.norms) >= self.s.spike_window:
            median = statistics.median(self.norms)
            if norm > self.s.spike_factor * median:
                return (f"gradient norm {norm:.4g} is {norm / median:.3g} x its running median {median:.4g} "
                        f"(--spike-factor {self.s.spike_factor:g})")
        return None

    def judge(self, step: int, loss: float, norm: float, bad_ranks: list[int]) -> Verdict:
        """The verdict on optimizer step `step` (1-based), recording a skip."""
        why = self.problem(loss, norm, bad_ranks)
        if why is None:
            return Verdict("apply")
        if self.s.on_divergence == "stop":
            return Verdict("stop", why)
        self.skipped += 1
        self.window = [k for k in self.window if k > step - self.s.skip_window] + [step]
        self._event({"kind": "skip", "step": step, "why": why})
        if len(self.window) < self.s.max_skips:
            return Verdict("skip", why)
        many = (f"{len(self.window)} steps skipped within {self.s.skip_window} steps "
                f"({', '.join(map(str, self.window))}; --max-skips {self.s.max_skips}), the last: {why}")
        return Verdict("rollback" if self.s.on_divergence == "rollback" else "stop", many)

    def applied(self, norm: float) -> None:
        self.norms = (self.norms + [float(norm)])[-self.s.spike_window:]

    def checkpointed(self, step: int) -> None:
        """A checkpoint of `step` is being written: it passed when no skipped step counts any more."""
        self.window = [k for k in self.window if k > step - self.s.skip_window]
        if not self.window:
            self.last_clean = step

    def rollback_target(self, step: int) -> tuple[int | None, str]:
        """(the checkpoint step to return to, "") or (None, why the run must stop instead)."""
        if self.last_clean is None:
            return None, f"step {step}: no checkpoint has passed yet, so there is nothing to roll back to"
        done = [r for r in self.rollbacks if r["to"] == self.last_clean]
        if done:
            return None, (f"step {step}: the run diverged again after rolling back to step {self.last_clean} (the "
                          f"rollback at step {done[0]['step']}); a second rollback to the same checkpoint would "
                          "repeat it")
        return self.last_clean, ""

    def history(self) -> dict[str, Any]:
        """What a rollback keeps from the abandoned steps (the checkpoint it loads restores the rest)."""
        return {"skipped": self.skipped, "events": list(self.events), "rollbacks": list(self.rollbacks)}

    def rolled_back(self, history: Mapping[str, Any], step: int, to: int) -> None:
        """After checkpoint `to` was loaded (its median window restored): this run's skips and rollbacks, plus
        the rollback from `step`; the data stream now skips the `step - to` batches read since `to`."""
        self.skipped, self.events, self.rollbacks = history["skipped"], history["events"], history["rollbacks"]
        self.rollbacks.append({"step": step, "to": to, "batches": step - to})
        self._event({"kind": "rollback", "step": step, "to": to, "batches": step - to})
        self.window, self.last_clean = [], to

    def _event(self, event: dict[str, Any]) -> None:
        self.events = (self.events + [event])[-MAX_EVENTS:]

    def summary(self) -> str:
        """'' when the guard did nothing, else what it did (the closing line of a run)."""
        if not self.skipped and not self.rollbacks:
            return ""
        steps = [e["step"] for e in self.events if e["kind"] == "skip"]
        shown = ", ".join(map(str, steps[-10:])) + (" ..." if len(steps) > 10 else "")
        line = f"divergence guard: {self.skipped} step(s) skipped ({shown})"
        if self.rollbacks:
            line += f", {len(self.rollbacks)} rollback(s) (" + "; ".join(
                f"step {r['step']} -> {r['to']}, {r['batches']} batches skipped" for r in self.rollbacks) + ")"
        return line

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.s.on_divergence, "norms": list(self.norms), "window": list(self.window),
                "skipped": self.skipped, "events": list(self.events), "rollbacks": list(self.rollbacks),
                "last_clean": self.last_clean}

    def load_state_dict(self, saved: Mapping[str, Any] | None, step: int) -> None:
        """Continue from a checkpoint of `step`; one written before the guard existed passed (it was written)."""
        saved = saved or {}
        self.norms = [float(v) for v in saved.get("norms", [])][-self.s.spike_window:]
        self.window = [int(k) for k in saved.get("window", [])]
        self.skipped = int(saved.get("skipped", 0))
        self.events = [dict(e) for e in saved.get("events", [])]
        self.rollbacks = [{k: int(v) for k, v in r.items()} for r in saved.get("rollbacks", [])]
        last = saved.get("last_clean", step)
        self.last_clean = None if last is None else int(last)


@dataclass
class GuardPart:
    """`guard`: the divergence guard's state (train/guard.py); absent from older checkpoints (a fresh guard)."""

    guard: Guard
    keys: ClassVar[tuple[str, ...]] = ("guard",)
    required: ClassVar[tuple[str, ...]] = ()

    def state_dict(self) -> dict[str, Any]:
        return {"guard": self.guard.state_dict()}

    def check(self, ckpt: Mapping[str, Any], where: str) -> None:
        return None

    def load_state_dict(self, ckpt: Mapping[str, Any]) -> None:
        self.guard.load_state_dict(ckpt.get("guard"), int(ckpt["step"]))


def advance(epoch: int, step_in_epoch: int, batches: int, steps_in: Callable[[int], int]) -> tuple[int, int]:
    """The data position `batches` optimizer steps' worth of batches after (epoch, step_in_epoch)."""
    pos = step_in_epoch + batches
    while pos >= (steps := steps_in(epoch)) > 0:
        epoch, pos = epoch + 1, pos - steps
    return epoch, pos


def injected_fault(step: int, batch: int) -> float | None:
    """The loss factor DIT_FAULT asks for at optimizer step `step` / data batch `batch` (common.faults keyed
    points): NaN (`train.nan_step@K`, `train.nan_batch@B`) or a gradient spike (`train.spike_step@K`,
    `train.spike_batch@B`); None without one. A step fault recurs after a rollback, a batch fault does not."""
    if fault_at("train.nan_step", step) or fault_at("train.nan_batch", batch):
        return float("nan")
    if fault_at("train.spike_step", step) or fault_at("train.spike_batch", batch):
        return SPIKE
    return None
