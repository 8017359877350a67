"""A data mix's part of the training checkpoint (`mix`, train/parts.py lists it) and the counts it keeps: the mix
trained on, the samples seen per source, and every change of mix (issue 46; docs/data-mix.md)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.log import get_logger


@dataclass
class MixState:
    """Samples seen per source: in the run and in the current epoch (in the checkpoint's `mix`)."""

    names: list[str]
    seen: list[int] = field(default_factory=list)
    seen_epoch: list[int] = field(default_factory=list)
    epoch: int = 0
    warned: set = field(default_factory=set)

    def __post_init__(self) -> None:
        self.seen = self.seen or [0] * len(self.names)
        self.seen_epoch = self.seen_epoch or [0] * len(self.names)

    def to_dict(self) -> dict[str, Any]:
        return {"seen": dict(zip(self.names, self.seen)), "seen_epoch": dict(zip(self.names, self.seen_epoch)),
                "counts_epoch": self.epoch}

    def load(self, saved: Mapping[str, Any]) -> None:
        """Counts of the sources this run shares with the checkpoint's (a new source starts at 0)."""
        seen, epoch_seen = dict(saved.get("seen") or {}), dict(saved.get("seen_epoch") or {})
        self.seen = [int(seen.get(n, 0)) for n in self.names]
        self.seen_epoch = [int(epoch_seen.get(n, 0)) for n in self.names]
        self.epoch = int(saved.get("counts_epoch", 0))


@dataclass
class MixPart:
    """`mix`: the mix trained on (its sources' names, data fingerprints and weights, the lanes), the samples seen
    per source, and each change of mix (`history`). A checkpoint of another mix, or of one shard set, is refused
    unless the run asks for a new mix (`--new-mix`): it then continues at the start of the next epoch with the new
    sources, and `history` says from which step."""

    record: dict[str, Any]
    state: MixState
    progress: Any = None              # train.state.TrainState: moved to the next epoch's start on a new mix
    new_mix: bool = False
    history: list[dict[str, Any]] = field(default_factory=list)
    keys: ClassVar[tuple[str, ...]] = ("mix",)
    required: ClassVar[tuple[str, ...]] = ()

    def state_dict(self) -> dict[str, Any]:
        history = self.history or [{"step": 0, "fingerprint": self.record["fingerprint"],
                                    "sources": [s["name"] for s in self.record["sources"]]}]
        return {"mix": {**self.record, **self.state.to_dict(), "history": history}}

    def differences(self, saved: Mapping[str, Any] | None) -> list[str]:
        if saved is None:
            return ["the checkpoint was trained on one shard set (--shards), this run on a mix"]
        out = []
        theirs = {s["name"]: s for s in saved.get("sources") or []}
        mine = {s["name"]: s for s in self.record["sources"]}
        added, removed = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
        if added:
            out.append(f"added {', '.join(added)}")
        if removed:
            out.append(f"removed {', '.join(removed)}")
        for name in sorted(set(mine) & set(theirs)):
            a, b = theirs[name], mine[name]
            changed = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and k != "samples"]
            if changed:
                out.append(f"{name}: {', '.join(f'{k} {a.get(k)!r} -> {b.get(k)!r}' for k in changed)}")
        if saved.get("epoch_size") != self.record.get("epoch_size"):
            out.append(f"epoch_size {saved.get('epoch_size')} -> {self.record.get('epoch_size')}")
        return out

    def check(self, ckpt: Mapping[str, Any], where: str) -> None:
        saved = ckpt.get("mix")
        diff = self.differences(saved)
        if diff and not self.new_mix:
            raise UserError(f"checkpoint {where} was trained on another data mix ({'; '.join(diff)}). Pass the same "
                            "sources to continue it, or --new-mix to continue it on these (from the start of the next "
                            "epoch; the checkpoint's mix history records the change), or a new --run-dir.")
        if saved is not None and not diff and int(saved.get("lanes", -1)) != int(self.record["lanes"]):
            raise UserError(f"checkpoint {where} reads its mix with {saved.get('lanes')} lanes, this run with "
                            f"{self.record['lanes']}: pass --mix-lanes {saved.get('lanes')} (the lanes fix the "
                            "sample sequence)")

    def load_state_dict(self, ckpt: Mapping[str, Any]) -> None:
        saved = ckpt.get("mix")
        self.history = list((saved or {}).get("history") or [])
        diff = self.differences(saved)
        if saved is not None:
            self.state.load(saved)
        if not diff:
            return
        step = int(ckpt.get("step", 0))
        self.history.append({"step": step, "fingerprint": self.record["fingerprint"],
                             "sources": [s["name"] for s in self.record["sources"]], "new_mix": True,
                             "changes": diff})
        p = self.progress
        if p is not None and p.step_in_epoch > 0:  # the new mix starts with an epoch of its own
            p.epoch, p.step_in_epoch = p.epoch + 1, 0
        self.state.seen_epoch = [0] * len(self.state.names)
        self.state.epoch = p.epoch if p is not None else self.state.epoch
        get_logger().warning(f"--new-mix: the data changes at step {step} ({'; '.join(diff)}); training continues "
                             f"at the start of epoch {self.state.epoch} on the new mix (recorded in the "
                             "checkpoint's mix history)")
