"""Several encodings of one image set: sibling shard sets joined by sample key (issue #32).

A second space (DINOv2 tokens beside SD-VAE latents, say) is a shard set of its own, extracted from the same
image folder with the same crop, views and samples per shard: `dit-extract --encoder ... --out SIBLING`. Its
shard i then holds exactly the keys of the first set's shard i in the same order, so a reader walks both in
lockstep without an index. Why siblings rather than named fields in one set: a space is added later without
re-extracting (or rewriting the bytes of) the first one; each set keeps its own manifest, normalization,
verify and resume; a run that needs one space reads only its bytes (a tar is read sequentially, so fields of
an unused space would be read and skipped). The cost is one manifest check, `sibling_problems`, done before
any GPU work.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from dit_pipeline.common.errors import UserError
from dit_pipeline.shards.manifest import Manifest, read_manifest

# What must agree for two sets to hold the same images in the same views, sample for sample.
SAME_EXTRACTION = ("listing_sha256", "num_images", "image_size", "views", "flip", "samples_per_shard", "crop")
_SAME_EXTRACTION = SAME_EXTRACTION


def _shards(m: Manifest) -> list[tuple[Any, ...]]:
    return [(s.name, s.samples, s.first_key, s.last_key) for s in m.shards]


def sibling_problems(primary: Manifest, other: Manifest) -> list[str]:
    """Why `other` is not a sibling of `primary` (empty: the same images, views and keys, shard by shard)."""
    out: list[str] = []
    for k in _SAME_EXTRACTION:
        a, b = primary.extraction.get(k), other.extraction.get(k)
        if a != b:
            out.append(f"{k}: {a!r} vs {b!r}")
    if primary.views != other.views:
        out.append(f"views: {primary.views} vs {other.views}")
    if primary.class_names != other.class_names:
        out.append("class names differ")
    if not out and _shards(primary) != _shards(other):
        out.append("the shards hold other keys (a sample skipped in one set only, or another --limit)")
    if not out and {s["key"] for s in primary.skipped} != {s["key"] for s in other.skipped}:
        out.append("other images were skipped")
    return out


def read_sibling(primary: Manifest, folder: str | Path, flag: str) -> Manifest:
    """The sibling set's manifest, checked against `primary`; UserError naming every difference."""
    m = read_manifest(Path(folder).expanduser())
    problems = sibling_problems(primary, m)
    if problems:
        raise UserError(f"{flag} {folder}: not the same images in the same views as the training shards "
                        f"({'; '.join(problems)}); extract both from the same --data-path with the same "
                        "--image-size, --flip, --samples-per-shard and --limit")
    return m


def sibling_shard(folder: str | Path, sibling: Manifest, i: int) -> tuple[str, Manifest, Any]:
    """(path, manifest, record) of shard `i` of the sibling set in `folder`: what the readers join to shard `i` of
    the training set (train.shard_samples.read_shard's `sibling` and `text`)."""
    return str(Path(folder).expanduser() / sibling.shards[i].name), sibling, sibling.shards[i]


def read_text_sibling(primary: Manifest, folder: str | Path, flag: str, *, template: str | None = None,
                      class_names: list[str] | None = None) -> Manifest:
    """A text set (`dit-extract --text-encoder`) of the captions of `primary`: a sibling (the same keys, shard by
    shard) made from the very captions `primary` stores (its captions digest); UserError naming the difference.
    With `template` (a class-labelled set, `dit-extract --caption-template`): made from these very shards
    (their fingerprint) with this template and these class captions (`class_names`: each class's caption)."""
    m = read_sibling(primary, folder, flag)
    if not m.is_text or m.text is None:
        raise UserError(f"{flag} {folder}: not a text set (its store is {m.store!r}); make one with dit-extract "
                        f"--text-encoder NAME --data-path <the latent set> --out {folder}")
    source = m.text.get("source") or {}
    if template is not None or source.get("template") is not None:
        return _template_sibling(primary, m, folder, flag, template, class_names)
    made_from = source.get("captions_sha256")
    have = (primary.captions or {}).get("sha256")
    if have is None:
        raise UserError(f"{flag} {folder}: the training shards hold no captions (extracted without --captions)")
    if made_from != have:
        raise UserError(f"{flag} {folder}: its features were made from other captions than the training shards hold "
                        f"(captions sha256 {str(made_from)[:12]}... vs {have[:12]}...); extract the text set again from "
                        "these shards")
    return m


def _template_sibling(primary: Manifest, m: Manifest, folder: str | Path, flag: str, template: str | None,
                      class_names: list[str] | None) -> Manifest:
    assert m.text is not None
    source = m.text.get("source") or {}
    made = source.get("template")
    if template is None:
        raise UserError(f"{flag} {folder}: its features are of the template {made!r} filled with class names; give "
                        "the source that template (template=...)")
    if made is None:
        raise UserError(f"{flag} {folder}: its features are of stored captions, not of the template {template!r}; "
                        "make one with dit-extract --text-encoder NAME --caption-template TEMPLATE")
    if made != template:
        raise UserError(f"{flag} {folder}: its features are of the template {made!r}, this source asks for "
                        f"{template!r}; extract the text set again with --caption-template {template!r}")
    if class_names is not None and list(source.get("class_captions") or []) != list(class_names):
        raise UserError(f"{flag} {folder}: its class captions differ from this source's (other class names); "
                        "extract the text set again with the same --class-names")
    if source.get("fingerprint") != primary.fingerprint():
        raise UserError(f"{flag} {folder}: made from another shard set than these (fingerprint "
                        f"{str(source.get('fingerprint'))[:12]}... vs {primary.fingerprint()[:12]}...)")
    return m
