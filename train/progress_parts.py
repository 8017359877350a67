"""The parts of the training checkpoint that say where the run continues (train/parts.py lists them): the steps
done and the data position (`step`, `epoch`, `data`, mapped when the data layout changed) and the global generators'
states (`rng`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping

from dit_pipeline.common.log import get_logger
from dit_pipeline.common.seeding import rng_state, set_rng_state
from dit_pipeline.train.part_types import Checkpoint, NoCheck
from dit_pipeline.train.partition import DataLayout, map_position
from dit_pipeline.train.state import TrainState


@dataclass
class ProgressPart(NoCheck):
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


class RngPart(NoCheck):
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
