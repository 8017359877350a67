"""What the training loop does with a step whose loss or gradient is non-finite or spikes: the fp16 GradScaler's
overflow skip, then the divergence guard's verdict (train/guard.py: stop, skip, or skip and roll back), and the
rollback itself: functions of the `train.loop.Trainer` (its model and optimizer `p`, `guard`, run output `out`,
`parts`, `state` and meters), kept beside the loop to keep it readable."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from tqdm import tqdm

from dit_pipeline.common import distributed as dist
from dit_pipeline.common.errors import UserError
from dit_pipeline.common.faults import fault_point
from dit_pipeline.train.guard import advance

if TYPE_CHECKING:
    from dit_pipeline.train.loop import Trainer

MAX_CONSECUTIVE_OVERFLOWS = 25  # fp16: the loss scale has shrunk by 2**25: the run diverged


class TrainingDiverged(UserError):
    """Loss or gradient became NaN/Inf (or kept spiking); raised on every rank before the optimizer update."""


def check_finite(trainer: "Trainer", step: int, loss: float, norm: float, bad_ranks: list[int]) -> str:
    """"apply", "overflow" (fp16: the GradScaler skips the step), or the guard's "skip" / "rollback"
    (train/guard.py); raises TrainingDiverged when the run must stop."""
    if math.isfinite(loss) and math.isfinite(norm) and not bad_ranks:
        trainer._consecutive_overflows = 0
    elif trainer.p.scaler.is_enabled() and not math.isfinite(norm):
        trainer._consecutive_overflows += 1
        trainer.state.overflow_steps += 1
        if trainer._consecutive_overflows <= MAX_CONSECUTIVE_OVERFLOWS:
            return "overflow"  # GradScaler skips the update and lowers the scale, as designed
    verdict = trainer.guard.judge(step, loss, norm, bad_ranks)
    if verdict.kind in ("skip", "rollback"):
        trainer.log.warning(f"step {step} skipped (--on-divergence {trainer.cfg.on_divergence}): {verdict.reason}")
    if verdict.kind != "stop":
        return verdict.kind
    last = trainer.out.ckpts.latest()
    last_name = last.name if last else "none yet"
    if trainer.cfg.on_divergence != "stop":
        raise TrainingDiverged(f"step {step}: {verdict.reason}; stopped before the optimizer update. The last "
                               f"checkpoint ({last_name}) is intact; resume from it with a lower --lr, "
                               "--grad-clip or --warmup-steps, or --on-divergence rollback.")
    where = f"on rank(s) {bad_ranks}" if bad_ranks else "in the gradients"
    raise TrainingDiverged(
        f"step {step}: non-finite loss or gradient {where} (loss {loss}, grad norm {norm}); stopped before "
        f"the optimizer update. The last checkpoint ({last_name}) is intact; resume from it with a lower --lr, "
        "--grad-clip, --warmup-steps or --precision fp32, or let --on-divergence skip|rollback handle it.")


def roll_back(trainer: "Trainer", bar: tqdm) -> None:
    """Back to the newest checkpoint that passed, the data stream past the batches read since (train/guard.py).

    Every rank loads it; rank 0 sets the abandoned steps' checkpoints aside, then rewrites it with the advanced
    data position and the rollback recorded, so a kill at any moment resumes (or repeats) this rollback."""
    s, at = trainer.state, trainer.state.step
    to, why = trainer.guard.rollback_target(at)
    if to is None or not trainer.out.ckpts.path(to).exists():  # a file, or a sharded folder
        raise TrainingDiverged(f"{why or f'step {at}: the checkpoint of step {to} to roll back to is gone'}; "
                               "stopping. Resume from an earlier checkpoint (--resume PATH) with a lower --lr, "
                               "--grad-clip or --warmup-steps.")
    history = trainer.guard.history()
    trainer.load_from(trainer.out.ckpts.path(to))
    s.epoch, s.step_in_epoch = advance(s.epoch, s.step_in_epoch, at - to, lambda epoch: trainer.plan(epoch).steps)
    trainer.guard.rolled_back(history, at, to)
    trainer.rollback_due = False
    if dist.is_main():
        trainer.out.ckpts.set_aside(after=to)
    trainer.metrics.resume_at(to)
    trainer.meter.reset()
    trainer.own.reset()
    trainer.checkpoint()
    bar.n = to
    bar.refresh()
    trainer.log.warning(f"step {at}: rolled back to {trainer.out.ckpts.path(to).name} (rollback "
                        f"{len(trainer.guard.rollbacks)}); the data stream continues past the {at - to} batches "
                        f"read since (epoch {s.epoch}, step {s.step_in_epoch} in epoch)")
    fault_point("train.rolled_back")

