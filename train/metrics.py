"""Run metrics: `RUN/metrics.jsonl` (rank 0, one JSON object per log interval), per-rank
`RUN/logs/rank{r}.jsonl` (that rank's own values, for post-mortems and for checking the all-rank means),
TensorBoard events when tensorboard is installed, Weights & Biases with `--wandb` (train/wandb_sink.py: the
same scalars under the same names), and the MFU estimate. A value whose record also names it (`fid` with
`fid_name` "FID-5K") is logged under that name (`eval/FID-5K`), so a proxy is never shown as the paper metric.

MFU = achieved model FLOP/s / peak FLOP/s, with model FLOPs per image from `dit.train_flops_per_image`
(2 x 3 x the analytic forward MACs: recomputation by activation checkpointing is not counted, as usual for
MFU) and the peak dense bf16 tensor throughput of the GPU from a small table (`--peak-tflops` overrides).
"""
from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dit_pipeline.common.io import atomic_write_bytes
from dit_pipeline.common.log import get_logger

# Dense bf16/fp16 tensor-core peak per GPU in TFLOP/s (vendor data sheets, without sparsity).
# Order matters: the first substring found in the device name wins.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0), ("B200", 2250.0), ("H200", 989.4), ("GH200", 989.4), ("H100 PCIe", 756.0),
    ("H100", 989.4), ("H800", 989.4), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.1), ("L40", 181.0),
    ("A6000", 154.8), ("L4", 121.0), ("A10", 125.0), ("RTX 4090", 165.2), ("RTX 3090", 71.0), ("V100", 125.0),
)


def peak_tflops(device: torch.device, override: float | None = None) -> float | None:
    """Peak dense TFLOP/s of `device` (None on CPU or for an unknown GPU, unless overridden)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tf for key, tf in PEAK_TFLOPS if key in name), None)


def mfu(flops_per_image: float, images_per_s: float, world_size: int, peak: float | None) -> float | None:
    if not peak or not images_per_s:
        return None
    return flops_per_image * images_per_s / (peak * 1e12 * world_size)


# ----------------------------------------------------------------------------------------------------------
# What a training step reports (edm2's training_stats.report(name, value)): one list of metric names

@dataclass(frozen=True)
class Metric:
    """A value each optimizer step reports, and how it is combined over the ranks and over a log interval.

    over_ranks: "samples" (every rank reports per-sample values; the step's value is their mean over all samples
    of all ranks), "ranks" (one value per rank; their mean), or "rank0" (a value every rank shares, e.g. the
    gradient norm after DDP's all-reduce: rank 0's, so no rounding of a sum divided back).
    interval: "mean" (per step, over the log interval) or "fraction" (seconds summed over the interval, divided
    by its length). own: this rank's own value also goes to RUN/logs/rank{r}.jsonl. loss_term: a term of the
    loss, shown in the log line beside it and plotted with it. record: the name in metrics.jsonl.
    """

    name: str
    over_ranks: str
    interval: str = "mean"
    own: bool = False
    loss_term: bool = False
    record: str | None = None

    @property
    def key(self) -> str:
        return self.record or self.name


STEP_METRICS: tuple[Metric, ...] = (
    Metric("loss", "samples", own=True),
    Metric("mse", "samples", own=True, loss_term=True),
    Metric("mse_v", "samples", own=True, loss_term=True),   # iMF: the auxiliary v head's term
    Metric("vb", "samples", own=True, loss_term=True),      # ddpm's variational bound (learned sigma)
    Metric("proj", "samples", own=True, loss_term=True),    # --repa: the alignment term (-cosine similarity)
    Metric("cos", "samples", own=True, loss_term=True),     # --cosine-loss: 1 - cos(v_pred, v) (LightningDiT)
    Metric("lpips", "samples", own=True, loss_term=True),   # --lpips: PixelGen's weighted LPIPS term
    Metric("pdino", "samples", own=True, loss_term=True),   # --pdino: PixelGen's weighted DINOv2 feature term
    Metric("reg", "samples", own=True, loss_term=True),     # --use-reg: the class token's velocity MSE (NanoGen's REG)
    Metric("base", "samples", own=True, loss_term=True),    # --base-model-depth: the IG base head's velocity MSE
    Metric("grad_norm", "rank0"),
    Metric("wait", "ranks", interval="fraction", own=True, record="data_wait"),  # waiting for the loader
    Metric("teacher", "ranks", interval="fraction", own=True, record="teacher_time"),  # --repa: its forward
)
METRICS: dict[str, Metric] = {m.name: m for m in STEP_METRICS}
LOSS_TERMS: tuple[str, ...] = ("loss", *(m.name for m in STEP_METRICS if m.loss_term))


class StepReport:
    """The values of one optimizer step, reported where they arise (`report(name, value)`), then combined over
    all ranks in one all-reduce of named scalars (`reduce`). Every rank must report the same names."""

    def __init__(self) -> None:
        self._local: dict[str, float | torch.Tensor] = {}

    def report(self, name: str, value: float | torch.Tensor) -> None:
        """Add `value` to `name` (a "samples" metric takes the per-sample tensor of a micro-batch; the others
        one value per step)."""
        metric = METRICS[name]  # KeyError: a metric must be listed in STEP_METRICS
        if metric.over_ranks == "samples":
            value = torch.as_tensor(value).detach().sum().double()
        prev = self._local.get(name)
        self._local[name] = value if prev is None else prev + value

    def local(self, name: str) -> float | torch.Tensor:
        return self._local[name]

    def reduce(self, *, samples: int, flags: dict[str, Any] | None = None,
               device: torch.device | None = None) -> "StepValues":
        """All ranks' values: `samples` is this rank's sample count of the step (equal on every rank); `flags`
        are per-rank values every rank learns (e.g. a non-finite loss)."""
        from dit_pipeline.common import distributed as dist

        world, rank = dist.world_size(), dist.rank()
        sums = {name: (v if METRICS[name].over_ranks != "rank0" or rank == 0 else 0.0)
                for name, v in self._local.items()}
        own = {f"own_{n}": v for n, v in self._local.items() if METRICS[n].own}
        total = dist.all_reduce_named(sums, per_rank={**(flags or {}), **own}, device=device)
        divide = {"samples": samples * world, "ranks": world, "rank0": 1}
        values = {n: total[n] / divide[METRICS[n].over_ranks] for n in self._local}
        mine = {n: total.per_rank[f"own_{n}"][rank] / (samples if METRICS[n].over_ranks == "samples" else 1)
                for n in self._local if METRICS[n].own}
        return StepValues(values, mine, {f: total.per_rank[f] for f in (flags or {})})


@dataclass
class StepValues:
    values: dict[str, float]            # the step's value of each reported metric (all ranks)
    own: dict[str, float]               # this rank's own values of the `own` metrics
    flags: dict[str, list[float]]       # per-rank flags, one value per rank

    def ranks_with(self, flag: str) -> list[int]:
        return [r for r, v in enumerate(self.flags[flag]) if v]


def interval_record(meter: "Meter", elapsed: float) -> dict[str, float]:
    """The metrics.jsonl values of the step metrics over one log interval (only those reported)."""
    out = {}
    for m in STEP_METRICS:
        if m.name in meter:
            out[m.key] = meter.sum(m.name) / elapsed if m.interval == "fraction" else meter.mean(m.name)
    return out


class Meter:
    """Running sums of named scalars over one log interval (edm2's training_stats, for one process).

    `add(loss=..., mse=...)` after each step, `mean(name)` per step at the end of the interval, `reset()` to
    start the next one; `steps` counts the `step()` calls and `elapsed()` the seconds since the reset.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._sums: dict[str, float] = defaultdict(float)
        self._counts: dict[str, int] = defaultdict(int)
        self.steps = 0
        self.t0 = time.perf_counter()

    def step(self, **values: float) -> None:
        """One step done, with its values."""
        self.steps += 1
        self.add(**values)

    def add(self, **values: float) -> None:
        for name, v in values.items():
            self._sums[name] += v
            self._counts[name] += 1

    def sum(self, name: str) -> float:
        return self._sums[name]

    def __contains__(self, name: str) -> bool:
        return name in self._sums

    def mean(self, name: str) -> float:
        """Mean per step of `name` over the steps of this interval that reported it (steps skipped by the
        divergence guard report only their times)."""
        return self._sums[name] / max(1, self._counts[name])

    def elapsed(self) -> float:
        return max(time.perf_counter() - self.t0, 1e-9)


def _clean(v: Any) -> Any:
    """JSON has no NaN/Inf: write them as strings so a diverging run's last lines still parse."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class MetricsLog:
    """Writes metric records; only the process with `main=True` writes the shared files."""

    def __init__(self, run_dir: str | Path, rank: int, *, main: bool, tensorboard: bool,
                 wandb: tuple[str, dict[str, Any]] | None = None):
        """wandb: (project, the run's config) to log to Weights & Biases as well (rank 0 only)."""
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.rank_path = self.run_dir / "logs" / f"rank{rank}.jsonl"
        self.keys_path = self.run_dir / "logs" / f"keys-rank{rank}.jsonl"  # --record-keys
        self.main = main
        self._tb: Any = None
        self._tb_wanted = main and tensorboard
        self._purge_step: int | None = None
        self.wandb = None
        if main and wandb is not None:
            from dit_pipeline.train.wandb_sink import WandbSink

            self.wandb = WandbSink(self.run_dir, *wandb)

    def _writer(self) -> Any:
        """The SummaryWriter, opened at the first record: after `resume_at(step)` it purges the events of the
        steps after `step` that an interrupted run had written (else TensorBoard shows those steps twice)."""
        if self._tb is None and self._tb_wanted:
            self._tb_wanted = False
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                get_logger().info("tensorboard is not installed: metrics go to metrics.jsonl only "
                                  "(pip install 'dit-pipeline[tensorboard]' for event files)")
                return None
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=self._purge_step)
        return self._tb

    @staticmethod
    def truncate(path: Path, after_step: int) -> int:
        """Drop records with step > after_step (a resumed run rewrites them); returns how many remain.
        A partial last line from a killed writer is dropped too."""
        if not path.is_file():
            return 0
        kept = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= after_step:
                kept.append(line)
        atomic_write_bytes(path, "".join(s + "\n" for s in kept).encode("utf-8"))
        return len(kept)

    def resume_at(self, step: int) -> None:
        """Continue after a checkpoint of `step`: later records (of the run that was interrupted) are dropped
        from the JSONL files and from the TensorBoard events."""
        if step > 0:
            self._purge_step = step + 1
        if self._tb is not None:  # a rollback in this process: reopened at the next record, purging those steps
            self._tb.close()
            self._tb, self._tb_wanted = None, True
        if self.main:
            self.truncate(self.path, step)
            # every rank's --record-keys file, those of ranks this run no longer has too (a resume on fewer ranks);
            # no rank appends before its first step's all-reduce, which rank 0 joins after this
            for keys in sorted(self.keys_path.parent.glob("keys-rank*.jsonl")):
                self.truncate(keys, step)
        self.truncate(self.rank_path, step)
        self.truncate(self.keys_path, step)

    @staticmethod
    def _append(path: Path, record: dict[str, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")

    def write(self, record: dict[str, Any]) -> None:
        if not self.main:
            return
        self._append(self.path, record)
        scalars = scalar_tags(record)
        tb = self._writer()
        if tb is not None:
            for tag, v in scalars.items():
                tb.add_scalar(tag, v, record["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, record["step"])

    def write_rank(self, record: dict[str, Any]) -> None:
        self._append(self.rank_path, record)

    def write_keys(self, step: int, batches: Any) -> None:
        """--record-keys: the (source, key) of each sample of this rank's step, in its micro-batches' order."""
        pairs = []
        for b in batches:
            src = b.sources.tolist() if getattr(b, "sources", None) is not None else [0] * len(b.keys)
            pairs += [[int(s), int(k)] for s, k in zip(src, b.keys.tolist())]
        self._append(self.keys_path, {"step": step, "keys": pairs})

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self.wandb is not None:
            self.wandb.close()


def scalar_tags(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics record as TensorBoard / W&B scalars: `train/<key>`, or `eval/<name>` for a
    value the record names (`fid` with `fid_name` "FID-5K": `eval/FID-5K`)."""
    out = {}
    for k, v in record.items():
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
            name = record.get(f"{k}_name")
            out[f"eval/{name}" if isinstance(name, str) else f"train/{k}"] = v
    return out


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of RUN/metrics.jsonl (or of a .jsonl path), in file order."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / "metrics.jsonl"
    out = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
    return out
