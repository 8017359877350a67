"""The training loop: data -> forward/backward with accumulation (DDP or FSDP2, train.parallel) -> checks ->
optimizer -> EMA -> logs, checkpoints and hooks, one optimizer step at a time.

Reproducibility: every random draw of a step (timesteps t, diffusion noise, class dropout) is made for the
rank's whole step (accum x micro samples) from generators seeded with derive_seed(seed, stream, step, rank),
so it survives restarts and does not depend on the micro-batch split. The data stream is a function of
(seed, epoch, layout) (the feed, train/feeds.py: one shard set's train.data, or a data mix's train.mixdata, whose
global sequence does not depend on the world size either). Hence a resumed run with the same world size repeats
the uninterrupted run exactly.

Per step there are two tiny all-reduces of named scalars (`common.distributed.all_reduce_named`): before
the forward, so all ranks agree on stopping (signal), an exhausted reader or an unreadable shard (no rank
enters a collective the others skip); and after the backward, carrying the loss sums (logged loss = mean over
all ranks), the grad norm and each rank's non-finite flag, so a NaN on any rank stops every rank before the
optimizer update. What such a step does is the divergence guard's verdict (train/guard.py: stop, skip, or
skip and roll back to the newest checkpoint that passed). Between log lines the values accumulate in a `Meter`.
The pre-step flags are host values: under NCCL they travel over a gloo side group (common.distributed), so
agreeing on them never waits for the GPU. The post-backward values come to the host once per step: that
verdict is what lets the update be refused before it happens. The grad norm it carries is the gradient
non-finite check as well as a logged value (one foreach read of the gradients).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Sequence, cast

import torch
from tqdm import tqdm

from dit_pipeline.common import distributed as dist
from dit_pipeline.common.errors import UserError
from dit_pipeline.common.faults import fault_point, fault_requested
from dit_pipeline.common.log import get_logger, progress_enabled
from dit_pipeline.common.seeding import STREAM_DROPOUT, STREAM_STEP, STREAM_TIMESTEP, generator
from dit_pipeline.dit import repa
from dit_pipeline.dit.reg import REG_NOISE, REG_TARGET
from dit_pipeline.train.checkpoint import CheckpointManager
from dit_pipeline.train.data import Batch
from dit_pipeline.train.diverge import TrainingDiverged, check_finite, roll_back  # noqa: F401 (raised here)
from dit_pipeline.train.feeds import make_feed, mix_part, shard_set_part
from dit_pipeline.train.hooks import HookContext, PeriodicHook
from dit_pipeline.train.guard import Guard, GuardPart, injected_fault
from dit_pipeline.train.metrics import LOSS_TERMS, METRICS, Meter, MetricsLog, StepReport, interval_record, mfu
from dit_pipeline.train.net import TrainModel
from dit_pipeline.train.handover import HandoverLoader
from dit_pipeline.train.partition import DataLayout, EpochPlan
from dit_pipeline.train.checkpoint import load_checkpoint, materialize
from dit_pipeline.train.part_types import Part
from dit_pipeline.train.parts import build_parts, check_all, compose
from dit_pipeline.train.progress_parts import ProgressPart
from dit_pipeline.train.preflight import Preflight
from dit_pipeline.train.reg import RegPart
from dit_pipeline.train.repa import TeacherClock
from dit_pipeline.train.speed import ema_update
from dit_pipeline.train.stages import ReaderEvent
from dit_pipeline.train.text import BatchText, online_encoder, run_conditioning
from dit_pipeline.train.state import TrainState, comm_guard, weights_fingerprint

@dataclass
class RunOutput:
    """Where a run writes: its folder, its checkpoints and its metrics."""

    run_dir: Path
    ckpts: CheckpointManager
    metrics: MetricsLog


class Trainer:
    """One training run on this rank: `fit(stop)` loops over epochs and steps.

    Its checkpoint is composed by its named parts (`self.parts`, train.parts: model, EMA, optimizer, scaler,
    progress, RNG and what the run was trained on): `checkpoint()` writes one (a collective), `resume_from()`
    continues from one after every part's check passed."""

    def __init__(self, prep: Preflight, net: TrainModel, out: RunOutput, hooks: Sequence[PeriodicHook] = ()):
        self.cfg, self.batch, self.layout, self.source = prep.cfg, prep.batch, prep.layout, prep.source
        self.sha256 = prep.sha256  # how each shard is checked against the manifest (train.preflight.sha256_mode)
        self.total_steps = prep.total_steps
        assert prep.schedule is not None, "train.preflight.prepare builds the lr schedule"
        self.schedule = prep.schedule
        self.p, self.device, self.out = net, net.device, out
        self.metrics = out.metrics
        self.hooks = list(hooks)
        self.rank, self.world = dist.rank(), dist.world_size()
        self.log = get_logger()
        self.state = TrainState()
        self.params = [p for p in net.trained.parameters() if p.requires_grad]  # the optimizer's, in its order
        self.latent_shape = tuple(self.source.manifest.latent_shape)
        self.shard_set = shard_set_part(prep)
        self.cond = run_conditioning(net.model, prep.text)  # dit/conditioning.py, train/text.py
        self.text_set = prep.text
        # --text: the text set's features beside each batch (cached), or the batch's captions encoded here (online)
        self.text = BatchText(online_encoder(prep.text, self.device) if prep.text is not None
                              and self.cfg.text_features == "online" else None)
        self.reg = prep.reg  # --use-reg: the cached class tokens, joined as the batches' sibling tokens (train/reg.py)
        # where the batches come from: one shard set or a data mix (train/feeds.py)
        self.feed = make_feed(prep, rank=self.rank, teacher=net.teacher, online=self.text.encoder is not None)
        self.current_plan: Any = None
        self.guard = Guard(self.cfg)
        self.rollback_due = False
        self.parts: list[Part] = build_parts(
            objective=self.cfg.objective, config=self.cfg.to_dict(), shard_set=self.shard_set, model=net.model,
            ema=net.ema, head=net.head, teacher=net.teacher.identity if net.teacher is not None else None,
            opt=net.opt, scaler=net.scaler,
            progress=ProgressPart(self.state, self.layout, lambda epoch: self.plan(epoch).steps,
                                  same_stream=self.feed.same_stream),
            guard=GuardPart(self.guard), text=prep.text.record(self.cfg.text_features) if prep.text else None,
            reg=RegPart.of(self.cfg.to_dict(), prep.reg), mix=mix_part(prep, self.feed, self.state))
        self.last_saved = self.state.step
        self._consecutive_overflows = 0
        self.teacher_clock = TeacherClock(self.device)
        self.meter = Meter()       # all-rank means of this log interval
        self.own = Meter()         # this rank's own values (RUN/logs/rank{r}.jsonl)

    # -- bookkeeping --------------------------------------------------------------------------------
    def done(self) -> bool:
        s = self.state
        return ((self.cfg.max_steps is not None and s.step >= self.cfg.max_steps)
                or (self.cfg.epochs is not None and s.epoch >= self.cfg.epochs))

    def layout_of(self, epoch: int) -> DataLayout:
        """The data layout `epoch` is read under: this run's, or for the epoch a resume at another layout began
        in, the saved run's (train.handover)."""
        carried = self.state.carried
        return carried if carried is not None and epoch == self.state.epoch else self.layout

    def plan(self, epoch: int) -> EpochPlan:
        """The epoch's reading plan (the feed's, under the layout that reads it: train.handover); shards skipped as
        bad count as empty, so an epoch is a full pass over the remaining ones (not a pass that ends early, every
        epoch, at the bad shard)."""
        lay = self.layout_of(epoch)
        return self.feed.plan(epoch, self.state.bad_shard_names, layout=None if lay == self.layout else lay)

    def lr_at(self, step: int) -> float:
        """The lr of the update after `step` steps: a pure function of the step (train.schedule)."""
        return self.schedule.lr_at(step)

    # -- main loop ----------------------------------------------------------------------------------
    def setup_hooks(self) -> None:
        """Every hook's optional setup(ctx), then an all-reduce so that a failure on one rank stops all of
        them before the first step (instead of leaving the others waiting at their first collective)."""
        if not any(hasattr(hook, "setup") for hook in self.hooks):  # the same hooks on every rank
            return
        error: UserError | None = None
        for hook in self.hooks:
            if hasattr(hook, "setup"):
                try:
                    hook.setup(self.hook_context())
                except UserError as e:
                    error = e
                    break
        with comm_guard("the hook setup check", self.state.step + 1):
            failed = dist.all_reduce_named({"failed": float(error is not None)})["failed"]
        if error is not None:
            raise error
        if failed:
            raise UserError("stopping: a periodic hook (e.g. --sample-every) failed its setup on another rank; "
                            "see RUN/logs/rank*.log")

    def fit(self, stop: Any) -> str:
        """Train until done or stopped; returns "done" or "stopped" (a checkpoint is written either way)."""
        self.setup_hooks()
        bar = tqdm(total=self.total_steps, initial=self.state.step, desc="train", dynamic_ncols=True,
                   disable=not progress_enabled(self.cfg.quiet))
        outcome = "done"
        try:
            while not self.done():
                plan = self.plan(self.state.epoch)
                if plan.steps == 0:
                    raise UserError(f"epoch {plan.epoch} has no complete optimizer step: each step needs "
                                    f"{self.batch.global_batch} samples and the readers hold "
                                    f"{plan.samples_total}")
                ended = self.run_epoch(plan, stop, bar)
                if ended == "stopped":
                    outcome = "stopped"
                    break
                if ended == "rollback":
                    roll_back(self, bar)
        finally:
            bar.close()
        if self.state.step != self.last_saved:
            self.checkpoint()
        return outcome

    def run_epoch(self, plan: EpochPlan, stop: Any, bar: tqdm) -> str:
        s = self.state
        self.current_plan = plan
        layout = self.layout_of(plan.epoch)
        feed_kw: dict[str, Any] = dict(bad=s.bad_shard_names, prefetch_factor=self.cfg.prefetch_factor,
                                       pin_memory=self.device.type == "cuda")
        if layout == self.layout:
            loader: Any = self.feed.loader(plan, s.step_in_epoch, **feed_kw)
        else:  # an epoch begun under another layout: its remaining steps as the saved run's ranks read them
            loader = HandoverLoader(layout, self.world, self.rank, self.batch.micro_batch, self.batch.accum,
                                    lambda old_rank: self.feed.loader(plan, s.step_in_epoch, rank=old_rank,
                                                                      layout=layout, **feed_kw))
        try:
            while s.step_in_epoch < plan.steps:
                if self.done():
                    return "done"
                t0 = time.perf_counter()
                items = [next(loader) for _ in range(self.batch.accum)]
                wait = time.perf_counter() - t0
                verdict = self.agree(items, stop, plan)
                if verdict == "stop":
                    return "stopped"
                if verdict == "exhausted":
                    break
                if self.cfg.record_keys:
                    self.metrics.write_keys(s.step + 1, items)
                self.train_step(cast("list[Batch]", items), wait)  # "go": every item is a batch
                s.step_in_epoch += 1
                if self.rollback_due:
                    return "rollback"
                self.after_step(plan, bar)
        finally:
            getattr(loader, "close", lambda: None)()  # shuts the loader workers down now
        s.epoch, s.step_in_epoch, s.carried = s.epoch + 1, 0, None
        return "done"

    def agree(self, items: list[Batch | ReaderEvent], stop: Any, plan: EpochPlan) -> str:
        """Pre-step consensus: 'stop' (a signal on any rank), 'exhausted', or 'go'; raises on a data error."""
        skipped = [tuple(sk) for it in items for sk in it.skipped]
        errors = [it.message for it in items if isinstance(it, ReaderEvent) and it.kind == "error"]
        exhausted = any(isinstance(it, ReaderEvent) and it.kind == "exhausted" for it in items)
        with comm_guard("the pre-step all-reduce", self.state.step + 1):
            total = dist.all_reduce_named({"stop": float(stop.requested), "exhausted": float(exhausted),
                                           "skipped_shards": float(len(skipped)), **self.feed.step_values(items)},
                                          per_rank={"read_error": float(bool(errors))})
        if total["skipped_shards"] > 0:  # every rank learns every skipped shard: the epoch plans stay equal
            with comm_guard("sharing the skipped shards", self.state.step + 1):
                self.note_skipped([sk for part in dist.all_gather_object(skipped) for sk in part])
        bad_ranks = total.ranks_with("read_error")
        if bad_ranks:
            if errors:
                raise UserError(f"rank {self.rank} cannot read its data at step {self.state.step + 1}: "
                                f"{errors[0]} (or pass --skip-bad-shards to skip unreadable shards)")
            raise UserError(f"stopping: rank(s) {bad_ranks} could not read their data at step "
                            f"{self.state.step + 1} (see RUN/logs/rank{bad_ranks[0]}.log)")
        if total["stop"] > 0:
            return "stop"
        if total["exhausted"] > 0:
            self.log.warning(f"epoch {plan.epoch} ended after {self.state.step_in_epoch} of {plan.steps} steps: "
                             f"a reader ran out of samples ({self.state.bad_shards} distinct shard(s) skipped so far)")
            return "exhausted"
        self.feed.step_done(total.sums, plan.epoch, self.state.step_in_epoch, plan)  # e.g. a mix's samples per source
        return "go"

    def note_skipped(self, skipped: list[tuple[str, str]]) -> None:
        """Record shards skipped with --skip-bad-shards: each is warned about once and read by no later epoch."""
        for url, problem in skipped:
            name = self.feed.shard_name(url)
            if name in self.state.bad_shard_names:
                continue
            self.state.bad_shard_names.append(name)
            self.log.warning(f"skipping {name} from now on (--skip-bad-shards; {len(self.state.bad_shard_names)} "
                             f"distinct shard(s) skipped): {problem}")
        self.state.bad_shards = len(self.state.bad_shard_names)

    # -- one optimizer step ---------------------------------------------------------------------------
    def _model_fn(self, x: torch.Tensor, t: torch.Tensor, **kwargs: Any) -> Any:  # out, or (out, zs) with --repa
        with torch.autocast(self.device.type, dtype=self.p.amp_dtype or torch.float32,
                            enabled=self.p.amp_dtype is not None):
            return self.p.forward(x, t, **kwargs)

    def _step_randomness(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        step, dev = self.state.step, self.device
        g = generator(self.cfg.seed, STREAM_TIMESTEP, step, self.rank, device=dev)
        shared = generator(self.cfg.seed, STREAM_STEP, step)  # the same on every rank (a decision of the whole step)
        # ddpm: 0..999; flow: [n]; meanflow: [n, 2]
        t = self.p.diffusion.draw_timesteps(n, generator=g, device=dev, shared=shared)
        noise = torch.randn((n, *self.latent_shape), generator=g, device=dev)
        # REG: the class tokens' own noise, drawn after the images' (dit/reg.py)
        token_noise = torch.randn((n, self.reg.dim), generator=g, device=dev) if self.reg is not None else None
        drop = None
        if self.cfg.class_dropout_prob > 0:
            gd = generator(self.cfg.seed, STREAM_DROPOUT, step, self.rank, device=dev)
            drop = (torch.rand(n, generator=gd, device=dev) < self.cfg.class_dropout_prob).long()
            drop = self.p.diffusion.drop_labels(drop)  # which samples get the null class (MeanFlow: the first k)
        return t, noise, drop, token_noise

    def train_step(self, items: list[Batch], wait: float) -> None:
        p, micro, accum = self.p, self.batch.micro_batch, self.batch.accum
        t_all, noise_all, drop_all, token_noise = self._step_randomness(micro * accum)
        report = StepReport()
        nan_fault = fault_requested("train.nan")
        step = self.state.step + 1
        factor = injected_fault(step, step + self.guard.data_offset)  # DIT_FAULT keyed points (train/guard.py)
        for i, b in enumerate(items):
            sl = slice(i * micro, (i + 1) * micro)
            x = b.latents.to(self.device, non_blocking=True)
            # the condition's model inputs (labels, or text with its mask), dropped rows given the null condition
            kwargs = self.cond.batch_kwargs(self.text(b), None if drop_all is None else drop_all[sl], self.device)
            if token_noise is not None:  # REG: this batch's clean class tokens [B, z] and their noise (dit/flow.py)
                assert b.teacher is not None, "the class tokens come with the batch (--reg-tokens)"
                kwargs.update({REG_TARGET: b.teacher.to(self.device, non_blocking=True)[:, 0],
                               REG_NOISE: token_noise[sl]})
            with p.parallel.micro_batch(i, accum):  # DDP: gradients reduced after the last one only
                if p.teacher is None:
                    terms = p.diffusion.training_losses(self._model_fn, x, t_all[sl], model_kwargs=kwargs,
                                                        noise=noise_all[sl])
                else:  # REPA: the teacher's features of these very pixels, then the loss with the alignment term
                    assert b.pixels is not None or b.teacher is not None
                    with self.teacher_clock:  # --repa FOLDER: the cached tokens of these very views
                        features = (b.teacher.to(self.device, non_blocking=True) if b.teacher is not None
                                    else p.teacher(b.pixels))  # type: ignore[arg-type]
                    terms = repa.training_losses(p.diffusion, self._model_fn, x, t_all[sl], [features],
                                                 model_kwargs=kwargs, noise=noise_all[sl],
                                                 proj_coeff=self.cfg.repa_coeff)
                if nan_fault and i == 0:  # injected by DIT_FAULT=train.nan (reliability tests)
                    terms["loss"] = terms["loss"] * float("nan")
                if factor is not None and i == 0:
                    terms["loss"] = terms["loss"] * factor
                with comm_guard("the gradient all-reduce", self.state.step + 1):
                    p.scaler.scale(terms["loss"].mean() / accum).backward()
            for name, value in terms.items():  # the objective's per-sample terms: loss, mse (, vb)
                report.report(name, value)
        report.report("wait", wait)
        if self.cfg.log_keys:  # a test knob: which samples this rank's step trained on
            self.metrics.write_rank({"step": step, "keys": [int(k) for b in items for k in b.keys]})
        if p.teacher is not None:
            report.report("teacher", self.teacher_clock.take())
        self._finish_step(report)

    def _finish_step(self, report: StepReport) -> None:
        p, cfg = self.p, self.cfg
        if p.scaler.is_enabled():
            p.scaler.unscale_(p.opt)
        with comm_guard("the gradient norm", self.state.step + 1):  # over every rank's shards (train.parallel)
            grad_norm = p.parallel.grad_norm(self.params, cfg.grad_clip)
        report.report("grad_norm", grad_norm.double())  # identical on all ranks: rank 0's is logged
        with comm_guard("the loss all-reduce", self.state.step + 1):
            # this rank's own values ride along in its slots: one device -> host copy per step in all
            non_finite = ~torch.isfinite(torch.as_tensor(report.local("loss")))
            values = report.reduce(samples=self.batch.per_rank, device=self.device,
                                   flags={"non_finite": non_finite.double()})
        loss, norm = values.values["loss"], values.values["grad_norm"]
        step = self.state.step + 1
        verdict = check_finite(self, step, loss, norm, values.ranks_with("non_finite"))
        if verdict == "apply":
            for group in p.opt.param_groups:
                group["lr"] = self.lr_at(self.state.step)
            if p.scaler.is_enabled():
                p.scaler.step(p.opt)
            else:
                p.opt.step()
            self._update_ema()
            self.guard.applied(norm)
        if p.scaler.is_enabled():
            p.scaler.update()
        p.opt.zero_grad(set_to_none=True)
        self.state.step = step
        if verdict in ("skip", "rollback"):  # the interval's values are those of applied steps; its times all
            self.meter.step(**{k: v for k, v in values.values.items() if METRICS[k].interval == "fraction"})
            self.own.step(**{k: v for k, v in values.own.items() if METRICS[k].interval == "fraction"})
        else:
            self.meter.step(**values.values)
            self.own.step(**values.own)
        self.rollback_due = verdict == "rollback"

    @torch.no_grad()
    def _update_ema(self) -> None:
        if self.p.ema is None:
            return
        # the EMA follows the DiT (not a projector), each rank its own part (sharded: its shards)
        ema_update(*self.p.parallel.ema_pairs(self.p.ema, self.p.model), self.cfg.ema_decay)

    # -- after a step ---------------------------------------------------------------------------------
    def after_step(self, plan: EpochPlan, bar: tqdm) -> None:
        step = self.state.step
        bar.update(1)
        if step % self.cfg.log_every == 0 or self.done():
            self.log_interval(bar)
        if step % self.cfg.ckpt_every == 0:
            self.checkpoint()
        for hook in self.hooks:
            if step % hook.every == 0:
                hook(self.hook_context())
        fault_point("train.step_end")

    def log_interval(self, bar: tqdm) -> None:
        m, own, s = self.meter, self.own, self.state
        n, elapsed = max(1, m.steps), m.elapsed()
        images_per_s = n * self.batch.global_batch / elapsed
        rec: dict[str, Any] = {"step": s.step, "epoch": s.epoch, **interval_record(m, elapsed), "lr": self.lr_at(s.step - 1),
               "images_per_s": images_per_s, "steps_per_s": n / elapsed,
               "peak_mem_gb": (torch.cuda.max_memory_allocated(self.device) / 2**30
                               if self.device.type == "cuda" else None),
               "mfu": mfu(self.p.flops_per_image, images_per_s, self.world, self.p.peak_tflops),
               "fp16_skipped": s.overflow_steps, "bad_shards": s.bad_shards, "skipped_steps": self.guard.skipped,
               "rollbacks": len(self.guard.rollbacks), "world_size": self.world}
        if self.guard.rollbacks:  # where each happened and where it went back to (dit-report marks them there)
            rec["rollback_steps"] = [[r["step"], r["to"]] for r in self.guard.rollbacks]
        plan = self.current_plan if self.current_plan is not None else self.plan(s.epoch)
        rec.update(self.feed.log_fields(plan))  # a mix: samples seen, realised and asked share per source
        self.metrics.write(rec)
        self.metrics.write_rank({"step": s.step, **interval_record(own, elapsed)})
        mem = f" mem {rec['peak_mem_gb']:.1f}G" if rec["peak_mem_gb"] is not None else ""
        util = f" mfu {rec['mfu']:.1%}" if rec["mfu"] is not None else ""
        util += f" teacher {rec['teacher_time']:.0%}" if "teacher_time" in rec else ""
        util += f" skipped {rec['skipped_steps']} rollbacks {rec['rollbacks']}" if self.guard.skipped else ""
        terms = " ".join(f"{k} {rec[k]:.4f}" for k in LOSS_TERMS[1:] if k in rec)
        loss, nan = rec.get("loss", math.nan), math.nan  # absent: every step of the interval was skipped
        self.log.info(f"step {s.step}{f'/{self.total_steps}' if self.total_steps else ''} epoch {s.epoch} "
                      f"loss {loss:.4f}{f' ({terms})' if terms else ''} grad {rec.get('grad_norm', nan):.3g} "
                      f"lr {rec['lr']:.3g} {images_per_s:.1f} img/s data-wait {rec['data_wait']:.0%}{mem}{util}")
        if (line := self.feed.log_line(plan)) is not None:
            self.log.info(line)
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        m.reset()
        own.reset()

    def hook_context(self) -> HookContext:
        m = self.source.manifest
        return HookContext(step=self.state.step, epoch=self.state.epoch, rank=self.rank, world_size=self.world,
                           run_dir=self.out.run_dir, device=self.device, model=self.p.model, ema=self.p.ema,
                           model_config=self.p.model.config, latent=dict(self.shard_set.latent),
                           num_classes=m.num_classes, config=self.cfg.to_dict(), metrics=self.metrics,
                           class_names=list(m.class_names) if m.class_names else None,
                           sharded=self.p.parallel.sharded, evaluation=self.p.parallel.evaluation,
                           text_encoder=None if self.text_set is None else partial(online_encoder, self.text_set,
                                                                                   self.device))

    # -- checkpoints ----------------------------------------------------------------------------------
    def restore(self, ckpt: dict[str, Any], where: Path) -> None:
        """Every part's check on `ckpt` (read from `where`: a file, or a sharded checkpoint's records), then its
        tensors read (a sharded checkpoint's into this rank's shards, any world size and mode), then every part
        loads."""
        check_all(self.parts, ckpt, str(where))
        with comm_guard("reading the checkpoint's tensors", self.state.step):
            ckpt = materialize(ckpt, where, self.p.parallel.load_targets(lambda: compose(self.parts)),
                               collective=self.p.parallel.sharded)
        for part in self.parts:
            part.load_state_dict(ckpt)

    def load_from(self, where: Path) -> None:
        """restore() from the checkpoint at `where` (the divergence guard's rollback)."""
        self.restore(load_checkpoint(where), where)

    def resume_from(self, ckpt: dict[str, Any], where: Path) -> None:
        """Continue from `ckpt` (read from `where`): every part's check first, then every part loads."""
        self.restore(ckpt, where)
        s = self.state
        self.log.info(f"resumed from {where} at step {s.step} (epoch {s.epoch}, step {s.step_in_epoch} in epoch)")
        self.last_saved = s.step
        self.meter.reset()  # the first log interval is timed from after the resume
        self.own.reset()

    def checkpoint(self) -> Path | None:
        """Collective: the ranks that hold the same weights compare fingerprints; then the checkpoint the parts
        compose is written as the run's mode writes it (train.parallel: DDP rank 0 one file, sharded every rank)."""
        s = self.state
        self.guard.checkpointed(s.step)
        self.out.ckpts.pinned = {self.guard.last_clean} if self.guard.last_clean is not None else set()
        fp = weights_fingerprint(self.p.trained)  # this rank's tensors (its shards under the sharded modes)
        self.metrics.write_rank({"step": s.step, "weights_fingerprint": fp})
        with comm_guard("the weights check before a checkpoint", s.step):
            every = dist.all_gather_object(fp)
        for group in self.p.parallel.replica_groups(self.world):
            if len({every[r] for r in group}) > 1:
                raise RuntimeError(f"step {s.step}: ranks {group} hold different weights (fingerprints "
                                   f"{[every[r] for r in group]}); the replicas diverged, which is a bug or a "
                                   "hardware fault")
        t0 = time.perf_counter()
        path = self.p.parallel.save(self.out.ckpts, self.parts)
        if path is not None and dist.is_main():
            self.log.info(f"saved checkpoint {path}{' (+ EMA weights)' if path.suffix == '.pt' else ''} in "
                          f"{time.perf_counter() - t0:.1f}s")
        self.last_saved = s.step
        return path
