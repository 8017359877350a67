"""A validation loss at fixed timesteps (`--val-shards`; issue 46, docs/data-mix.md): a periodic hook that measures
the objective's loss of the EMA and the raw weights on a fixed held-out set.

What is fixed, so that a rerun gives the same number bit for bit and runs whose time samplers differ (uniform,
logit-normal, shifted) are compared on the same numbers:
- the samples: the first `--val-samples` of a held-out shard set in key order, or of the keys the mix's sources
  hold out (`holdout=F`, never trained on; an equal share of each such source); each with a fixed view and
  posterior noise, and its first caption (or the source's `caption=`);
- the noise levels: K = `--val-timesteps` (default 8) evenly spaced levels k / K, k = 0..K-1, sample i at level
  i mod K, the mean over each level's samples, then the mean of the K means: MLPerf Training's FLUX.1 reference
  ("Validation loss averaged over 8 equidistant time steps [0, 7/8]", mlcommons/training flux/README.md, section
  5, its pseudocode; the level is the noise fraction, 0 = data; torchtitan's FluxValidator, which the reference
  builds on, takes the bins' midpoints (k + 0.5) / 8 when it evaluates every level per sample: the README's k / K
  is followed here); each objective maps a level to its own time
  (`val_times` of dit/objectives.py's objects: ddpm's step floor(level x 1000), flow's t = 1 - level in SiT's
  time, MeanFlow's t = r = level);
- the diffusion noise: one fixed draw per sample, from (its source, its key) alone;
- the condition: the sample's own, dropout off (the modules in eval mode);
- with REG (--use-reg): the class token of the sample's view (each validation source names its tokens: reg=, as a
  mix's sources do), noised with the sample's time by its own fixed draw; the loss stays the image's error.
The loss is the objective's unweighted error (`val_loss`, dit/objective_base.py: the "mse" term), through the
objective seam, never a per-objective branch here.

Every evaluation runs on rank 0 (which alone holds the EMA), in chunks of `--val-batch-size` samples in a fixed
order, each chunk's loss summed in float64: identical at any world size. Under the sharded modes (--parallel zero2,
fsdp, hsdp) every rank holds a shard of the model and of the EMA, so every rank reads the same set and runs the same
chunks together (each forward gathers its blocks' parameters as the training forward does), and rank 0 writes the
numbers: the same rule, the same chunks, the same value on every rank. It runs at step 0 of a new run and every
`--val-every` steps, and writes to metrics.jsonl `val_loss_<weights>` (the mean), `val_loss_<weights>_t` (the K
per-level means) and `val_run` (what produced them: set, samples, levels, objective times, weights, step; with REG,
each source's class tokens), and one log line.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Sequence, cast

import numpy as np
import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.hooks import HookContext, evaluating
from dit_pipeline.common.log import get_logger
from dit_pipeline.common.settings import choice, positive, setting

VAL = "Validation loss"
VAL_WEIGHTS = ("both", "ema", "raw")
STREAM_VAL = 4646  # derive_seed stream of the validation set's fixed noise (independent of the run's --seed)


@dataclass(kw_only=True)
class ValSettings:
    """The validation loss's settings (module docstring); TrainConfig inherits them."""

    val_shards: str | None = setting(
        None, "Held-out data for a validation loss at fixed timesteps: a shard set, written as a --source ('SHARDS "
        "text=... template=...'), or 'holdout' (the keys the mix's sources hold out with holdout=F)", group=VAL,
        shown="off")
    val_every: int = setting(1000, "Steps between validation passes (and one at step 0 of a new run)", group=VAL)
    val_samples: int = setting(1024, "Validation samples: the first of the held-out set in key order", group=VAL)
    val_timesteps: int = setting(8, "Noise levels k/K, k = 0..K-1, sample i at level i mod K (MLPerf's FLUX.1 "
                                 "reference: 8)", group=VAL)
    val_batch_size: int = setting(32, "Samples per validation forward pass", group=VAL)
    val_weights: str = setting("both", "Weights evaluated: ema, raw or both", group=VAL, choices=VAL_WEIGHTS)

    def val_problems(self, mixed: bool) -> list[str]:
        p = choice(self, "val_weights", VAL_WEIGHTS) + positive(self, "val_every", "val_samples", "val_timesteps",
                                                                 "val_batch_size")
        if (isinstance(self.val_samples, int) and isinstance(self.val_timesteps, int)
                and 0 < self.val_samples < self.val_timesteps):
            p.append(f"--val-samples {self.val_samples} leaves noise levels without a sample: give at least "
                     f"--val-timesteps ({self.val_timesteps}) samples")
        if self.val_shards is None:
            changed = [f.name for f in dataclasses.fields(ValSettings)
                       if f.name != "val_shards" and getattr(self, f.name) != f.default]
            if changed:
                p.append(f"{', '.join('--' + c.replace('_', '-') for c in changed)} set the validation loss: add "
                         "--val-shards (a held-out shard set, or 'holdout')")
        elif self.val_shards == "holdout" and not mixed:
            p.append("--val-shards holdout evaluates the keys a mix's sources hold out: give the sources with "
                     "--source 'SHARDS holdout=0.01' (or --mix), or --val-shards a held-out shard set")
        return p


# ----------------------------------------------------------------------------------------------------------
# The fixed set

@dataclass
class ValSet:
    """The validation samples in memory, in their fixed order."""

    description: str
    latents: torch.Tensor                 # [N, C, h, w] float32, normalized as the training latents
    labels: torch.Tensor                  # [N] int64
    noise: torch.Tensor                   # [N, C, h, w] float32: each sample's fixed diffusion noise
    sources: dict[str, int]               # samples per source
    text: list[torch.Tensor] | None = None  # [L_i, D] float32 per sample: the condition's features
    reg: torch.Tensor | None = None       # [N, z] float32: REG's clean class token of each sample's view
    reg_noise: torch.Tensor | None = None  # [N, z] float32: its fixed noise (noised with the sample's t)
    reg_from: dict[str, str] | None = None  # REG: each source's class tokens folder (recorded in val_run)

    def __len__(self) -> int:
        return int(self.latents.shape[0])


def _val_sources(cfg: Any) -> tuple[list[Any], list[int], str]:
    """(opened sources, samples to take from each, description) of --val-shards."""
    from dit_pipeline.train.mix import HOLDOUT, MixSpec, _named, mix_spec, parse_source
    from dit_pipeline.train.mixprep import open_val_sources

    n = int(cfg.val_samples)
    if cfg.val_shards == HOLDOUT:
        spec = mix_spec(cfg.source, cfg.mix)
        assert spec is not None
        # the training sources' held-out keys; their REPA tokens (repa=) are not read: the loss is the denoising one
        held = [dataclasses.replace(s, repa=None) for s in spec.sources if s.holdout > 0]
        if not held:
            raise UserError("--val-shards holdout: no source of the mix holds keys out; give one holdout=0.01 (say)")
        mix = open_val_sources(MixSpec(tuple(held)), cfg)
        share = [n // len(held) + (1 if i < n % len(held) else 0) for i in range(len(held))]
        return mix.sources, share, "held-out keys of " + ", ".join(f"{s.name} ({s.holdout:g})" for s in held)
    one = _named([parse_source(cfg.val_shards)])[0]
    mix = open_val_sources(MixSpec((dataclasses.replace(one, holdout=0.0),)), cfg)
    return mix.sources, [n], f"{one.shards}"


def load_val_set(cfg: Any, text_encoder: Any = None) -> ValSet:
    """Read the validation samples (module docstring); `text_encoder` encodes their captions once where the run
    encodes online (None: the cached features of each source's text set)."""
    from dit_pipeline.common.seeding import derive_seed
    from dit_pipeline.shards import LatentSample, key_index
    from dit_pipeline.train.shard_samples import Joined, WithText, read_shard
    from dit_pipeline.train.stages import SkippedShard
    from dit_pipeline.train.latents import LatentSpec, build_latents, build_teacher, pending
    from dit_pipeline.train.mixdraws import held_out

    sources, share, description = _val_sources(cfg)
    holdout = cfg.val_shards == "holdout"
    latents, labels, noise, text, counts = [], [], [], [], {}
    tokens: list[torch.Tensor] = []
    token_noise: list[torch.Tensor] = []
    want_text = any(o.text is not None for o in sources) or text_encoder is not None
    for si, (o, want) in enumerate(zip(sources, share)):
        spec, m = LatentSpec.from_manifest(o.manifest), o.manifest
        taken: list[Any] = []
        for i, rec in enumerate(m.shards):
            if len(taken) >= want:
                break
            txt = o.text_shard(i) if text_encoder is None else None
            strings = text_encoder is not None and o.captions is None
            for item in read_shard(o.source.urls[i], m, False, record=rec, sibling=o.tokens_shard(i), text=txt,
                                   captions=strings, pixels=spec.from_pixels):  # sibling: REG's class tokens
                assert not isinstance(item, SkippedShard)  # read without --skip-bad-shards: a bad shard raises
                joined = item if isinstance(item, WithText) else None
                inner = joined.sample if joined is not None else item
                token = inner.teacher if isinstance(inner, Joined) else None
                sample = cast(LatentSample, inner.sample if isinstance(inner, Joined) else inner)
                k = key_index(sample.key)
                if holdout and not held_out(k, float(o.spec.holdout)):
                    continue
                c = o.spec.caption_index or 0
                cond: Any = None
                if joined is not None and joined.text is not None:
                    cond = np.array(joined.text.caption(min(c, len(joined.text.lengths) - 1)))
                elif strings:
                    cond = (sample.captions or [""])[min(c, len(sample.captions or [""]) - 1)]
                elif text_encoder is not None:
                    cond = o.captions[sample.label]
                taken.append((pending(sample, spec, derive_seed(STREAM_VAL, si, 1), token), cond, o, k))
                if len(taken) >= want:
                    break
        if len(taken) < want:
            raise UserError(f"--val-shards: {o.name} gives {len(taken)} validation samples, fewer than the "
                            f"{want} asked (--val-samples {cfg.val_samples}); lower --val-samples")
        counts[o.name] = len(taken)
        latents.append(build_latents([t[0] for t in taken], spec))
        labels += [t[0].label for t in taken]
        for p, cond, _, k in taken:
            g = torch.Generator().manual_seed(derive_seed(STREAM_VAL, si, 2, k))
            noise.append(torch.randn(spec.shape, generator=g))
            if want_text:
                text.append(cond)
        if o.reg is not None:  # the tokens of the latents' own views, each with its fixed noise
            tokens.append(build_teacher([t[0] for t in taken], o.reg.manifest.dtype)[:, 0])
            token_noise += [torch.randn(o.reg.dim, generator=torch.Generator().manual_seed(
                derive_seed(STREAM_VAL, si, 3, k))) for _, _, _, k in taken]
    feats = None
    if want_text:
        feats = _features(text, sources, text_encoder)
    return ValSet(description, torch.cat(latents), torch.tensor(labels, dtype=torch.int64), torch.stack(noise),
                  counts, feats, torch.cat(tokens) if tokens else None,
                  torch.stack(token_noise) if token_noise else None,
                  {o.name: str(o.spec.reg) for o in sources if o.reg is not None} or None)


def _features(conds: list[Any], sources: Sequence[Any], encoder: Any) -> list[torch.Tensor]:
    """float32 [L, D] per sample: widened stored features, or the captions encoded (in chunks of 16)."""
    from dit_pipeline.shards.npy import widen

    if encoder is None:
        dtype = next(o.text.dtype for o in sources if o.text is not None)
        return [torch.from_numpy(np.array(widen(c, dtype))) for c in conds]
    out = []
    with torch.no_grad():
        for i in range(0, len(conds), 16):
            feats = encoder.encode([str(c) for c in conds[i:i + 16]])
            out += [feats.trimmed(j).float().cpu() for j in range(len(conds[i:i + 16]))]
    return out


# ----------------------------------------------------------------------------------------------------------
# The evaluation

def noise_levels(k: int) -> list[float]:
    """MLPerf's levels: k evenly spaced noise fractions j / k, j = 0..k-1 (0 = data)."""
    return [j / k for j in range(k)]


@dataclass
class _Batch:
    labels: torch.Tensor
    text: torch.Tensor | None = None
    text_mask: torch.Tensor | None = None


@torch.no_grad()
def val_losses(module: torch.nn.Module, objective: Any, cond: Any, val: ValSet, *, k: int, batch: int,
               device: torch.device, amp: torch.dtype | None = None) -> list[float]:
    """The K per-level mean losses of `module` on `val` (module docstring), in float64 sums over fixed chunks."""
    from dit_pipeline.common.text_encoders import pad_batch
    from dit_pipeline.dit.reg import REG_NOISE, REG_TARGET

    levels = torch.tensor(noise_levels(k), dtype=torch.float64)
    which = torch.arange(len(val)) % k
    sums, counts = torch.zeros(k, dtype=torch.float64), torch.bincount(which, minlength=k).double()
    objective.attach(module)

    def model_fn(x: torch.Tensor, t: torch.Tensor, **kw: Any) -> Any:
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            return module(x, t, **kw)

    with evaluating(module):
        for start in range(0, len(val), batch):
            sl = slice(start, min(start + batch, len(val)))
            b = _Batch(val.labels[sl])
            if val.text is not None:
                b.text, b.text_mask = pad_batch(val.text[sl], int(val.text[0].shape[-1]))
            kwargs = cond.batch_kwargs(b, None, device)
            if val.reg is not None and val.reg_noise is not None:  # REG: the class token noised with the image's t
                kwargs.update({REG_TARGET: val.reg[sl].to(device), REG_NOISE: val.reg_noise[sl].to(device)})
            t = objective.val_times(levels[which[sl]], device)
            loss = objective.val_loss(model_fn, val.latents[sl].to(device), t, kwargs, val.noise[sl].to(device))
            sums.index_add_(0, which[sl], loss.detach().double().cpu())
    return (sums / counts.clamp(min=1)).tolist()


class ValidationHook:
    """The periodic hook of --val-shards (module docstring)."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.every = int(cfg.val_every)
        self.val: ValSet | None = None
        self.log = get_logger()

    @classmethod
    def from_settings(cls, cfg: Any) -> "ValidationHook":
        return cls(cfg)

    def setup(self, ctx: HookContext) -> None:
        """The evaluating ranks read the set (and, for online text, encode its captions once); a new run is
        evaluated at once."""
        if not ctx.runs_passes():
            return
        encoder = None
        if self.cfg.text_features == "online" and ctx.model_config.get("conditioning") == "text":
            encoder = self._encoder(ctx)
        self.val = load_val_set(self.cfg, encoder)
        del encoder
        if ctx.step == 0:
            self(ctx)

    def _encoder(self, ctx: HookContext) -> Any:
        from dit_pipeline.common.text_encoders import from_identity
        from dit_pipeline.train.mix import mix_spec, open_mix
        from dit_pipeline.train.repa import MIX_CACHED

        spec = mix_spec(self.cfg.source, self.cfg.mix)
        if spec is not None:
            mix = open_mix(spec, text_features="online", use_reg=bool(self.cfg.use_reg),
                           repa_cached=self.cfg.repa == MIX_CACHED)
            manifest = next(o.text for o in mix.sources if o.text is not None)
        else:
            from dit_pipeline.shards import read_manifest

            manifest = read_manifest(self.cfg.text)
        return from_identity(dict(manifest.text_encoder or {}), device=ctx.device, where="--val-shards")

    def __call__(self, ctx: HookContext) -> dict[str, Any] | None:
        if not ctx.runs_passes():
            return None
        if self.val is None:
            self.setup(ctx)
            return None
        from dit_pipeline.dit.conditioning import conditioning_of
        from dit_pipeline.dit.objectives import build_objective
        from dit_pipeline.common.precision import AUTOCAST_DTYPES

        t0 = time.perf_counter()
        cfg, k = self.cfg, int(self.cfg.val_timesteps)
        weights = {"both": ("ema", "raw"), "ema": ("ema",), "raw": ("raw",)}[cfg.val_weights]
        cond = conditioning_of(ctx.model_config)
        amp = AUTOCAST_DTYPES.get(str(ctx.config.get("precision", "fp32")))
        rec: dict[str, Any] = {"step": ctx.step}
        shown = []
        for w in weights:
            module = ctx.ema if w == "ema" else ctx.model
            if module is None:
                continue
            objective = build_objective(cfg.objective, ctx.config)
            with ctx.evaluation(module) as runs:
                per = val_losses(runs, objective, cond, self.val, k=k, batch=int(cfg.val_batch_size),
                                 device=ctx.device, amp=amp)
            rec[f"val_loss_{w}"] = float(np.mean(per))
            rec[f"val_loss_{w}_t"] = per
            shown.append(f"{w} {rec[f'val_loss_{w}']:.4f}")
        levels = noise_levels(k)
        times = build_objective(cfg.objective, ctx.config).val_times(torch.tensor(levels, dtype=torch.float64),
                                                                     torch.device("cpu"))
        rec["val_run"] = {"set": self.val.description, "samples": len(self.val), "sources": self.val.sources,
                          "noise_levels": levels, "times": times.tolist(), "objective": cfg.objective,
                          "weights": list(weights), "step": ctx.step, "batch": int(cfg.val_batch_size),
                          "rule": "MLPerf FLUX.1: sample i at level i mod K, mean per level, mean of the levels",
                          "seconds": round(time.perf_counter() - t0, 3),
                          **({"reg_tokens": self.val.reg_from} if self.val.reg_from else {})}
        if ctx.rank != 0:
            return rec
        if ctx.metrics is not None:
            ctx.metrics.write(rec)
        self.log.info(f"val   step {ctx.step}: {' '.join(shown)} ({k} noise levels, {len(self.val):,} samples: "
                      f"{self.val.description}; {rec['val_run']['seconds']:.1f}s)")
        return rec

