"""What a run with a data mix (train/mix.py) or a validation set (train/validation.py) decides before any GPU
work, for train.preflight: the mix's lanes and epoch plans, its steps per epoch, the held-out set's latent space,
and the plan's lines on both."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from dit_pipeline.common.errors import UserError


def mix_plan(mix: Any, cfg: Any, lanes: int, batch: Any, epoch: int) -> Any:
    """Epoch `epoch`'s plan of the mix (train.mixplan.plan_mix_epoch), no shard skipped yet."""
    from dit_pipeline.train.mixplan import plan_mix_epoch

    return plan_mix_epoch(mix.shapes(), seed=cfg.seed, epoch=epoch, lanes=lanes, global_batch=batch.global_batch,
                          epoch_size=mix.spec.epoch_size)


def resolve_lanes(cfg: Any, world: int, workers: int, batch: Any) -> int:
    """The mix's lanes: --mix-lanes, else those of the run being resumed (its config.json), else world size x
    loader workers (train.mixplan.default_lanes); UserError when this world size cannot share them."""
    import json

    from dit_pipeline.train.checkpoint import CheckpointManager
    from dit_pipeline.train.mixplan import default_lanes, lanes_problem

    run = Path(cfg.run_dir).expanduser()
    lanes = cfg.mix_lanes
    if lanes is None and cfg.resume == "auto" and CheckpointManager(run / "checkpoints").latest() is not None:
        try:
            saved = json.loads((run / "config.json").read_text(encoding="utf-8"))
            lanes = int((saved.get("data_mix") or {}).get("lanes") or 0) or None
        except (OSError, ValueError, TypeError):
            lanes = None
    if lanes is None:
        lanes = default_lanes(world, workers, batch.global_batch)
    problem = lanes_problem(lanes, world, batch.global_batch)
    if problem:
        raise UserError(problem + ("" if cfg.mix_lanes is None else " (or another --mix-lanes for a new run)"))
    return lanes


def check_val_set(cfg: Any, data: Any) -> None:
    """--val-shards: a held-out set in the training data's latent space (train.mix.space_problem), before any work."""
    from dit_pipeline.train.mix import HOLDOUT, MixSpec, OpenSource, SourceSpec, _named, parse_source, space_problem

    if cfg.val_shards == HOLDOUT:
        return  # the mix's own sources, checked when it was opened
    spec = _named([parse_source(str(cfg.val_shards))])[0]
    val = open_val_sources(MixSpec((spec,)), cfg).sources[0]
    train = data.sources[0] if hasattr(data, "sources") else \
        OpenSource(_named([SourceSpec(str(data.folder or cfg.shards))])[0], data)
    problem = space_problem(train, val)
    if problem:
        raise UserError(f"--val-shards: {problem}")
    if val.reg is not None:  # REG: the held-out samples' class tokens from the training tokens' encoder
        from dit_pipeline.train.mix import check_token_space
        from dit_pipeline.train.reg import read_reg_tokens

        tokens = data.reg if hasattr(data, "sources") else read_reg_tokens(cfg, data.manifest)
        try:
            check_token_space([(train.name, train.spec.reg or cfg.reg_tokens, tokens), (val.name, spec.reg, val.reg)])
        except UserError as e:
            raise UserError(f"--val-shards: {e}") from None


def open_val_sources(spec: Any, cfg: Any) -> Any:
    """--val-shards' sources (train.mix.MixSpec) opened as a mix's are: each with its text set, and under --use-reg
    its class tokens (reg=); REPA's tokens (repa=) refused, the validation loss reading none; a problem is named as
    --val-shards'."""
    from dit_pipeline.train.mix import open_mix

    if named := [s.name for s in spec.sources if s.repa is not None]:
        raise UserError(f"--val-shards: source {named[0]} names REPA's teacher tokens (repa=), which the validation "
                        "loss never reads (it is the denoising loss alone, REPA or not): drop repa=")
    try:
        return open_mix(spec, text_features=cfg.text_features, use_reg=bool(cfg.use_reg))
    except UserError as e:
        raise UserError(f"--val-shards: {e}") from None


def steps_counter(steps_in: Callable[[int], int]) -> Callable[[float], int]:
    """steps_at(e) of `epoch_counter` from any epoch -> steps function (a mix's plans)."""
    cum = [0]

    def steps_at(e: float) -> int:
        full = int(e)
        while len(cum) <= full + (1 if e > full else 0):
            cum.append(cum[-1] + steps_in(len(cum) - 1))
        return cum[full] + (int((e - full) * (cum[full + 1] - cum[full])) if e > full else 0)

    return steps_at


def mix_lines(prep: Any) -> list[str]:
    """The plan's lines on a data mix (train.mixdata.MixFeed.plan_lines, rank 0's lanes)."""
    from dit_pipeline.train.feeds import make_feed

    feed = make_feed(prep, rank=0)
    return [*feed.plan_lines(prep.plan0), f"  readers     each lane reads up to {prep.cfg.shards_in_flight} visits at "
            f"once through a shuffle buffer of {prep.cfg.shuffle_buffer} samples"]


def val_line(cfg: Any) -> list[str]:
    """The plan's line on the validation loss (train/validation.py)."""
    if cfg.val_shards is None:
        return []
    return [f"  validation  every {cfg.val_every} steps (and at step 0): {cfg.val_weights} weights on "
            f"{cfg.val_samples:,} samples of {cfg.val_shards}, {cfg.val_timesteps} fixed noise levels k/"
            f"{cfg.val_timesteps} (MLPerf's FLUX.1 rule), fixed noise, no condition dropout"]
