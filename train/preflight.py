"""Everything decided before a process touches a GPU: shard set, model shape vs latents, batch arithmetic,
data layout, run length, schedule, teacher and text sets, checked without a GPU or a process group (`prepare`).

Whether the run fits its GPUs (per-GPU memory per --parallel mode, `--micro-batch-size auto`, the loaders' host
memory) is train/fit.py's; the plan printed from a `Preflight` (and alone by `--dry-run`) is train/plan.py's.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, cast

import torch

from dit_pipeline.common import distributed as dist
from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import check_writable_dir
from dit_pipeline.common.teacher import Teacher
from dit_pipeline.shards import Manifest
from dit_pipeline.shards.stats import first_samples_std
from dit_pipeline.train.batch import BatchPlan, batch_plan
from dit_pipeline.train.config import DEFAULT_MAX_STEPS, DEFAULT_NUM_WORKERS, TrainConfig, resolve_time_shift
from dit_pipeline.train.fit import host_memory_available, memory_fit, num_blocks, param_counts, resolve_auto_micro_batch
from dit_pipeline.train.shard_source import ShardSource, open_shards
from dit_pipeline.train.init import InitWeights, load_init
from dit_pipeline.train.latents import latent_sample_problem
from dit_pipeline.train.mix import mix_spec, open_mix
from dit_pipeline.train.mixprep import check_val_set, mix_plan, resolve_lanes, steps_counter
from dit_pipeline.train.model_options import ARCH_OVERRIDES, MODEL_OPTIONS
from dit_pipeline.train.partition import DataLayout, plan_epoch
from dit_pipeline.train.parallel import Parallel, mesh_shape
from dit_pipeline.train.recipes import check_recipe_extraction
from dit_pipeline.train.reg import RegTokens, read_reg_tokens
from dit_pipeline.train.repa import MIX_CACHED, CachedTeacher, check_repa
from dit_pipeline.train.schedule import LrSchedule, build_schedule
from dit_pipeline.train.text import TextSet, open_text_set

GiB = float(2**30)


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
    reg = run_reg_tokens(cfg, source, mix)  # REG's class token width (train/reg.py)
    kw = arch_kwargs(cfg, m, read_text(cfg, source, mix), None if reg is None else reg.dim)
    try:
        with torch.device("meta"):
            create_model(**kw)
    except (ValueError, TypeError) as e:
        raise UserError(f"--model {cfg.model} cannot be built for the shard set in {where} ({c}x{h}x{w} "
                        f"latents, {m.num_classes} classes): {e}") from None
    return kw


def run_reg_tokens(cfg: TrainConfig, source: ShardSource, mix: Any = None) -> RegTokens | None:
    """--use-reg's class tokens: --reg-tokens of one shard set, or a mix's (its sources' reg=, one encoder: the
    first source's stand for all); None without REG."""
    if mix is not None:
        return cast(RegTokens | None, mix.reg)
    return read_reg_tokens(cfg, source.manifest)


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
    if kind != "text" and cfg.sample_prompts:
        raise UserError(f"--sample-prompts: prompts draw a text run's grids; this run is conditioned on {kind} "
                        f"{'labels (--sample-classes picks the classes)' if kind == 'class' else '(nothing)'}")
    if kind != "text" and cfg.fid_prompts:
        raise UserError(f"--fid-prompts: prompts draw a text run's FID samples; this run is conditioned on {kind} "
                        f"{'labels (--fid-labels picks how the classes are drawn)' if kind == 'class' else '(nothing)'}")
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
    if kind == "text" and cfg.sample_every and not cfg.sample_prompts:
        problems.append("its sample grids draw prompts: pass --sample-prompts FILE (one prompt per line)")
    if kind == "text" and cfg.sample_classes:
        problems.append("--sample-classes picks a class run's grids; a text run's draw --sample-prompts")
    if kind == "text" and cfg.fid_every:
        problems += fid_prompt_problems(cfg)
    if kind != "text" and (cfg.fid_every or cfg.sample_every):
        problems.append("the periodic grids and FID (--sample-every, --fid-every) sample class labels; sample this "
                        "model's checkpoints with dit-sample")
    if problems:
        raise UserError(f"--conditioning {kind}: " + "; ".join(problems))
    return out


def fid_prompt_problems(cfg: TrainConfig) -> list[str]:
    """A text run's FID samples draw prompts (evaluate.hook.fid_prompts_file: --fid-prompts, else the captioned
    reference's): they must exist, read, and divide --fid-num-samples (dit-sample --prompts' rule); --fid-labels,
    which draws classes, does nothing there."""
    from dit_pipeline.common.prompts import read_prompts
    from dit_pipeline.evaluate.hook import fid_prompts_file

    problems = ["--fid-labels picks a class run's FID classes; a text run's FID samples draw prompts (drop it)"] \
        if cfg.fid_labels is not None else []
    path = fid_prompts_file(cfg)
    if path is None:
        return problems + ["FID during training (--fid-every) of a text run draws prompts: pass --fid-prompts FILE, "
                           "or a captioned --fid-ref (dit-eval --make-ref FOLDER --captions FILE writes "
                           "REF.prompts.jsonl beside REF.npz)"]
    try:
        count = len(read_prompts(path, "--fid-prompts"))
    except UserError as e:
        return problems + [str(e)]
    if isinstance(cfg.fid_num_samples, int) and cfg.fid_num_samples % count:
        problems.append(f"--fid-num-samples {cfg.fid_num_samples} is not a multiple of the {count} prompts of {path} "
                        "(each prompt gets the same number of samples, as dit-sample --prompts gives them)")
    return problems


def lookup_family(model: str) -> Any:
    from dit_pipeline.dit.family import lookup_preset

    return lookup_preset(model)[0]


def prepare(cfg: TrainConfig, world_size: int | None = None) -> Preflight:
    """Validate everything that can be checked without a GPU or a process group (raises on problems)."""
    cfg.validate()
    check_writable_dir(cfg.run_dir, f"--run-dir {cfg.run_dir}")  # before any work, also in a dry run
    world = dist.world_size() if world_size is None else world_size
    spec = mix_spec(cfg.source, cfg.mix, cfg.mix_epoch_size, cfg.mix_lanes)
    mix = open_mix(spec, text_features=cfg.text_features, use_reg=bool(cfg.use_reg),
                   repa_cached=cfg.repa == MIX_CACHED) if spec is not None else None
    source = mix.primary if mix is not None else open_shards(str(cfg.shards), cfg.manifest)
    if problem := latent_sample_problem(source.manifest, cfg.latent_sample):
        raise UserError(f"{source.folder or cfg.manifest}: {problem}")
    cfg = check_recipe_extraction(cfg, source, mix)
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
    has_pixels, where = source.manifest.has_pixels, str(source.folder or cfg.manifest)  # REPA's online teacher's
    if mix is not None and (bare := [o for o in mix.sources if not o.manifest.has_pixels]):
        has_pixels, where = False, f"source {bare[0].name} ({bare[0].spec.shards})"
    teacher = check_repa(cfg, has_pixels=has_pixels, where=where, depth=num_blocks(mc),
                         grid=mc["input_size"] // mc["patch_size"], manifest=source.manifest, mix=mix)
    schedule = build_schedule(cfg, steps_at, total)
    std = first_samples_std(source.folder, source.manifest) if source.folder is not None and dist.is_main() else None
    # --init: read and matched on the CPU, also in a dry run; not read when the run folder resumes its checkpoint
    init = load_init(cfg.init, kw) if cfg.init and not _resumes(cfg) else None
    text = read_text(cfg, source, mix) if kw.get("conditioning") == "text" else None
    if cfg.val_shards is not None:
        check_val_set(cfg, mix if mix is not None else source)
    prep = Preflight(cfg, world, batch, source, kw, layout, plan0, total, notes, mode, held, teacher, schedule, std,
                     init, text, run_reg_tokens(cfg, source, mix), parallel, mix=mix, lanes=lanes)
    prep.unfit = memory_fit(prep)[1]
    if prep.unfit and not cfg.dry_run:  # before any process group starts; a dry run prints its plan first
        raise UserError(prep.unfit)
    return prep


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


def _resumes(cfg: TrainConfig) -> bool:
    """Whether the run folder holds a checkpoint that `--resume auto` continues (train/resume.py decides it)."""
    from dit_pipeline.train.checkpoint import CheckpointManager

    folder = Path(cfg.run_dir).expanduser() / "checkpoints"
    return cfg.resume == "auto" and CheckpointManager(folder).latest() is not None


