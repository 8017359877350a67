"""FID during training (`dit-train --fid-every N --fid-ref REF`): a trainer hook (train/hooks.py protocol).

Every `every` steps all ranks sample `num_samples` images with the EMA weights (under DDP rank 0 holds the EMA; it
is broadcast into a sampling copy on every rank; under the sharded modes every rank samples through its shards of
the EMA, each block gathered for its pass, the ranks in lockstep) with exactly `dit-sample`'s deterministic sampler,
through one sampling protocol (dit/protocols.py): a release's (`--protocol NAME`: its grid, solver, guidance rule
and image conversion, with --fid-steps, --fid-cfg-scale and --fid-labels as overrides), or `custom`, the run
objective's FID sampler (DDPM; flow: the Euler ODE; a one-step model: one mean-flow step) with `steps` steps (250,
one-step models 1), guidance `cfg_scale` (1.5) on the channels `--cfg-channels` picks (auto: dit-sample's rule);
classes chosen by (seed, index) as `dit-sample --num-samples N --seed S --labels L` chooses them (`labels`: uniform
draws or equal counts per class, sample/plan.py), or for a text model the prompts of `--fid-prompts` or of the
captioned reference (REF.prompts.jsonl) as `dit-sample --prompts` assigns them, encoded by the run's text encoder
and guided against the empty prompt (sample.conditions.fid_sampling), noise of sample i from (seed, i). Each rank
extracts the Inception features of its images; rank 0 gathers them, computes FID, sFID, Inception Score and
precision/recall against REF (whose features or precomputed statistics are loaded once, in `setup`) with
`dit-eval`'s own function (evaluate.run.compute_metrics, evaluation protocol `adm`), and writes them with the seconds
the evaluation took to metrics.jsonl and TensorBoard.

Each row records what the hook ran (`fid_run`): `sampling`, the sampling protocol's own record (Protocol.record:
name, solver, steps, guidance scale, interval and channels, the grid with its resolved time shift, labels, image
conversion, the values changed from the release's row), the one record of what the sampler ran; beside it what
that record does not hold: the guidance as applied to this model (and the scale asked for when it could not apply
it, with the reason), the evaluation protocol, seed and weights, the sampled model's architecture, the Inception
network's identity, the reference (file, kind, who made its statistics) and the dit-sample / dit-eval arguments
that reproduce the number. dit-report reads that record, never config.json, to describe the evaluation. A random
Inception's numbers are stored and named as such (evaluate/labels.py: `fd_rand`, "FD-rand0-5K"), never as FID.

Training is unchanged by it: the hook uses its own model copy (sharded: the EMA, in eval mode for the passes and
resharded after) and per-sample generators, draws no global random numbers and leaves the trained model and its
optimizer untouched.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dit_pipeline.common import distributed as dist
from dit_pipeline.common.errors import UserError
from dit_pipeline.common.hooks import HookContext, evaluating
from dit_pipeline.common.latent_norm import LatentNorm
from dit_pipeline.common.log import get_logger
from dit_pipeline.common.settings import choice, positive, setting
from dit_pipeline.common.rae_decoder import fit_decoder
from dit_pipeline.common.vae import load_vae
from dit_pipeline.evaluate import dinov2
from dit_pipeline.evaluate.features import gather_rows, local_features, source_features
from dit_pipeline.evaluate import labels as L
from dit_pipeline.evaluate.inception import INPUT_SIZE, describe_network, load_inception
from dit_pipeline.evaluate.inputs import Source, check_resolution, open_source
from dit_pipeline.evaluate.metrics import NEIGHBOURHOOD_K
from dit_pipeline.evaluate.protocols import PROTOCOLS as EVAL_PROTOCOLS
from dit_pipeline.evaluate.run import Side, check_network, compute_metrics, fd_dinov2
from dit_pipeline.sample import plan
from dit_pipeline.sample.config import FID_SAMPLER, FLOW_SAMPLERS, PROTOCOLS, SPECS, protocols
from dit_pipeline.sample.guidance import guidance_inert
from dit_pipeline.sample.generate import (generate_images, generate_latents, protocol_loop, protocol_model_fn,
                                          resolve_cfg_channels)
from dit_pipeline.sample.grid import GRIDS, DecodeSettings, effective_cfg_scale, run_prediction, run_time_shift

FID_CFG_SCALE = 1.5  # the guidance of DiT's FID-50K 2.27, where guidance acts (without --protocol)


# ----------------------------------------------------------------------------------------------------------
# The hook's settings: dit-train's TrainConfig inherits them (so they are stored flat in its config, and its
# options come from them); `FidHook.from_settings` reads them. A new FID setting is a field here and its use in
# the hook.

@dataclass(kw_only=True)
class FidSettings(DecodeSettings):
    """Every `fid_every` steps all ranks sample with the EMA weights as dit-sample does and rank 0 logs FID,
    sFID, Inception Score, precision and recall against `fid_ref`."""

    fid_every: int | None = setting(
        None, "Every N steps all ranks sample with the EMA weights (as dit-sample) and log fid, sfid, "
        "inception_score, precision, recall to metrics.jsonl (needs --vae, --fid-ref)", group=GRIDS, shown="off")
    fid_ref: str | None = setting(
        None, "FID reference: the ADM reference batch (VIRTUAL_imagenet256_labeled.npz), an .npz or folder of "
        "images, or a statistics file", group=GRIDS)
    fid_num_samples: int = setting(5000, "Samples per FID evaluation", group=GRIDS)
    fid_steps: int | None = setting(None, "Steps of the FID samples (the sampler's own count, as dit-sample --steps)",
                                    group=GRIDS, shown="the protocol's; else 250, a one-step model's 1")
    fid_cfg_scale: float | None = setting(
        None, "Guidance scale of the FID samples; a scale that would do nothing (a MeanFlow model, one without "
        "label dropout, a protocol without guidance) is refused", group=GRIDS,
        shown=f"the protocol's; else {FID_CFG_SCALE}; 1 (none) where guidance cannot act")
    protocol: str | None = setting(
        None, "Sample the FID images as a release does (as dit-sample's protocol: its grid, solver, guidance rule, "
        "image conversion; docs/sampling.md); the FID steps and guidance scale, when given, and the FID "
        "labels change its values (recorded as overrides); a name of dit-sample --protocol but AutoGuidance's "
        "(NanoGen's configs: nanogen/CONFIG, docs/nanogen-protocols.md)",
        group=GRIDS, shown="none: the objective's FID sampler")
    fid_batch_size: int = setting(32, "FID samples per GPU and batch", group=GRIDS)
    fid_labels: str | None = setting(None, "Classes of the FID samples: uniform draws or equal counts per class, as "
                                     "dit-sample --labels", group=GRIDS, choices=plan.LABEL_SAMPLINGS,
                                     shown="--protocol's, else uniform")
    fid_prompts: str | None = setting(
        None, "A text run's FID prompts, as dit-sample --prompts reads them (one per line, JSON Lines with a "
        "\"prompt\", or JSON): prompt k for the N / P samples from k N / P, --fid-num-samples N a multiple of their "
        "count P", group=GRIDS, shown="the captioned --fid-ref's REF.prompts.jsonl (dit-eval --make-ref --captions)")
    inception: str | None = setting(
        None, "Inception weights file weights-inception-2015-12-05-6726825d.pth", group=GRIDS,
        shown="torch hub cache, fetched once")
    fid_input_size: int = setting(INPUT_SIZE, "Inception input resolution (299 for real numbers; smaller only for "
                                  "trying FID without weights, with --fid-random-inception)", group=GRIDS)
    fd_dinov2: bool = setting(False, "Also log FD_DINOv2 (EDM2; evaluate/dinov2.py) of the same samples", group=GRIDS)
    dinov2: str | None = setting(None, "DINOv2 ViT-L/14 weights of --fd-dinov2", group=GRIDS,
                                 shown="torch hub cache, fetched once")
    fid_random_inception: int | None = setting(
        None, "Random Inception weights of this seed instead of the weights file: trying FID offline or in a smoke "
        "test (docs/evaluation.md); the numbers are not FID", group=GRIDS,
        shown="off")

    def fid_problems(self, objective: str | None = None) -> list[str]:
        """Every problem of the FID settings (`objective`: the run's, which a --protocol's solver must sample)."""
        p: list[str] = []
        if self.fid_every is None:
            p += [f"{flag} only serves FID during training: add --fid-every N (or drop it)"
                  for flag, v in (("--fid-ref", self.fid_ref), ("--fid-prompts", self.fid_prompts)) if v]
            return p
        p += positive(self, "fid_every", "fid_num_samples", "fid_steps", "fid_batch_size")
        if not str(self.fid_ref or "").strip():
            p.append("--fid-every needs --fid-ref, the reference (e.g. VIRTUAL_imagenet256_labeled.npz)")
        if not str(self.vae or "").strip():
            p.append("--fid-every needs --vae, the VAE that decodes the samples (the one the shards were "
                     "extracted with)")
        if isinstance(self.fid_num_samples, int) and 0 < self.fid_num_samples < 4:
            p.append(f"--fid-num-samples must be >= 4 (precision/recall use 3 nearest neighbours), got "
                     f"{self.fid_num_samples}")
        if self.fid_cfg_scale is not None and not (isinstance(self.fid_cfg_scale, (int, float))
                                                   and self.fid_cfg_scale >= 1.0):
            p.append(f"--fid-cfg-scale must be >= 1 (1 = no guidance), got {self.fid_cfg_scale!r}")
        if self.protocol is not None and self.protocol in PROTOCOLS and \
                PROTOCOLS[self.protocol].guidance.rule == "autoguidance":
            p.append(f"--protocol {self.protocol} guides with a second network, which FID during training does not "
                     "load; sample it with dit-sample --protocol " + self.protocol + " --guidance-model FILE")
        elif self.protocol is not None and self.protocol not in PROTOCOLS:
            p.append(protocols.unknown(self.protocol))
        elif self.protocol is not None and protocols.missing_features(PROTOCOLS[self.protocol]):
            p.append(str(protocols.missing_features(PROTOCOLS[self.protocol])))
        elif self.protocol is not None and objective in SPECS and \
                PROTOCOLS[self.protocol].solver not in SPECS[objective].samplers:
            p.append(f"--protocol {self.protocol} samples with {PROTOCOLS[self.protocol].solver}, which does not sample "
                     f"a {objective} model; choose the protocol of a {objective} release")
        return p + (choice(self, "fid_labels", plan.LABEL_SAMPLINGS) if self.fid_labels is not None else [])

    def protocol_fit(self, traits: protocols.ModelTraits) -> str | None:
        """Why --protocol does not fit the model this run trains, described by `traits` (None: it fits, or no known
        --protocol): the check dit-sample applies to a checkpoint (dit.protocols.fit_problem), made before any
        process group starts, naming the rows that fit."""
        if self.protocol is None or self.protocol not in PROTOCOLS:
            return None
        return protocols.fit_problem(PROTOCOLS[self.protocol], traits, instead="drop --protocol (the FID samples then "
                                     "take --fid-steps, --fid-cfg-scale and the objective's FID sampler)")


@dataclass
class FidHook:
    every: int
    ref: str
    vae: str
    vae_config: str | None = None
    num_samples: int = 5000
    steps: int | None = None  # None: the protocol's, else the objective's default (250; one-step models: 1)
    cfg_scale: float | None = None  # None: the protocol's, else 1.5
    batch_size: int = 32
    seed: int = 0
    labels: str | None = None  # sample.plan.LABEL_SAMPLINGS: uniform draws or equal counts; None: the protocol's
    inception: str | None = None
    input_size: int = INPUT_SIZE  # test knob (299 for real numbers)
    random_inception: int | None = None  # test knob
    sampler: str = "ddpm"  # sample.config.FID_SAMPLER of the run's objective (flow: "euler")
    objective: str = "ddpm"  # the run's
    protocol: str | None = None  # a release's sampling protocol (dit/protocols.py); None: `custom` from the above
    cfg_channels: str = "auto"  # resolved per model (sample.generate.resolve_cfg_channels), recorded with the FID
    fd_dinov2: bool = False  # also FD_DINOv2 of the same samples (evaluate/dinov2.py, fast resize)
    dinov2: str | None = None
    prompts: str | None = None  # a text run's FID prompts: --fid-prompts, else the captioned reference's
    _state: dict[str, Any] = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def from_settings(cls, s: FidSettings, *, vae: str, vae_config: str | None, seed: int,
                      objective: str) -> "FidHook":
        """The hook a TrainConfig's FID settings ask for (`vae`: the --vae or the manifest's VAE)."""
        assert s.fid_every is not None and s.fid_ref is not None
        cfg_scale = effective_cfg_scale(s.fid_cfg_scale, fid_default_scale(s.protocol), objective, s,
                                        "--fid-cfg-scale", protocol=s.protocol)
        return cls(every=s.fid_every, ref=s.fid_ref, vae=vae, vae_config=vae_config, num_samples=s.fid_num_samples,
                   steps=s.fid_steps, cfg_scale=cfg_scale, batch_size=s.fid_batch_size, seed=seed,
                   inception=s.inception, input_size=s.fid_input_size, random_inception=s.fid_random_inception,
                   sampler=FID_SAMPLER[objective], labels=s.fid_labels, cfg_channels=str(s.cfg_channels),
                   fd_dinov2=s.fd_dinov2, dinov2=s.dinov2, objective=objective, protocol=s.protocol,
                   prompts=fid_prompts_file(s))

    def setup(self, ctx: HookContext) -> None:
        """Every rank: VAE, Inception, a sampling copy of the model; the reference's features (all ranks
        extract them, cached beside REF). UserError for a bad REF, VAE or too few samples."""
        if self.num_samples <= NEIGHBOURHOOD_K:
            raise UserError(f"--fid-num-samples {self.num_samples}: precision and recall need at least "
                            f"{NEIGHBOURHOOD_K + 1} samples (5000 is usual during training, 50000 for papers)")
        ref: Source = dist.on_rank0(lambda: open_source(self.ref, "--fid-ref"))
        vae, ident = load_vae(self.vae, config=self.vae_config, device=ctx.device)
        if int(ident["latent_channels"]) != int(ctx.model_config["in_channels"]):
            raise UserError(f"--vae {self.vae!r} has {ident['latent_channels']} latent channels but the model "
                            f"trains on {ctx.model_config['in_channels']}")
        fit_decoder(vae, ident, ctx.latent, int(ctx.model_config["input_size"]), f"--vae {self.vae!r}")
        size = int(ctx.model_config["input_size"]) * int(ident["downsample_factor"])
        check_resolution((size, size), ref, "--fid-ref: the FID samples (the model's latents decoded by --vae)")
        inception, inc_id = load_inception(self.inception, device=ctx.device, random_seed=self.random_inception,
                                           input_size=self.input_size)
        note = check_network(ref, inc_id, "--fid-ref")  # every rank holds `ref`: all refuse alike
        if note and dist.is_main():
            get_logger().warning("%s", note)
        feats = None
        if ref.kind != "statistics":
            feats = source_features(ref, inception, inc_id, batch_size=self.batch_size, device=ctx.device,
                                    use_cache=True, quiet=True, log=get_logger())
        # the sampling copy the EMA is broadcast into (DDP); the sharded modes sample through their shards instead
        sampler_model = None if ctx.sharded else copy.deepcopy(ctx.model).eval().requires_grad_(False)
        self._state = {"vae": vae, "inception": inception, "ref": Side(ref, feats), "model": sampler_model,
                       "inception_id": inc_id, "family": type(ctx.model),
                       "conditions": str(getattr(ctx.model, "conditions", ctx.model_config.get("conditions", "t")))}
        if self.fd_dinov2:
            net, ident = dinov2.load_dinov2(self.dinov2, device=ctx.device)
            self._state.update(dinov2=net, dinov2_ref=dinov2.source_features(
                ref, net, ident, batch_size=self.batch_size, use_cache=True, log=get_logger()))

    def _sync_ema(self, ctx: HookContext) -> torch.nn.Module:
        """The EMA weights (rank 0's; the raw model's when there is no EMA) in every rank's sampling copy."""
        model = self._state["model"]
        source = (ctx.ema if ctx.ema is not None else ctx.model).state_dict() if ctx.rank == 0 else {}
        with torch.no_grad(), dist.peer_guard("sending the EMA weights for FID"):
            for name, dst in model.state_dict().items():
                if ctx.rank == 0:
                    dst.copy_(source[name])
                dist.broadcast_tensor_(dst)
        return model

    def __call__(self, ctx: HookContext) -> dict[str, Any] | None:
        if not self._state:
            self.setup(ctx)
        start = time.perf_counter()
        proto = self.resolve_protocol(ctx)
        shape = (int(ctx.model_config["in_channels"]), int(ctx.model_config["input_size"]),
                 int(ctx.model_config["input_size"]))
        if ctx.sharded:  # every rank's passes through its EMA shards, together
            with ctx.evaluation(ctx.ema if ctx.ema is not None else ctx.model) as model, evaluating(model):
                idx, arrays = self._local_features(ctx, model, proto, shape)
        else:
            idx, arrays = self._local_features(ctx, self._sync_ema(ctx), proto, shape)
        ws = ctx.world_size
        channels = proto.guidance.channels
        rows = [sum(len(b) for b in plan.rank_batches(range(self.num_samples), self.batch_size, r, ws))
                for r in range(ws)]
        gathered = gather_rows(idx, arrays, self.num_samples, rows)
        if ctx.rank != 0:
            return None
        samples = Side(Source(ctx.run_dir, "features", count=self.num_samples), gathered)
        numbers = compute_metrics(samples, self._state["ref"], device=ctx.device)
        if self.fd_dinov2:
            numbers["fd_dinov2"] = fd_dinov2(gathered["dinov2"] if gathered else None, self._state["dinov2_ref"])
        seed = self.random_inception
        stored = {L.record_key(k, seed): v for k, v in numbers.items()}
        names = {f"{k}_name": v for k, v in L.metric_names(self.num_samples, seed).items()
                 if stored.get(k) is not None}
        run = self.run_record(ctx, proto, shape)
        text = bool(self._state.get("conds_record"))  # a text run's samples draw prompts, not labels
        record = {"step": ctx.step, **stored, **names, "fid_ref": Path(self.ref).name,
                  "fid_num_samples": self.num_samples, "fid_labels": None if text else proto.labels,
                  "fid_cfg_channels": channels,
                  "fid_seconds": time.perf_counter() - start, "fid_run": run}
        if ctx.metrics is not None:
            ctx.metrics.write(record)
        key = L.record_key("fid", seed)
        name = names[f"{key}_name"]
        dino = f", {names['fd_dinov2_name']} {numbers['fd_dinov2']:.4g}" if "fd_dinov2_name" in names else ""
        what = f"{name} {numbers['fid']:.4g}" if seed is None else f"{name} {numbers['fid']:.4g} ({L.random_note(seed)})"
        others = ", ".join(f"{short} {_fmt(numbers[k])}" for k, short in L.short_names(seed).items())
        get_logger().info("step %d: %s [protocol adm; %d samples vs %s; %s, guidance %s] (%s%s) in %.1f s", ctx.step,
                          what, self.num_samples, record["fid_ref"], L.sampled_by(run["sampling"]), run["guidance"],
                          others, dino, record["fid_seconds"])
        return record

    def _local_features(self, ctx: HookContext, model: torch.nn.Module, proto: protocols.Protocol,
                        shape: tuple[int, ...]) -> tuple[list[int], dict[str, Any]]:
        """This rank's samples (plan.rank_batches) drawn with `model` and their features. Under the sharded modes
        a rank with fewer batches than rank 0 runs the passes of as many more (its first batch again, not decoded),
        since every pass is a collective of all ranks."""
        convention = "sit"  # the trainer's flow models run SiT's time (dit/flow.py)
        diffusion = protocol_loop(proto, latent_shape=shape, recorded_shift=run_time_shift(ctx.config),
                                  convention=convention, learn_sigma=bool(model.learn_sigma),
                                  prediction=run_prediction(ctx.config))  # the run's
        conds = self._conditions(ctx, proto)  # each sample's class, or a text run's prompt (sample/conditions.py)
        model_fn = protocol_model_fn(proto, model, objective=self.objective, convention=convention,
                                     conditioning=conds.conditioning(model))  # the guidance's null condition
        labels = conds.ids
        batches = plan.rank_batches(range(self.num_samples), self.batch_size, ctx.rank, ctx.world_size)
        most = len(plan.rank_batches(range(self.num_samples), self.batch_size, 0, ctx.world_size))
        norm = LatentNorm.from_record(ctx.latent)  # the shards' normalization, inverted before decoding
        how = {"seed": self.seed, "sampler": proto.solver, "cfg_scale": proto.guidance.scale, "model_fn": model_fn}

        def images():
            for b in batches:
                yield b, generate_images(model, self._state["vae"], diffusion, indices=b, labels=labels[b].tolist(),
                                         norm=norm, conversion=proto.conversion, condition=conds.condition(b), **how)
            for _ in range(most - len(batches) if ctx.sharded else 0):  # lockstep with rank 0
                b = batches[0] if batches else [0]
                generate_latents(model, diffusion, indices=b, labels=labels[b].tolist(), condition=conds.condition(b),
                                 **how)

        extractor = self._state["inception"]
        if self.fd_dinov2:  # the DINOv2 features of the same images, as an extra output
            extractor = WithDINOv2(extractor, self._state["dinov2"])
        return local_features(extractor, images(), ctx.device)

    def _conditions(self, ctx: HookContext, proto: protocols.Protocol) -> Any:
        """The condition of every FID sample for the model's condition kind (sample.conditions.fid_sampling): a
        class by (seed, index) under the protocol's label rule, or a text run's prompts (read once; the run's text
        encoder loaded for this evaluation and let go after it)."""
        from dit_pipeline.common.prompts import read_prompts
        from dit_pipeline.sample.conditions import fid_sampling

        kind = ctx.model.condition_kind
        if kind == "text" and "prompts" not in self._state:
            self._state["prompts"] = read_prompts(self.prompts, "--fid-prompts") if self.prompts else None
        try:
            conds = fid_sampling(kind, num_samples=self.num_samples, seed=self.seed, labels=proto.labels,
                                 num_classes=ctx.num_classes, prompts=self._state.get("prompts"),
                                 text_encoder=ctx.text_encoder, device=ctx.device)
        except ValueError as e:  # sample.prompts.prompt_ids: a count the prompts do not divide
            raise UserError(f"--fid-num-samples: {e} (--fid-prompts {self.prompts})") from None
        self._state["conds_record"] = conds.fingerprint()
        return conds

    def resolve_protocol(self, ctx: HookContext) -> protocols.Protocol:
        """The sampling protocol of the FID samples (dit/protocols.py): --protocol's row (with --fid-steps,
        --fid-cfg-scale and --fid-labels where they change it, recorded as overrides), or `custom`: the objective's
        FID sampler, its default steps, guidance 1.5 on --cfg-channels' channels (auto: dit-sample's rule), the
        run's time shift. Guidance is off (scale 1) where it cannot act (sample.guidance.guidance_inert: a model without
        the null class, a MeanFlow model)."""
        conditions = self._state["conditions"]
        guided = guidance_inert(conditions, float(ctx.model_config.get("class_dropout_prob", 0.1)) > 0) is None
        if self.protocol is not None:
            p = protocols.protocol(self.protocol).with_overrides(count=self.steps, scale=self.cfg_scale,
                                                                 labels=self.labels)
            if p.solver not in SPECS[self.objective].samplers:
                raise UserError(f"--protocol {p.name} samples with {p.solver}, which does not sample a {self.objective} "
                                "model; choose the protocol of a release of this objective")
            return p if guided else p.with_overrides(scale=1.0)
        try:
            channels = resolve_cfg_channels(self.cfg_channels, ctx.model_config,
                                            "flow" if self.sampler in FLOW_SAMPLERS else "ddpm")
        except ValueError as e:
            raise UserError(str(e)) from None
        scale = (self.cfg_scale if self.cfg_scale is not None else FID_CFG_SCALE) if guided else 1.0
        return protocols.custom(solver=self.sampler, steps=self.steps or SPECS[self.objective].default_steps,
                                scale=scale, channels=channels, time_shift=run_time_shift(ctx.config),
                                labels=self.labels or "uniform")

    def run_record(self, ctx: HookContext, proto: protocols.Protocol, shape: tuple[int, ...]) -> dict[str, Any]:
        """What this evaluation ran, as dit-report shows it (see the module docstring): the sampling protocol's
        record (dit/protocols.py, resolved: solver, steps, guidance, grid and shift, labels, image conversion,
        overrides) and what it does not hold: the guidance as applied to this model and why an asked scale was
        not, the evaluation protocol, weights, model, Inception network, reference and the reproducing commands."""
        mc = dict(ctx.model_config)
        ref: Side = self._state["ref"]
        conditions = self._state["conditions"]
        g = proto.guidance
        asked = self.cfg_scale if self.cfg_scale is not None else fid_default_scale(self.protocol)
        why = None
        if asked != g.scale:
            inert = guidance_inert(conditions, float(mc.get("class_dropout_prob", 0.1)) > 0)
            why = f"--fid-cfg-scale {asked:g} asked; not applied: {inert or 'the model cannot be guided'}"
        return {"protocol": "adm", "protocol_source": EVAL_PROTOCOLS["adm"].source,
                "sampling": proto.record(shape, run_time_shift(ctx.config)),
                "guidance": applied_guidance(proto, conditions), "guidance_note": why, "cfg_scale_asked": asked,
                "seed": self.seed, "weights": "ema" if ctx.ema is not None else "raw", "num_samples": self.num_samples,
                "model": {"name": mc.get("model") or (ctx.config or {}).get("model"), "family": mc.get("family", "DiT"),
                          "architecture": self._state["family"].describe(mc), "input_size": mc.get("input_size"),
                          "in_channels": mc.get("in_channels"), "conditions": mc.get("conditions", "t")},
                "inception": self._state["inception_id"], "network": describe_network(self._state["inception_id"]),
                "random_inception": self.random_inception,
                "reference": {"file": Path(self.ref).name, "path": str(self.ref), "kind": ref.source.kind,
                              "count": ref.source.count, "provenance": ref.source.provenance,
                              "statistics": "precomputed" if "pool" in ref.source.stats else "computed from its images"},
                # what reproduces these samples and numbers offline (RAE #70: online and offline FID must agree):
                # dit-sample --ckpt <this step's checkpoint> <these> --npz S.npz; dit-eval S.npz --ref <the ref> <eval>
                "dit_sample_args": self.sample_args(proto, ctx.ema is not None),
                "dit_eval_args": self.eval_args(),
                # a text run's: the prompts (their file, count and sha256) and the text encoder that encoded them
                **({"prompts": {"file": str(self.prompts), "count": len(self._state.get("prompts") or ()),
                                **self._state["conds_record"]}} if self._state.get("conds_record") else {})}

    def sample_args(self, proto: protocols.Protocol, ema: bool) -> list[str]:
        """dit-sample's flags for the same samples: --protocol NAME with its values as run, or the sampler flags."""
        vae = ["--vae", str(self.vae)] + (["--vae-config", str(self.vae_config)] if self.vae_config else [])
        g = proto.guidance
        if proto.name != "custom":
            how = ["--protocol", proto.name, "--steps", str(proto.count), "--cfg-scale", f"{g.scale:g}"]
        else:
            how = ["--sampler", proto.solver, "--steps", str(proto.count), "--cfg-scale", f"{g.scale:g}",
                   *(["--cfg-channels", g.channels] if g.scale > 1 else [])]
        cond = ["--prompts", str(self.prompts)] if self._state.get("conds_record") else ["--labels", proto.labels]
        return [*vae, "--weights", "ema" if ema else "model", *how, "--num-samples", str(self.num_samples),
                *cond, "--seed", str(self.seed), "--batch-size", str(self.batch_size)]

    def eval_args(self) -> list[str]:
        out = ["--protocol", "adm"]
        if self.random_inception is not None:
            out += ["--random-inception", str(self.random_inception)]
        elif self.inception:
            out += ["--inception", str(self.inception)]
        return out + (["--input-size", str(self.input_size)] if self.input_size != INPUT_SIZE else [])


def fid_prompts_file(s: FidSettings) -> str | None:
    """The prompts a text run's FID samples draw: --fid-prompts, else the captioned reference's REF.prompts.jsonl
    (evaluate/reference.py), else None."""
    from dit_pipeline.evaluate.reference import prompts_path

    if s.fid_prompts:
        return str(s.fid_prompts)
    if not s.fid_ref:
        return None
    path = prompts_path(Path(str(s.fid_ref)).expanduser())
    return str(path) if path.is_file() else None


def fid_default_scale(protocol: str | None) -> float:
    """The FID guidance scale when --fid-cfg-scale is not given: the protocol's, else FID_CFG_SCALE."""
    return PROTOCOLS[protocol].guidance.scale if protocol in PROTOCOLS else FID_CFG_SCALE


def applied_guidance(proto: protocols.Protocol, conditions: str) -> str:
    """The guidance a protocol applies to a model with these time inputs, in words (dit-report shows it)."""
    g = proto.guidance
    if conditions == "meanflow":
        return "none at sampling (MeanFlow trains its guidance in)"
    where = "" if g.interval is None else \
        f" where the noise level is in {g.ends[0]}{g.interval[0]:g}, {g.interval[1]:g}{g.ends[1]}"
    if conditions == "imf":
        return f"omega {g.scale:g} (iMF's network input){where}"
    if g.rule not in ("cfg", "autoguidance") or not g.scale > 1.0:
        return "none (1.0)"
    on = "all" if g.channels == "all" else f"the first {g.channels}"
    return f"{g.scale:g} on {on} channel(s){where}" + (" (AutoGuidance)" if g.rule == "autoguidance" else "")


class WithDINOv2(torch.nn.Module):
    """Inception's outputs plus "dinov2": the DINOv2 features of the same images (one pass over the samples)."""

    def __init__(self, inception: torch.nn.Module, dino: torch.nn.Module):
        super().__init__()
        self.inception, self.dino = inception, dino

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        return {**self.inception(images), "dinov2": self.dino(images)}


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4g}"

