"""A data mix as data: its sources (each a shard set with its weight, its text and its caption policy), read from
repeated `--source` options or a small YAML file (`--mix`), and opened into one latent space (issue 46;
docs/data-mix.md).

A source is written `SHARDS key=value ...` on the command line (shell-quoted as one argument; `SHARDS` may also be
given as `shards=`) or as a mapping in the YAML file's `sources:` list, with these keys:

| key | meaning |
|---|---|
| `shards` | the shard set: a folder, or a URL list / brace pattern (`file:`, `pipe:`, `s3://`, ...) with `manifest` |
| `manifest` | the manifest.json of a URL-list source |
| `name` | the source's name in logs, metrics and checkpoints (default: the folder's name) |
| `proportion` / `repeat` / `choose` | its weight, as MosaicML Streaming defines them (train/mixplan.py) |
| `text` | its text set (`dit-extract --text-encoder`): the cached features of its captions |
| `caption` | which of a sample's captions: `all` (one drawn per sample and epoch, default) or an index (0: the first, e.g. the long caption of a set extracted with `--caption-keys long,short`) |
| `template`, `class_names` | a class-labelled set's captions: the template (`a photo of a {name}`) filled with its class names (the manifest's, or a file: one name per line, or JSON) |
| `holdout` | the fraction of its keys held out for `--val-shards holdout` (by key hash; never trained on) |
| `reg` | its REG class tokens (`dit-train --use-reg`): the sibling set `dit-extract --encoder dinov2-vit-b --encoder-formula reg` made from its images |
| `repa` | its REPA teacher tokens (`dit-train --repa cached`): the sibling set `dit-extract --encoder dinov2-b --encoder-formula repa` made from its images |

The YAML file may also give `epoch_size` (samples per epoch with proportions) and `lanes` (train/mixplan.py).

Opening checks that every source is in the latent space of the first one (the same encoder identity, latent shape
and normalization) and that their text sets share one text encoder; a mismatch is refused naming both sets and
the field that differs, before any work.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from dit_pipeline.common.errors import ConfigError, UserError
from dit_pipeline.shards import Manifest
from dit_pipeline.shards.siblings import sibling_shard
from dit_pipeline.shards.text import read_class_names, template_captions
from dit_pipeline.train import reg, repa
from dit_pipeline.train.mixplan import ShardKeys, SourceShape, Weight, weights_problems

SOURCE_KEYS = ("shards", "manifest", "name", "proportion", "repeat", "choose", "text", "caption", "template",
               "class_names", "holdout", "reg", "repa")
MIX_KEYS = ("sources", "epoch_size", "lanes")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
HOLDOUT = "holdout"  # --val-shards holdout: the keys the sources hold out


@dataclass(frozen=True)
class SourceSpec:
    """One source of a mix, as given (module docstring)."""

    shards: str
    manifest: str | None = None
    name: str = ""
    proportion: float | None = None
    repeat: float | None = None
    choose: int | None = None
    text: str | None = None
    caption: str = "all"
    template: str | None = None
    class_names: str | None = None
    holdout: float = 0.0
    reg: str | None = None
    repa: str | None = None

    @property
    def weight(self) -> Weight:
        return Weight(self.proportion, self.repeat, self.choose)

    @property
    def caption_index(self) -> int | None:
        """The caption every sample uses (None: one drawn per sample and epoch)."""
        return None if self.caption == "all" else int(self.caption)

    def problems(self) -> list[str]:
        n = self.name or self.shards
        out = self.weight.problems(n)
        if self.caption != "all" and not (str(self.caption).isdigit()):
            out.append(f"source {n}: caption must be 'all' or a caption index (0, 1, ...), got {self.caption!r}")
        if isinstance(self.holdout, bool) or not isinstance(self.holdout, (int, float)) or not 0 <= self.holdout < 1:
            out.append(f"source {n}: holdout must be a fraction in [0, 1), got {self.holdout!r}")
        if self.template is not None and "{name}" not in self.template:
            out.append(f"source {n}: template must contain {{name}} (the class name), got {self.template!r}")
        if self.class_names is not None and self.template is None:
            out.append(f"source {n}: class_names fill a template: add template='a photo of a {{name}}'")
        if self.template is not None and self.caption != "all":
            out.append(f"source {n}: a template source has one caption per sample; drop caption=")
        if self.name and not _NAME.match(self.name):
            out.append(f"source {n}: a name is letters, digits, '.', '_' or '-', got {self.name!r}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v not in (None, "") and not
                (k == "caption" and v == "all") and not (k == "holdout" and v == 0.0)}


@dataclass(frozen=True)
class MixSpec:
    sources: tuple[SourceSpec, ...]
    epoch_size: int | None = None
    lanes: int | None = None

    def problems(self) -> list[str]:
        out = [p for s in self.sources for p in s.problems()]
        out += weights_problems([s.weight for s in self.sources], [s.name or s.shards for s in self.sources],
                                self.epoch_size)
        if self.lanes is not None and (isinstance(self.lanes, bool) or not isinstance(self.lanes, int)
                                       or self.lanes < 1):
            out.append(f"lanes must be a positive integer, got {self.lanes!r}")
        names = [s.name for s in self.sources]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            out.append(f"two sources are named {', '.join(twice)}: give each a distinct name=")
        return out


def _number(key: str, value: str) -> Any:
    try:
        return int(value) if key == "choose" else float(value)
    except ValueError:
        raise UserError(f"--source: {key}={value!r} is not a number") from None


def parse_source(text: str) -> SourceSpec:
    """`SHARDS key=value ...` (module docstring) -> a SourceSpec; UserError naming an unknown key."""
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise UserError(f"--source {text!r}: {e}") from None
    values: dict[str, Any] = {}
    for w in words:
        key, eq, value = w.partition("=")
        if not eq or key not in SOURCE_KEYS:
            if "shards" in values:
                raise UserError(f"--source {text!r}: {w!r} is not key=value with a key among {', '.join(SOURCE_KEYS)}")
            values["shards"] = w
            continue
        values[key] = _number(key, value) if key in ("proportion", "repeat", "choose", "holdout") else value
    return source_from_mapping(values, f"--source {text!r}")


def source_from_mapping(values: Mapping[str, Any], where: str) -> SourceSpec:
    unknown = sorted(set(values) - set(SOURCE_KEYS))
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(SOURCE_KEYS)}")
    if not str(values.get("shards") or "").strip():
        raise UserError(f"{where}: no shard set (the first word, or shards=FOLDER)")
    kw = dict(values)
    if "caption" in kw:
        kw["caption"] = str(kw["caption"])
    return SourceSpec(**kw)


def read_mix_file(path: str | Path) -> MixSpec:
    """The YAML (or JSON) mix file of `--mix` (module docstring)."""
    import yaml

    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"--mix {path}: no such file")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise UserError(f"--mix {path}: cannot parse: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("sources"), list) or not data["sources"]:
        raise UserError(f"--mix {path}: expected a mapping with a non-empty list 'sources:' (each a mapping with "
                        "shards: and its weight)")
    unknown = sorted(set(data) - set(MIX_KEYS))
    if unknown:
        raise UserError(f"--mix {path}: unknown key(s) {', '.join(unknown)}; known: {', '.join(MIX_KEYS)}")
    sources = []
    for i, s in enumerate(data["sources"]):
        if not isinstance(s, dict):
            raise UserError(f"--mix {path}: source {i} is not a mapping")
        sources.append(source_from_mapping(s, f"--mix {path} source {i}"))
    return MixSpec(tuple(sources), data.get("epoch_size"), data.get("lanes"))


def mix_spec(sources: Sequence[str] | None, mix: str | None, epoch_size: int | None = None,
             lanes: int | None = None) -> MixSpec | None:
    """The run's mix from `--source` / `--mix` (None: neither), with names filled in and checked (ConfigError
    listing every problem)."""
    if not sources and not mix:
        return None
    if sources and mix:
        raise UserError("give the sources either as --source options or in a --mix file, not both")
    spec = read_mix_file(mix) if mix else MixSpec(tuple(parse_source(s) for s in sources or ()))
    if epoch_size is not None:
        spec = dataclasses.replace(spec, epoch_size=epoch_size)
    if lanes is not None:
        spec = dataclasses.replace(spec, lanes=lanes)
    spec = dataclasses.replace(spec, sources=tuple(_named(spec.sources)))
    problems = spec.problems()
    if problems:
        raise ConfigError(problems, "data mix")
    return spec


def _named(sources: Sequence[SourceSpec]) -> list[SourceSpec]:
    """Sources with a name each: the given one, else the folder's (or the manifest's folder's) name, made unique."""
    out, used = [], set()
    for i, s in enumerate(sources):
        if s.name:
            out.append(s)
            used.add(s.name)
            continue
        base = Path(s.manifest).expanduser().parent.name if s.manifest else Path(s.shards.rstrip("/")).name
        base = re.sub(r"[^A-Za-z0-9._-]", "-", base).strip("-.") or f"source{i}"
        name, k = base, 2
        while name in used or any(o.name == name for o in sources):
            name, k = f"{base}-{k}", k + 1
        used.add(name)
        out.append(dataclasses.replace(s, name=name))
    return out


# ----------------------------------------------------------------------------------------------------------
# Opening: shard sets, one latent space, text sets

@dataclass
class OpenSource:
    spec: SourceSpec
    source: Any                       # train.shard_source.ShardSource
    text: Manifest | None = None      # its text set's manifest (cached features)
    reg: Any = None                   # its REG class tokens (train.reg.RegTokens), opened with --use-reg
    repa: Any = None                  # its REPA teacher tokens (train.repa.CachedTeacher), opened with --repa cached
    captions: tuple[str, ...] | None = None  # a template source: the caption of each class

    @property
    def manifest(self) -> Manifest:
        return self.source.manifest

    @property
    def name(self) -> str:
        return self.spec.name

    def shape(self, bad: frozenset[int] = frozenset()) -> SourceShape:
        m = self.manifest
        skipped = frozenset(int(s["key"]) for s in m.skipped if str(s.get("key", "")).isdigit())
        shards = tuple(ShardKeys(r.samples, int(r.first_key) if r.first_key else None,
                                 int(r.last_key) if r.last_key else None) for r in m.shards)
        return SourceShape(self.name, shards, self.spec.weight, float(self.spec.holdout), skipped, bad)

    def record(self) -> dict[str, Any]:
        """What the checkpoint and config.json keep of this source: the spec and the identity of its data."""
        out = {**self.spec.to_dict(), "fingerprint": self.source.fingerprint, "samples": self.manifest.total_samples}
        if self.text is not None:
            out["text_fingerprint"] = self.text.fingerprint()
        if self.reg is not None:
            out["reg_fingerprint"] = self.reg.manifest.fingerprint()
        if self.repa is not None:
            out["repa_fingerprint"] = self.repa.manifest.fingerprint()
        return out

    def tokens(self) -> tuple[str, Manifest] | None:
        """The sibling set joined to this source's samples (Batch.teacher): its REG class tokens or its REPA teacher
        tokens (a run trains with at most one), as (folder, manifest); None when it joins none."""
        for folder, tokens in ((self.spec.reg, self.reg), (self.spec.repa, self.repa)):
            if tokens is not None:
                return str(folder), tokens.manifest
        return None

    def text_shard(self, i: int) -> tuple[str, Manifest, Any] | None:
        """What the reader joins to shard `i` from the source's text set (shards.siblings.sibling_shard), if any."""
        return None if self.text is None else sibling_shard(str(self.spec.text), self.text, i)

    def tokens_shard(self, i: int) -> tuple[str, Manifest, Any] | None:
        """What the reader joins to shard `i` from the source's cached tokens (`tokens`), if any."""
        joined = self.tokens()
        return None if joined is None else sibling_shard(joined[0], joined[1], i)


def latent_space(m: Manifest) -> dict[str, Any]:
    """What makes two sets' latents one space: the encoder's identity, the latent shape, the normalization."""
    ext = m.extraction or {}
    encoder = ext.get("encoder") or ext.get("vae")
    identity = ({k: v for k, v in encoder.items() if k not in ("source", "kind")} if isinstance(encoder, dict)
                else encoder)
    return {"encoder": identity, "latent_shape": list(m.latent_shape), "normalization": m.norm.key()}


def space_problem(a: OpenSource, b: OpenSource) -> str | None:
    """The refusal of source b beside source a (None: the same latent space)."""
    sa, sb = latent_space(a.manifest), latent_space(b.manifest)
    for field in ("encoder", "latent_shape", "normalization"):
        if sa[field] != sb[field]:
            detail = ""
            if field == "encoder" and isinstance(sa[field], dict) and isinstance(sb[field], dict):
                keys = [k for k in sorted(set(sa[field]) | set(sb[field])) if sa[field].get(k) != sb[field].get(k)]
                detail = "; " + ", ".join(f"{k}: {sa[field].get(k)!r} vs {sb[field].get(k)!r}" for k in keys[:4])
            elif field != "encoder":
                detail = f": {sa[field]!r} vs {sb[field]!r}"
            return (f"sources {a.name} ({a.spec.shards}) and {b.name} ({b.spec.shards}) are not one latent space: "
                    f"their {field} differs{detail}. A mix trains on one space; extract both with the same encoder, "
                    "image size and normalization")
    return None


@dataclass
class OpenMix:
    """The opened sources of a mix, one latent space (module docstring)."""

    spec: MixSpec
    sources: list[OpenSource]

    @property
    def primary(self) -> Any:
        return self.sources[0].source

    @property
    def fingerprint(self) -> str:
        """sha256 of the sources' names, data fingerprints and weights (what a resume compares)."""
        text = json.dumps([s.record() for s in self.sources], sort_keys=True)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def record(self, lanes: int) -> dict[str, Any]:
        return {"sources": [s.record() for s in self.sources], "epoch_size": self.spec.epoch_size,
                "lanes": int(lanes), "fingerprint": self.fingerprint}

    def shapes(self, bad: Sequence[str] = ()) -> list[SourceShape]:
        """The planner's view, the shards skipped as bad (qualified names "source/shard") left out."""
        out = []
        for s in self.sources:
            names = {rec.name: i for i, rec in enumerate(s.manifest.shards)}
            mine = frozenset(names[n.split("/", 1)[1]] for n in bad if n.split("/", 1)[0] == s.name
                             and n.split("/", 1)[1] in names)
            out.append(s.shape(mine))
        return out

    @property
    def has_text(self) -> bool:
        return any(s.text is not None for s in self.sources)

    @property
    def reg(self) -> Any:
        """The class tokens of the first source (train.reg.RegTokens; every source's come from one encoder, of
        one width), None without --use-reg."""
        return self.sources[0].reg


@dataclass(frozen=True)
class TokensKey:
    """A source key naming a sibling set of cached tokens, joined to the source's samples (Batch.teacher): opened for
    every source when the run reads them (needed on each), refused when it does not (it would do nothing)."""

    key: str                                  # the source key
    needed: str                               # why a source without it is refused when the run reads them
    unused: str                               # why it is refused when the run does not
    hint: str                                 # the command that makes them
    open: Callable[[str, Manifest, str], Any]  # (folder, the source's manifest, flag) -> the checked tokens


TOKENS_KEYS = (
    TokensKey("reg", "--use-reg trains on each sample's class token",
              "reg= names REG's class tokens: add --use-reg (or drop reg=)", reg.EXTRACT_HINT, reg.open_reg_tokens),
    TokensKey("repa", f"--repa {repa.MIX_CACHED} aligns to each source's cached teacher tokens",
              f"repa= names REPA's cached teacher tokens, which only --repa {repa.MIX_CACHED} reads: add --repa "
              "cached (or drop repa=; a teacher given to --repa runs on each source's pixels)", repa.EXTRACT_HINT,
              repa.open_cached_teacher))


def source_tokens(k: TokensKey, o: OpenSource, where: str, read: bool) -> Any:
    """The cached tokens source `o` names with key `k` (`where` naming the source), opened and checked against its
    shards when the run reads them (`read`); None when it names none and the run does not."""
    folder = getattr(o.spec, k.key)
    if folder is None:
        if read:
            raise UserError(f"{where}: {k.needed}, and this source names none: give it {k.key}=FOLDER, made from its "
                            f"images by {k.hint}")
        return None
    if not read:
        raise UserError(f"{where}: {k.unused}")
    if o.source.folder is None:
        raise UserError(f"{where}: {k.key}= needs the source's shards as a folder (its tokens are checked against its "
                        "manifest's shards)")
    if not (Path(str(folder)).expanduser() / "manifest.json").is_file():
        raise UserError(f"{where} {k.key}= {folder}: no shard set there (no manifest.json); make it with {k.hint}")
    return k.open(str(folder), o.manifest, f"{where} {k.key}=")


def check_token_space(sources: list[tuple[str, str | None, Any]], what: str = "class tokens") -> None:
    """A mix's sources' cached tokens ((name, folder, tokens) each: REG's class tokens (train.reg.RegTokens), or
    REPA's teacher tokens (train.repa.CachedTeacher)) from one encoder (what decides them, as a checkpoint's record
    compares it: common.features.feature_identity_fields), of one width, token grid and stored dtype: the model
    learns one token space. UserError naming both sources and the first field that differs."""
    from dit_pipeline.common.features import feature_identity_fields

    def decided(tokens: Any) -> dict[str, Any]:
        _, h, w = tokens.manifest.latent_shape
        return {**(feature_identity_fields(tokens.encoder) or {}), "width": tokens.dim,
                "token grid": f"{h}x{w}", "stored dtype": tokens.manifest.dtype}

    given = [(n, f, t) for n, f, t in sources if t is not None]
    for name, folder, tokens in given[1:]:
        (n0, f0, t0) = given[0]
        da, db = decided(t0), decided(tokens)
        changed = [k for k in da if da[k] != db.get(k)]
        if changed:
            k = changed[0]
            raise UserError(f"the {what} of sources {n0} ({f0}) and {name} ({folder}) come from different "
                            f"encoders: their {k} differs ({da[k]!r} vs {db[k]!r}); extract every source's tokens "
                            "with one encoder")


def open_mix(spec: MixSpec, *, text_features: str = "cached", use_reg: bool = False,
             repa_cached: bool = False) -> OpenMix:
    """Open every source (its shards checked against its manifest, as --shards is) and check them together;
    `use_reg` (--use-reg): each source's class tokens too (reg=, needed on every source; refused without it);
    `repa_cached` (--repa cached): likewise each source's REPA teacher tokens (repa=)."""
    from dit_pipeline.train.shard_source import open_shards

    opened = []
    for s in spec.sources:
        where = f"source {s.name}"
        try:
            src = open_shards(s.shards, s.manifest)
        except UserError as e:
            raise UserError(f"{where}: {e}") from None
        o = _open_text(OpenSource(s, src), where, text_features)
        o.reg, o.repa = (source_tokens(k, o, where, read) for k, read in zip(TOKENS_KEYS, (use_reg, repa_cached)))
        opened.append(o)
    mix = OpenMix(spec, opened)
    for other in opened[1:]:
        problem = space_problem(opened[0], other)
        if problem:
            raise UserError(problem)
    _check_text_sets(mix, text_features)
    check_token_space([(o.name, o.spec.reg, o.reg) for o in opened])
    check_token_space([(o.name, o.spec.repa, o.repa) for o in opened], "REPA teacher tokens")
    return mix


def _open_text(o: OpenSource, where: str, text_features: str) -> OpenSource:
    from dit_pipeline.shards.siblings import read_text_sibling

    s, m = o.spec, o.manifest
    if s.template is not None:
        o.captions = template_captions(s.template, read_class_names(s.class_names, m, where))
    elif s.caption_index is not None:
        per_image = ((m.captions or {}).get("per_image") or {}).get("min")
        if not m.has_captions:
            raise UserError(f"{where}: caption={s.caption} picks one of each sample's captions, and {s.shards} holds "
                            "none (extract it with --captions, or give the set a template=)")
        if per_image is not None and s.caption_index >= int(per_image):
            raise UserError(f"{where}: caption={s.caption} asks for caption {s.caption_index} of every sample, and "
                            f"some samples of {s.shards} have only {per_image}")
    if s.text is not None:
        if o.source.folder is None:
            raise UserError(f"{where}: text= needs the source's shards as a folder (its text set is checked "
                            "against its manifest's shards)")
        o.text = read_text_sibling(m, s.text, f"{where} text=", template=s.template,
                                   class_names=list(o.captions) if o.captions is not None else None)
    elif text_features == "online" and s.template is None and not m.has_captions:
        raise UserError(f"{where}: --text-features online encodes each sample's captions, and {s.shards} holds "
                        "none: extract it with --captions, or give it a template=")
    return o


def _check_text_sets(mix: OpenMix, text_features: str) -> None:
    """Either no source has a text set (class labels), or every source can give text: cached, each its own text
    set; online, each its captions (or a template), and one encoder for all."""
    from dit_pipeline.train.text import TextPart

    with_text = [s for s in mix.sources if s.text is not None]
    if not with_text:
        return
    if text_features == "cached":
        missing = [s.name for s in mix.sources if s.text is None]
        if missing:
            raise UserError(f"source(s) {', '.join(missing)} have no text set while {with_text[0].name} has one: a "
                            "text-conditioned mix gives every source text= (its captions' features), or encodes "
                            "them while training (--text-features online)")
    first = with_text[0]
    a = first.text.text_encoder or {}  # type: ignore[union-attr]
    for other in with_text[1:]:
        b = other.text.text_encoder or {}  # type: ignore[union-attr]
        changed = [k for k in TextPart.compared if a.get(k) != b.get(k)]
        if changed:
            k = changed[0]
            raise UserError(f"the text sets of sources {first.name} ({first.spec.text}) and {other.name} "
                            f"({other.spec.text}) come from different text encoders: their {k} differs "
                            f"({a.get(k)!r} vs {b.get(k)!r}); encode every source with one encoder")
        if other.text.dtype != first.text.dtype:  # type: ignore[union-attr]  # the batch holds one stored dtype
            raise UserError(f"the text sets of sources {first.name} ({first.spec.text}) and {other.name} "
                            f"({other.spec.text}) store their features as {first.text.dtype} and "  # type: ignore[union-attr]
                            f"{other.text.dtype}; encode every source with one --text-dtype")  # type: ignore[union-attr]
