"""Everything decided before a process touches a GPU: shard set, model shape vs latents, batch arithmetic,
data layout, run length, and the resource estimate that `--dry-run` prints.

The memory estimate answers the classic DiT questions (will this batch fit? why did the job die with -9?):
per GPU from train.memory (a measured table where a row matches, else an analytic estimate, labelled as
such); per node, the loader's shuffle buffers in host memory. `--micro-batch-size auto` takes the largest
micro-batch whose estimate fits the visible GPU.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from dit_pipeline.common import distributed as dist
from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import check_writable_dir
from dit_pipeline.common.teacher import Teacher
from dit_pipeline.dit.meanflow import VARIANTS as MEANFLOW_OBJECTIVES
from dit_pipeline.shards import Manifest
from dit_pipeline.shards.stats import NEAR_ONE, first_samples_std, fix_hint
from dit_pipeline.dit.shift import direction as shift_direction
from dit_pipeline.train import memory
from dit_pipeline.train.config import (ARCH_OVERRIDES, DEFAULT_MAX_STEPS, DEFAULT_NUM_WORKERS, MODEL_OPTIONS, BatchPlan,
                                       TrainConfig, batch_plan, implied_objective, resolve_time_shift)
from dit_pipeline.train.data import ShardSource, open_shards
from dit_pipeline.train.init import InitWeights, init_line, load_init
from dit_pipeline.train.latents import LatentSpec, latent_sample_problem
from dit_pipeline.train.mix import mix_spec, open_mix
from dit_pipeline.train.mixprep import check_val_set, mix_lines, mix_plan, resolve_lanes, steps_counter, val_line
from dit_pipeline.train.partition import DataLayout, EpochPlan, plan_epoch
from dit_pipeline.train.optim import optimizer_line
from dit_pipeline.train.parallel import LEAST_TRAFFIC_FIRST, MODE, Parallel, mesh_shape, parse_gib, shard_count
from dit_pipeline.train.recipes import recipe_line
from dit_pipeline.train.reg import RegTokens, read_reg_tokens
from dit_pipeline.train.repa import CachedTeacher, check_repa, repa_line
from dit_pipeline.train.schedule import LrSchedule, build_schedule, schedule_line
from dit_pipeline.train.speed import compile_enabled
from dit_pipeline.train.text import TextSet, open_text_set

GiB = float(2**30)
EMA_SHORT_RUN = 10            # EMA grids of a run shorter than this many EMA horizons show early weights


@dataclass
class Preflight:
    """What `prepare` checked and decided before any GPU work (printed by --dry-run)."""

    cfg: TrainConfig
    world_size: int
    batch: BatchPlan
    source: ShardSource
    model_kwargs: dict[str, Any]      # create_model(**model_kwargs)
    layout: DataLayout
    plan0: Any                        # the first epoch's plan: train.partition.EpochPlan, or a mix's MixEpoch
    total_steps: int                  # optimizer steps of the whole run (--max-steps, --epochs or the default)
    notes: dict[str, str] = dataclasses.field(default_factory=dict)  # plan line -> a default chosen for the user
    sha256: str | None = None         # shards.iter_shard's check of each shard: whole | stream | None
    sha256_bytes: int = 0             # whole shards held at once per node by the "whole" check
    teacher: "Teacher | CachedTeacher | None" = None  # --repa: the teacher on the CPU, or cached tokens (train.repa)
    schedule: LrSchedule | None = None  # the lr of every step (train.schedule); None only for hand-made Preflights
    latent_std: tuple[float, int, str] | None = None  # (std, samples, shard): a quick look (shards.first_samples_std)
    init: InitWeights | None = None   # --init: the weights the new run starts from (train/init.py)
    text: TextSet | None = None       # the shard set's text side when the run is conditioned on text (train/text.py)
    reg: RegTokens | None = None      # --use-reg: the cached class tokens (train/reg.py)
    parallel: Parallel | None = None  # --parallel: the mode and its mesh (train/parallel.py)
    unfit: str | None = None          # why the memory estimate does not fit the GPU (refused; a dry run prints first)
    mix: Any = None                   # a data mix (--source / --mix): train.mix.OpenMix; None: one shard set
    lanes: int = 0                    # the mix's lanes (train/mixplan.py)


def resolve_defaults(cfg: TrainConfig, num_shards: int, world: int) -> tuple[TrainConfig, dict[str, str]]:
    """`cfg` with the run length and the loader workers filled in where not given, and what was chosen."""
    notes: dict[str, str] = {}
    if cfg.max_steps is None and cfg.epochs is None:
        cfg = dataclasses.replace(cfg, max_steps=DEFAULT_MAX_STEPS)
        notes["length"] = ("--max-steps and --epochs not given: the DiT paper's 400K steps; stop earlier with "
                           "SIGTERM/SIGUSR1 (a checkpoint is written) or pass --max-steps")
    if cfg.num_workers is None:
        workers = max(1, min(DEFAULT_NUM_WORKERS, num_shards // max(1, world)))
        cfg = dataclasses.replace(cfg, num_workers=workers)
        if workers < DEFAULT_NUM_WORKERS:
            notes["readers"] = (f"{workers} loader worker(s) per rank instead of {DEFAULT_NUM_WORKERS}: the set "
                                f"has {num_shards} shard(s) for {world} rank(s), and each worker reads whole shards")
    return cfg, notes


def local_ranks(world: int) -> int:
    """Ranks on this node: the launcher's count, else the GPUs visible here (at most `world`, at least 1)."""
    return dist.local_world_size() if dist.launched() else min(world, max(1, torch.cuda.device_count()))


def sha256_mode(cfg: TrainConfig, source: ShardSource, plan0: Any, world: int, mix: Any = None
                ) -> tuple[str | None, int]:
    """How the trainer checks each shard's sha256, and the bytes of whole shards a node would hold for it.

    "whole" (read and hashed before any of its samples is used) when the shards that all readers of a node
    read at once fit in a quarter of the available host memory, else "stream" (hashed as it is parsed and
    checked at its end, so a mismatch is found after its samples were used); None with --no-verify-shards.
    """
    if not cfg.verify_shards:
        return None, 0
    if mix is not None:  # a mix's lanes, each reading up to shards_in_flight visits at once
        biggest = max((rec.bytes for o in mix.sources for rec in o.manifest.shards), default=0)
        at_once = min(cfg.shards_in_flight, max((len(lane) for lane in plan0.lanes), default=0))
        need = local_ranks(world) * (len(plan0.lanes) // world) * at_once * biggest
    else:
        biggest = max((rec.bytes for rec in source.manifest.shards), default=0)
        at_once = min(cfg.shards_in_flight, max((len(s) for s in plan0.slot_shards), default=0))
        need = local_ranks(world) * plan0.workers * at_once * biggest
    avail = host_memory_available()
    return ("whole" if avail is not None and need <= 0.25 * avail * GiB else "stream"), need


def model_kwargs(cfg: TrainConfig, source: ShardSource, mix: Any = None) -> dict[str, Any]:
    """create_model arguments for this config and shard set (a mix: its first source's, all one latent space);
    UserError when they cannot match."""
    from dit_pipeline.dit.family import create_model

    m = source.manifest
    c, h, w = m.latent_shape
    where = source.folder or cfg.manifest
    if h != w:
        raise UserError(f"the shards in {where} hold {c}x{h}x{w} latents; DiT needs square latents")
    if cfg.image_size is not None and cfg.image_size != m.image_size:
        raise UserError(f"--image-size {cfg.image_size} does not match the shard set in {where}, extracted at "
                        f"{m.image_size}px ({c}x{h}x{w} latents); use --image-size {m.image_size} or extract "
                        f"the images again at {cfg.image_size}px")
    reg = read_reg_tokens(cfg, m)  # REG's class token width (train/reg.py)
    kw = arch_kwargs(cfg, m, read_text(cfg, source, mix), None if reg is None else reg.dim)
    try:
        with torch.device("meta"):
            create_model(**kw)
    except (ValueError, TypeError) as e:
        raise UserError(f"--model {cfg.model} cannot be built for the shard set in {where} ({c}x{h}x{w} "
                        f"latents, {m.num_classes} classes): {e}") from None
    return kw


def arch_kwargs(cfg: TrainConfig, m: Manifest, text: Any, reg_dim: int | None) -> dict[str, Any]:
    """create_model arguments of this config on a set of manifest `m`, with the text set `text` (its `dim` and
    `max_length`; None: no text) and REG's class token width `reg_dim` (None: no REG). Builds nothing."""
    from dit_pipeline.dit.family import lookup_preset
    from dit_pipeline.dit.objectives import spec

    c, h, _ = m.latent_shape
    kw: dict[str, Any] = {"name": lookup_preset(cfg.model)[1], "input_size": h,
                          "num_classes": m.num_classes, "in_channels": c,
                          "class_dropout_prob": cfg.class_dropout_prob, **condition_kwargs(cfg, text)}
    for k in ARCH_OVERRIDES:
        if getattr(cfg, k) is not None:
            kw[k] = getattr(cfg, k)
    for k in MODEL_OPTIONS:  # passed only when given: otherwise the family's own (plain DiT: all off)
        if getattr(cfg, k) is not None:
            kw[k] = bool(getattr(cfg, k))
    if reg_dim is not None:  # REG's class token; internal guidance's base head (train/reg.py)
        kw["reg_dim"] = reg_dim
    if cfg.base_model_depth is not None:
        kw["base_model_depth"] = cfg.base_model_depth
    # a velocity has C channels; SiT's train.py keeps DiT's 2C (learn_sigma=True) and drops the second half
    # in its forward, which thus gets no gradient: the same training, only the checkpoint's shape differs.
    # ddpm learns its variance in the second half (DiT's learned sigma), for every family.
    kw["learn_sigma"] = spec(cfg.objective).learn_sigma
    if spec(cfg.objective).conditions != "t":  # the time inputs the objective feeds (dit/conditions.py)
        kw["conditions"] = spec(cfg.objective).conditions
    return kw


def run_traits(cfg: TrainConfig, kw: dict[str, Any], m: Manifest) -> Any:
    """The trained model's dit.protocol_fit.ModelTraits, as dit-sample will read them from its checkpoint: the
    create_model arguments `kw` (channels, size, conditioning, REG's token, the base head), the objective, what the
    network predicts and the space of the set (pixels or latents)."""
    from dit_pipeline.dit.protocol_fit import model_traits

    space = "pixels" if ((m.extraction or {}).get("vae") or {}).get("kind") == "pixels" else "latent"
    return model_traits(kw, cfg.objective, {"kind": cfg.prediction}, space)


def check_cfg_channels(cfg: TrainConfig, kw: dict[str, Any]) -> None:
    """--cfg-channels N against the model's latent channels, before any work (issue 41: 20 of 4 passed the dry run
    and failed at the first grid)."""
    if cfg.sample_every is None and cfg.fid_every is None:
        return
    from dit_pipeline.sample.generate import resolve_cfg_channels

    try:
        resolve_cfg_channels(cfg.cfg_channels, {"in_channels": kw["in_channels"], "family": "DiT"})
    except ValueError as e:
        raise UserError(str(e)) from None


def check_recipe_extraction(cfg: TrainConfig, source: Any) -> TrainConfig:
    """A recipe run on a shard set (and text set) that is not the extraction its recipe requires, or of a recipe
    with settings not built here yet (train/recipes.py): refused before any work, or with --allow-departures, run
    with every difference added to its departures. How each tokenizer was recognised goes to `recognised`."""
    from dit_pipeline.train.recipes import extraction_departures, pending_departures

    recipe = cfg.recipe if isinstance(cfg.recipe, dict) else None
    if recipe is None:
        return cfg
    requires = recipe.get("requires") or {}
    text = None
    if "text" in requires and cfg.text is not None and source.folder is not None:
        from dit_pipeline.shards.siblings import read_text_sibling

        text = read_text_sibling(source.manifest, cfg.text, "--text")
    reg = read_reg_tokens(cfg, source.manifest) if "reg" in requires else None
    found, met = extraction_departures(requires, source.manifest, text, cfg.text,
                                       None if reg is None else reg.manifest, cfg.reg_tokens)
    pending = pending_departures(recipe)
    recipe = {**recipe, "recognised": met}
    if not found and not pending:
        return dataclasses.replace(cfg, recipe=recipe)
    where = source.folder or cfg.manifest
    if not cfg.allow_departures:
        why, anyway = [], []
        if found:
            why.append(f"needs another shard set than {where}: {'; '.join(found)}. Extract as the recipe says "
                       f"({recipe.get('extraction') or 'its extraction'})")
            anyway.append("train on these shards anyway")
        if pending:
            items = "; ".join(p.removeprefix("not built here yet: ") for p in pending)
            why.append(f"sets what this toolkit does not build yet: {items}")
            anyway.append("train without it")
        raise UserError(f"the recipe {recipe.get('name')!r} {'. It also '.join(why)}, or pass --allow-departures to "
                        f"{' and '.join(anyway)} (the paper's FID then does not apply)")
    known = list(recipe.get("departures") or [])
    new = [f"shards: {d}" for d in found] + pending
    return dataclasses.replace(cfg, recipe={**recipe, "departures": known + [d for d in new if d not in known]})


def read_text(cfg: TrainConfig, source: ShardSource, mix: Any = None) -> TextSet | None:
    """--text: the text set of the training shards' captions (shards.siblings.read_text_sibling: the same keys,
    made from these very captions), None without it; UserError for one that is not, or for online features of a
    set whose shards hold no captions. A mix: the text side of its first source with a text set (train.mix checked
    that they share one encoder), whose empty prompt is the run's null condition."""
    if mix is not None:
        first = next((o for o in mix.sources if o.text is not None), None)
        return open_text_set(first.text, str(first.spec.text)) if first is not None else None
    if cfg.text is None:
        return None
    from dit_pipeline.shards.siblings import read_text_sibling

    if source.folder is None:
        raise UserError("--text needs --shards as a folder (the text set is checked against its manifest's shards)")
    text = open_text_set(read_text_sibling(source.manifest, cfg.text, "--text"), cfg.text)
    if cfg.text_features == "online" and not source.manifest.has_captions:
        raise UserError(f"--text-features online encodes the captions the shards in {source.folder} hold, and they "
                        "hold none (extract them with --captions), or use the cached features")
    return text


def run_condition(cfg: TrainConfig, text: TextSet | None) -> str:
    """What the run is conditioned on (--conditioning; auto: text with --text, else class labels)."""
    return ("text" if text is not None else "class") if cfg.conditioning == "auto" else cfg.conditioning


def condition_kwargs(cfg: TrainConfig, text: TextSet | None) -> dict[str, Any]:
    """create_model's arguments for the run's condition (dit/conditioning.py): none for class labels; a text model
    takes the features' width and, where the family has condition tokens, the longest text as their count."""
    kind = run_condition(cfg, text)
    if kind == "class":
        return {}
    out: dict[str, Any] = {"conditioning": kind}
    if kind == "text" and text is not None:
        out["text_dim"] = text.dim
        if cfg.num_c_tokens is None and "num_c_tokens" in lookup_family(cfg.model).overrides:
            out["num_c_tokens"] = text.max_length
    problems = []
    if cfg.objective == "imf":  # the release's network takes class labels (dit/imf.py)
        problems.append(f"--objective {cfg.objective} trains class-conditional models here")
    if cfg.sample_every or cfg.fid_every:
        problems.append("the periodic grids and FID (--sample-every, --fid-every) sample class labels; sample this "
                        "model's checkpoints with dit-sample (a text model: --prompt)")
    if problems:
        raise UserError(f"--conditioning {kind}: " + "; ".join(problems))
    return out


def lookup_family(model: str) -> Any:
    from dit_pipeline.dit.family import lookup_preset

    return lookup_preset(model)[0]


def prepare(cfg: TrainConfig, world_size: int | None = None) -> Preflight:
    """Validate everything that can be checked without a GPU or a process group (raises on problems)."""
    cfg.validate()
    check_writable_dir(cfg.run_dir, f"--run-dir {cfg.run_dir}")  # before any work, also in a dry run
    world = dist.world_size() if world_size is None else world_size
    spec = mix_spec(cfg.source, cfg.mix, cfg.mix_epoch_size, cfg.mix_lanes)
    mix = open_mix(spec, text_features=cfg.text_features) if spec is not None else None
    source = mix.primary if mix is not None else open_shards(str(cfg.shards), cfg.manifest)
    if problem := latent_sample_problem(source.manifest, cfg.latent_sample):
        raise UserError(f"{source.folder or cfg.manifest}: {problem}")
    cfg = check_recipe_extraction(cfg, source)
    shards = sum(len(o.source.sizes) for o in mix.sources) if mix is not None else len(source.sizes)
    cfg, notes = resolve_defaults(cfg, shards, world)
    cfg, shift_note = resolve_time_shift(cfg, list(source.manifest.latent_shape))
    if shift_note:
        notes["time_shift"] = shift_note
    kw = model_kwargs(cfg, source, mix)
    # the data-parallel mode's mesh (an HSDP shape that does not divide the world size is refused here)
    local = dist.local_world_size() if dist.launched() else world  # the launcher's ranks share one node
    parallel = Parallel(cfg.parallel, mesh_shape(cfg.parallel, world, cfg.hsdp_shard_size, local))
    micro = (resolve_auto_micro_batch(cfg, kw, world, parallel) if cfg.micro_batch_size == "auto"
             else cfg.micro_batch_size)
    assert not isinstance(micro, str)  # validate() accepts a positive integer or "auto"
    batch = batch_plan(cfg.global_batch_size, micro, world)
    n = source.manifest.num_classes
    if cfg.sample_every and cfg.sample_classes:  # names as dit-sample takes them, against the shard set's names
        from dit_pipeline.sample.names import class_ids

        ids: list[int | str] = list(class_ids(list(cfg.sample_classes), source.manifest.class_names,
                        f"the shard set {source.folder or cfg.manifest}", "--sample-classes"))
        if max(int(i) for i in ids) >= n:
            raise UserError(f"--sample-classes {','.join(map(str, ids))}: the shard set has {n} classes, "
                            f"ids 0..{n - 1}")
        cfg = dataclasses.replace(cfg, sample_classes=ids)
    check_cfg_channels(cfg, kw)
    if problem := cfg.protocol_fit(run_traits(cfg, kw, source.manifest)):  # dit-sample's check, FID's samples
        raise UserError(problem)
    assert cfg.num_workers is not None  # resolve_defaults chose it
    layout = DataLayout(seed=cfg.seed, world_size=world, workers=max(1, cfg.num_workers),
                        micro_batch=batch.micro_batch, accum=batch.accum, shuffle_buffer=cfg.shuffle_buffer,
                        shards_in_flight=cfg.shards_in_flight)
    lanes = 0
    if mix is not None:  # the global sample sequence of the mix (train/mixplan.py)
        lanes = resolve_lanes(cfg, world, layout.workers, batch)
        cfg = dataclasses.replace(cfg, data_mix=mix.record(lanes))
        plan0: Any = mix_plan(mix, cfg, lanes, batch, 0)
        if plan0.steps == 0:
            raise UserError(f"the mix's first epoch holds {plan0.samples_total:,} samples over {lanes} lanes, not enough "
                            f"for one optimizer step of {batch.global_batch} samples ({plan0.piece} per lane); lower "
                            "--global-batch-size or --mix-lanes, or weight the sources up")
        steps_at = steps_counter(lambda e: mix_plan(mix, cfg, lanes, batch, e).steps)
    else:
        plan0 = plan_epoch(source.sizes, seed=cfg.seed, epoch=0, world_size=world, workers=layout.workers,
                           micro_batch=batch.micro_batch, accum=batch.accum)
        steps_at = epoch_counter(source.sizes, cfg.seed, world, layout.workers, batch)
    if plan0.steps == 0:
        raise UserError(f"the shard set holds {source.manifest.total_samples} samples in {len(source.sizes)} "
                        f"shards, not enough for one optimizer step of {batch.global_batch} samples with "
                        f"{world} rank(s) x {layout.workers} reader(s) each; lower --global-batch-size or "
                        "--num-workers")
    total = cfg.max_steps
    if cfg.epochs is not None:
        by_epochs = steps_at(cfg.epochs)  # train.partition.total_steps, counted once for the schedule too
        total = by_epochs if total is None else min(total, by_epochs)
    assert total is not None  # resolve_defaults gives every run a length
    mode, held = sha256_mode(cfg, source, plan0, world, mix)
    _, _, mc = param_counts(kw)
    teacher = check_repa(cfg, has_pixels=source.manifest.has_pixels, where=str(source.folder or cfg.manifest),
                         depth=num_blocks(mc), grid=mc["input_size"] // mc["patch_size"], manifest=source.manifest)
    schedule = build_schedule(cfg, steps_at, total)
    std = first_samples_std(source.folder, source.manifest) if source.folder is not None and dist.is_main() else None
    # --init: read and matched on the CPU, also in a dry run; not read when the run folder resumes its checkpoint
    init = load_init(cfg.init, kw) if cfg.init and not _resumes(cfg) else None
    text = read_text(cfg, source, mix) if kw.get("conditioning") == "text" else None
    if cfg.val_shards is not None:
        check_val_set(cfg, mix if mix is not None else source)
    prep = Preflight(cfg, world, batch, source, kw, layout, plan0, total, notes, mode, held, teacher, schedule, std,
                     init, text, read_reg_tokens(cfg, source.manifest), parallel, mix=mix, lanes=lanes)
    prep.unfit = memory_fit(prep)[1]
    if prep.unfit and not cfg.dry_run:  # before any process group starts; a dry run prints its plan first
        raise UserError(prep.unfit)
    return prep


def _store_text(m: Any, spec: LatentSpec) -> str:
    """"store posterior", and what the run trains on where it is not what the store says."""
    if m.store == "posterior" and not spec.draws:
        return "store posterior (trained on its mean: --latent-sample mean)"
    if (m.extraction or {}).get("store") == "mode":
        return "store mode (the VAE posterior's mean)"
    return f"store {m.store}"


def epoch_counter(sizes: list[int], seed: int, world: int, workers: int, batch: BatchPlan) -> Callable[[float], int]:
    """steps_at(e): the optimizer steps before epoch e of this run (a fractional e adds that share of epoch
    floor(e)'s steps, rounded down), from the epoch plans (train.partition.plan_epoch), each counted once."""
    cum = [0]

    def upto(n: int) -> None:
        while len(cum) <= n:
            cum.append(cum[-1] + plan_epoch(sizes, seed=seed, epoch=len(cum) - 1, world_size=world, workers=workers,
                                            micro_batch=batch.micro_batch, accum=batch.accum).steps)

    def steps_at(e: float) -> int:
        full = int(e)
        upto(full + (1 if e > full else 0))
        return cum[full] + (int((e - full) * (cum[full + 1] - cum[full])) if e > full else 0)

    return steps_at


def resolve_auto_micro_batch(cfg: TrainConfig, kw: dict[str, Any], world: int,
                             parallel: Parallel | None = None) -> int | None:
    """`--micro-batch-size auto`: the largest micro-batch whose memory estimate fits the visible GPU (None,
    i.e. the whole per-rank batch, when no GPU is visible: host memory is not what limits a CPU run)."""
    if cfg.global_batch_size % world:
        return None  # batch_plan explains the problem
    if not torch.cuda.is_available():
        return None
    capacity = torch.cuda.get_device_properties(0).total_memory / GiB
    precision = resolve_precision(cfg.precision, torch.device("cuda", 0))
    total, trainable, mc = param_counts(kw)
    compiled = compile_enabled(cfg.compile, torch.device("cuda", 0))

    mode = parallel.mode.name if parallel is not None else "ddp"
    shards = shard_count(mode, parallel.shape) if parallel is not None else 1
    blocks = block_params(kw) if MODE[mode].sharded else []

    def fits(m: int) -> bool:
        return memory.estimate(mc, total, trainable, m, precision, grad_ckpt=cfg.grad_checkpointing,
                               compile=compiled, mode=mode, shards=shards,
                               block_params=blocks).total <= memory.FIT_FRACTION * capacity

    return memory.auto_micro_batch(cfg.global_batch_size // world, fits)


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


# ----------------------------------------------------------------------------------------------------------
# Estimates for --dry-run

def num_blocks(mc: dict[str, Any]) -> int:
    """The transformer blocks of a model_config's model (what --repa-depth and checkpointing count)."""
    from dit_pipeline.dit.family import model_from_config

    with torch.device("meta"):
        return model_from_config({**mc, "model": None}).num_blocks


def param_counts(kw: dict[str, Any]) -> tuple[int, int, dict[str, Any]]:
    """(all parameters, trainable parameters, model_config) of the model, built on the meta device."""
    total, trainable, mc, _ = param_shapes(kw)
    return total, trainable, mc


def param_shapes(kw: dict[str, Any]) -> tuple[int, int, dict[str, Any], list[tuple[int, ...]]]:
    """param_counts and the trainable tensors' shapes (what --optimizer muon splits), on the meta device."""
    from dit_pipeline.dit.family import create_model

    with torch.device("meta"):
        model = create_model(**kw)
    total = sum(p.numel() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    return total, sum(p.numel() for p in trainable), model.config, [tuple(p.shape) for p in trainable]


def block_params(kw: dict[str, Any]) -> list[int]:
    """The parameters of each of the model's blocks (the family's `blocks`: what FSDP2 shards and gathers one by
    one), on the meta device."""
    from dit_pipeline.dit.family import create_model

    with torch.device("meta"):
        model = create_model(**kw)
    return [sum(p.numel() for p in block.parameters()) for block in model.blocks]


def model_facts(prep: Preflight) -> memory.ModelFacts:
    total, trainable, mc, shapes = param_shapes(prep.model_kwargs)
    muon = sum(int(torch.Size(s).numel()) for s in shapes if len(s) == 2) if prep.cfg.optimizer == "muon" else 0
    return memory.ModelFacts(mc, total, trainable, block_params(prep.model_kwargs), muon)


def _parallel(prep: Preflight) -> Parallel:
    return prep.parallel if prep.parallel is not None else Parallel("ddp")


def memory_estimate(prep: Preflight) -> memory.MemoryEstimate:
    """Rank 0's GPU memory for this plan, at the precision and compile setting a GPU run would use."""
    facts, par = model_facts(prep), _parallel(prep)
    precision = resolve_precision(prep.cfg.precision, torch.device("cuda"))
    return memory.estimate(facts.model_config, facts.n_params, facts.n_trainable, prep.batch.micro_batch, precision,
                           grad_ckpt=prep.cfg.grad_checkpointing,
                           compile=compile_enabled(prep.cfg.compile, torch.device("cuda")),
                           muon_params=facts.muon_params, mode=par.mode.name, shards=shard_count(par.mode.name, par.shape),
                           block_params=facts.block_params)


def gpu_capacity(cfg: TrainConfig) -> tuple[float | None, str]:
    """(GiB per GPU to plan for, where it comes from): --gpu-memory, else the visible GPU's, else (None, "")."""
    if cfg.gpu_memory is not None:
        return parse_gib(cfg.gpu_memory), f"--gpu-memory {cfg.gpu_memory}"
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GiB, torch.cuda.get_device_name(0)
    return None, ""


def mode_shards(prep: Preflight) -> dict[str, int]:
    """Every --parallel mode at this world size -> the ranks it shards over (HSDP: its shard group; the run's own
    when it is hsdp, else the ranks of one node)."""
    par, world = _parallel(prep), prep.world_size
    local = dist.local_world_size() if dist.launched() else world
    hsdp = par.shape[-1] if par.mode.hybrid else max(1, local if world % max(1, local) == 0 else 1)
    return {m.name: (hsdp if m.hybrid else world) if m.sharded else 1 for m in MODE.values()}


def memory_fit(prep: Preflight) -> tuple[list[str], str | None]:
    """(the plan's lines on which mode and micro-batch fit the GPU memory, why this run does not fit or None)."""
    capacity, source = gpu_capacity(prep.cfg)
    if capacity is None:
        return [], None
    cfg, par = prep.cfg, _parallel(prep)
    facts, precision = model_facts(prep), resolve_precision(cfg.precision, torch.device("cuda"))
    compiled = compile_enabled(cfg.compile, torch.device("cuda"))
    per_rank, shards = prep.batch.per_rank, mode_shards(prep)
    best = {(m, ckpt): memory.largest_micro(facts, per_rank, precision, compiled, m, n, ckpt, capacity)
            for m, n in shards.items() for ckpt in (False, True)}
    said = "; ".join(f"{m} {'up to micro-batch ' + str(best[m, False]) if best[m, False] else 'no micro-batch'}"
                     + (f" ({best[m, True]} with --grad-checkpointing)" if best[m, True] != best[m, False]
                        and not cfg.grad_checkpointing else "") for m in shards)
    lines = [f"  fits        {capacity:.1f} GiB per GPU ({source}), per-rank batch {per_rank}: {said}"]
    mine = memory_estimate(prep)
    if mine.total <= capacity:
        return lines, None
    ok = [(m, best[m, cfg.grad_checkpointing]) for m in LEAST_TRAFFIC_FIRST if best[m, cfg.grad_checkpointing]]
    ok_ckpt = [(m, best[m, True]) for m in LEAST_TRAFFIC_FIRST if best[m, True]]
    if ok:
        fix = f"--parallel {ok[0][0]} fits at micro-batch {ok[0][1]} (--micro-batch-size {ok[0][1]})"
    elif ok_ckpt:
        fix = f"--parallel {ok_ckpt[0][0]} --grad-checkpointing fits at micro-batch {ok_ckpt[0][1]}"
    else:
        fix = "no mode fits at this world size: add ranks (the sharded modes divide the model state by them)"
    why = (f"the memory estimate of this run ({par.mode.name}, micro-batch {prep.batch.micro_batch}, grad "
           f"checkpointing {'on' if cfg.grad_checkpointing else 'off'}) is {mine.total:.1f} GiB per GPU, more than the "
           f"{capacity:.1f} GiB of {source}; {fix}. --dry-run prints the table (an analytic estimate: pass a larger "
           "--gpu-memory to run anyway)")
    return lines, why



def host_memory_available() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GiB
    except OSError:
        pass
    return None


def grids_line(prep: Preflight) -> list[str]:
    """The plan's line on the sample grids (none without --sample-every), with a note for short EMA runs."""
    cfg = prep.cfg
    if not cfg.sample_every:
        return []
    line = f"  grids       every {cfg.sample_every} steps, {cfg.sample_weights} weights"
    horizon = 1.0 / max(1.0 - cfg.ema_decay, 1e-12)
    if cfg.sample_weights == "ema" and prep.total_steps and prep.total_steps < EMA_SHORT_RUN * horizon:
        line += (f"; the EMA (decay {cfg.ema_decay:g}) averages over ~{horizon:,.0f} steps and this run has "
                 f"{prep.total_steps:,}, so its grids show barely trained weights: --sample-weights both adds "
                 "grids of the raw weights")
    return [line]


def objective_line(cfg: TrainConfig, mc: dict[str, Any] | None = None) -> str:
    """The plan's line on what the model learns: DiT's diffusion loss or the flow objective, and the block
    options beyond DiT's (those of the model_config `mc` when given: another family's are its own)."""
    if cfg.objective == "flow":
        times = ("uniform" if cfg.t_sampling == "uniform"
                 else f"{cfg.t_sampling} (mean {cfg.t_mean:g}, scale {cfg.t_scale:g})")
        implied = f"as --model {cfg.model} implies; " if implied_objective(cfg.model) == "flow" else ""
        shift = (f", shifted by {cfg.time_shift:.4g} {shift_direction(float(cfg.time_shift))}"
                 if cfg.time_shift != 1.0 else "")
        loss = "; loss mse + cos (cosine direction)" if cfg.cosine_loss else ""
        pred = (f"x-prediction, v = (x_pred - x_t) / max(1 - t, {cfg.t_eps:g})" if cfg.prediction == "x" else
                f"velocity prediction, target (x - x_t) / max(1 - t, {cfg.t_eps:g})" if cfg.v_target == "clamped" else
                "velocity prediction")
        what = f"flow ({implied}linear interpolant, {pred}; training times {times}{shift}{loss})"
    elif cfg.objective in MEANFLOW_OBJECTIVES:
        from dit_pipeline.dit.meanflow import DATA_PROPORTION

        prop = cfg.mf_data_proportion if cfg.mf_data_proportion is not None else DATA_PROPORTION[cfg.objective]
        guide = (f"guidance omega {cfg.mf_omega:g}, kappa {cfg.mf_kappa:g} for t in [{cfg.mf_t_start:g}, "
                 f"{cfg.mf_t_end:g}]" if (cfg.mf_omega, cfg.mf_kappa) != (1.0, 0.0) else "no training guidance") \
            if cfg.objective == "meanflow" else f"omega drawn on [1, {1 + cfg.mf_s_max:g}] and fed to the network"
        heads = {"imf": "; the u and v heads' loss terms (the release's iMF)",
                 "imf-adaln": "; this project's iMF variant: conditions added to the time embedding, v read from u "
                              "at h = 0, labels dropped per sample"}.get(cfg.objective, "")
        split = (f"r = t for {prop:.0%} of each step" if cfg.mf_rule == "meanflow" else
                 f"with probability {prop:g} the whole step (every rank) is flow matching, one draw of t and r = t "
                 "(--mf-rule nanogen: NanoGen's TransportMF, labels dropped per sample)")
        target = (f"; velocity (z_t - x) / max(t, {cfg.t_eps:g})" if cfg.objective == "meanflow"
                  and cfg.v_target == "clamped" else "")
        what = (f"{cfg.objective} (average velocity u(z, t, h = t - r); t, r logit-normal({cfg.mf_t_mean:g}, "
                f"{cfg.mf_t_scale:g}), {split}{target}; {guide}{heads}; JVP through "
                f"{cfg.jvp_attention} attention; adaptive weight p {cfg.mf_norm_p:g})")
    else:
        what = "ddpm (DiT: noise prediction + learned variance, 1000-step linear schedule)"
    family = (mc or {}).get("family")
    extras = [name for name in MODEL_OPTIONS if ((mc or {}).get(name) if mc is not None else getattr(cfg, name))]
    listed = ", ".join(e.replace("_", "-") for e in extras)
    blocks = (f"{family}'s" + (f" ({listed})" if listed else "")) if family else (listed or "as in DiT")
    return f"  objective   {what}; blocks {blocks}"


def condition_line(prep: Preflight, mc: dict[str, Any]) -> str:
    """The plan's line on what the model is conditioned on (dit/conditioning.py) and its dropout."""
    from dit_pipeline.dit.conditioning import conditioning_of

    cond, p = conditioning_of(mc), prep.cfg.class_dropout_prob
    line = f"  condition   {cond.describe()}" + (f"; dropout {p:g} to {cond.describe_null()}" if p > 0 else "")
    if prep.text is not None:
        line += (f"; text encoder {prep.text.identity.get('name')} ({prep.cfg.text_features} features, up to "
                 f"{prep.text.max_length} tokens)")
    return line


def integrity_line(prep: Preflight) -> str:
    """The plan's line on the shards' sha256 check (train.preflight.sha256_mode)."""
    held = f"{prep.sha256_bytes / GiB:.2f} GiB of whole shards per node"
    return "  integrity   " + {
        None: "sha256 check of the shards off (--no-verify-shards)",
        "whole": f"each shard's sha256 checked against the manifest before its samples are used ({held})",
        "stream": (f"each shard's sha256 checked against the manifest as it streams, so a mismatch is found at "
                   f"the shard's end (hashing whole shards first would hold {held}, more than a quarter of the "
                   "available memory)")}[prep.sha256]


def format_plan(prep: Preflight, start_line: str | None = None, *, dry_run: bool = True) -> str:
    """The plan `--dry-run` prints and the real run logs; `start_line`: where the run starts
    (train.resume.start_line), else "from scratch"."""
    cfg, b, m, p0 = prep.cfg, prep.batch, prep.source.manifest, prep.plan0
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    precision = resolve_precision(cfg.precision, device)
    total, trainable, mc, shapes = param_shapes(prep.model_kwargs)
    c, h, w = m.latent_shape
    shards_per = [len(s) for s in p0.lanes] if prep.mix is not None else [len(s) for s in p0.slot_shards]
    mem = memory_estimate(prep)
    parts = " + ".join(f"{k} {v:.2f}" for k, v in mem.parts.items())
    par = _parallel(prep)
    facts = model_facts(prep)
    rows = memory.fits(facts, b.micro_batch, resolve_precision(cfg.precision, torch.device("cuda")),
                       compile_enabled(cfg.compile, torch.device("cuda")), mode_shards(prep))
    fit_lines, _ = memory_fit(prep)
    compiled = compile_enabled(cfg.compile, device)
    local = local_ranks(prep.world_size)
    # Each reader buffers one view of each sample as stored (mean + std, the mean alone, or the latent), keeps two
    # scratch batches (the stacked stored values and their float32 copy) and its float32 output slots (train.pool:
    # prefetch + 2 + its share of one step's micro-batches).
    spec = LatentSpec.from_manifest(m, cfg.latent_sample)
    arrays, itemsize = max(spec.arrays, 1), (4 if m.dtype == "float32" else 2)
    pending_bytes = arrays * c * h * w * itemsize
    slots = cfg.prefetch_factor + 2 + math.ceil(b.accum / prep.layout.workers)
    batch_bytes = b.micro_batch * c * h * w * (arrays * (itemsize + 4) + 4 * slots)
    host = local * prep.layout.workers * (cfg.shuffle_buffer * pending_bytes + batch_bytes)
    gpu = (f" of {torch.cuda.get_device_properties(0).total_memory / GiB:.1f} GiB on "
           f"{torch.cuda.get_device_name(0)}" if device.type == "cuda" else " (no GPU visible here)")
    avail = host_memory_available()
    length = [f"max_steps {cfg.max_steps}"] if cfg.max_steps else []
    length += [f"epochs {cfg.epochs}"] if cfg.epochs else []
    lines = [
        "dit-train plan (dry run: nothing was started)" if dry_run else "dit-train plan",
        *recipe_line(cfg.recipe),
        *([f"  shards      {cfg.shards}: {len(m.shards)} shards, {m.total_samples:,} samples, {_store_text(m, spec)}, "
           f"{m.views} view(s), latents {c}x{h}x{w} {m.dtype}, {_scale_text(m)}, {m.num_classes} classes"]
          if prep.mix is None else [f"  latents     {c}x{h}x{w} ({_scale_text(m)}), the space of every source"]),
        *normalization_line(m),
        *latent_std_line(prep),
        *init_line(prep.init),
        f"  model       {mc['model'] or 'custom'} ({describe_model(mc)}): {total / 1e6:.2f}M parameters, input "
        f"{mc['input_size']} ({tokens_text(mc)})",
        condition_line(prep, mc),
        objective_line(cfg, mc) + (f"\n              ({prep.notes['time_shift']})" if "time_shift" in prep.notes else ""),
        optimizer_line(cfg, shapes),
        f"  precision   {precision}, tf32 {'on' if cfg.tf32 else 'off'}, grad checkpointing "
        f"{'on' if cfg.grad_checkpointing else 'off'}, compile {'on (per block)' if compiled else 'off'}, "
        f"attention {cfg.attention if device.type == 'cuda' else 'default (CPU)'}",
        f"  {dist.launch_info().describe()}",
        f"  batch       global {b.global_batch} = {prep.world_size} rank(s) x micro-batch {b.micro_batch} x "
        f"{b.accum} accumulation step(s)"
        + (" (--micro-batch-size auto: the largest that fits the GPU memory estimate)"
           if cfg.micro_batch_size == "auto" and device.type == "cuda" else
           " (--micro-batch-size auto: no GPU visible, no accumulation)" if cfg.micro_batch_size == "auto" else ""),
        *(mix_lines(prep) if prep.mix is not None else [
            f"  epoch 0     {p0.steps:,} optimizer steps; {p0.samples_used:,} of {p0.samples_total:,} samples used "
            f"({p0.samples_total - p0.samples_used:,} left out so every rank runs the same number of steps)",
            f"  readers     {prep.world_size} rank(s) x {prep.layout.workers} loader worker(s) = {len(shards_per)}; "
            f"shards per reader {min(shards_per)}-{max(shards_per)}, up to {cfg.shards_in_flight} read at once; "
            f"shuffle buffer {cfg.shuffle_buffer} samples each"
            + (f"\n              ({prep.notes['readers']})" if "readers" in prep.notes else "")]),
        *val_line(cfg),
        f"  length      {', '.join(length)} -> {prep.total_steps:,} steps "
        f"(~{prep.total_steps / max(p0.steps, 1):.2f} epochs)"
        + (f"\n              ({prep.notes['length']})" if "length" in prep.notes else ""),
        *([schedule_line(prep.schedule)] if prep.schedule else []),
        f"  parallel    {par.describe()}",
        f"  GPU memory  ({mem.source}, {'per rank' if par.sharded else 'rank 0'}) {parts} = {mem.total:.2f} GiB{gpu}",
        *memory.table_lines(rows, b.micro_batch, prep.world_size, par.mode.name),
        *fit_lines,
        f"  host memory (estimate, per node) {local} rank(s) x {prep.layout.workers} worker(s) x shuffle buffers = "
        f"{host / GiB:.2f} GiB{f' of {avail:.1f} GiB available' if avail is not None else ''}",
        integrity_line(prep),
        *repa_line(cfg, prep.teacher, num_blocks(mc), dit_train_flops(mc)),
        *([prep.reg.line(cfg.reg_coeff)] if prep.reg is not None else []),
        *([f"  guidance    internal guidance's base head after encoder block {cfg.base_model_depth}: loss + "
           f"{cfg.base_model_coeff:g} x base (dit-sample --ig-scale)"] if cfg.base_model_depth else []),
        *grids_line(prep),
        start_line or f"  run dir     {cfg.run_dir}: {'would start' if dry_run else 'starts'} from scratch",
    ]
    return "\n".join(lines)


def _scale_text(m: Manifest) -> str:
    """The shards line's latent scale: the scalar factors as always, or "normalized per channel"."""
    if m.norm.is_per_channel:
        return "normalized per channel"
    return f"scaling {m.scaling_factor:g}{f', shift {m.shift_factor:g}' if m.shift_factor else ''}"


def normalization_line(m: Manifest) -> list[str]:
    """The plan's line on a per-channel normalization and a revised manifest (none for an unrevised scalar
    set, whose factors the shards line shows): never silently trained on."""
    if not m.norm.is_per_channel and m.revision is None:
        return []
    revised = (f" (manifest revision {m.revision['number']}, by {m.revision['by']})" if m.revision else "")
    return [f"  latents     {m.norm.describe()}{revised}"]


def _resumes(cfg: TrainConfig) -> bool:
    """Whether the run folder holds a checkpoint that `--resume auto` continues (train/resume.py decides it)."""
    from dit_pipeline.train.checkpoint import CheckpointManager

    folder = Path(cfg.run_dir).expanduser() / "checkpoints"
    return cfg.resume == "auto" and CheckpointManager(folder).latest() is not None


def latent_std_line(prep: Preflight) -> list[str]:
    """One line when the latents it trains on are far from unit std (DiT's noise schedule assumes ~1), with the
    command that normalizes them; none otherwise."""
    if prep.latent_std is None or abs(prep.latent_std[0] - 1.0) <= NEAR_ONE:
        return []
    std, used, shard = prep.latent_std
    return [f"  latents     std {std:.3g} over the first {used} samples of {shard}: NOT near 1 (DiT assumes ~1); "
            f"{fix_hint(str(prep.source.folder or prep.cfg.shards))}"]


def describe_model(mc: dict[str, Any]) -> str:
    """The architecture in words (its family's `describe`): depth, widths, heads, patch."""
    from dit_pipeline.dit.family import family_of_config

    return family_of_config(mc).describe(mc)


def tokens_text(mc: dict[str, Any]) -> str:
    """Tokens per image: (latent side / patch)^2, the DiT's sequence length."""
    g = mc["input_size"] // mc["patch_size"]
    return f"{mc['input_size']}x{mc['input_size']} latents / patch {mc['patch_size']} = {g * g} tokens per image"


def dit_train_flops(mc: dict[str, Any]) -> float:
    """Model FLOPs of one training step per image (dit.train_flops_per_image)."""
    from dit_pipeline import dit

    return float(dit.train_flops_per_image(mc))
