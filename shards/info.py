"""Human-readable summaries for `dit-shards info` and `dit-shards verify` (the JSON forms are the dicts)."""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from dit_pipeline.shards.manifest import Manifest, read_manifest
from dit_pipeline.shards.verify import VerifyReport


# what each store keeps per sample (docs/FORMAT.md)
_STORED = {"posterior": "mean.npy + std.npy", "sample": "latent.npy", "pixels": "the crop itself, pixels member"}

def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def info_dict(folder: str | Path) -> dict[str, Any]:
    """The manifest's summary: counts, sizes, latent layout, VAE and the skipped inputs by reason."""
    m = read_manifest(folder)
    reasons = Counter(str(s.get("reason", "?")).split(":", 1)[0] for s in m.skipped)
    return {
        "folder": str(folder), "format_version": m.format_version, "tool_version": m.tool_version,
        "fingerprint": m.fingerprint(), "samples": m.total_samples, "classes": m.num_classes,
        "shards": len(m.shards), "samples_per_shard": m.samples_per_shard, "bytes": m.total_bytes,
        "store": m.store, "dtype": m.dtype, "views": m.views, "latent_shape": list(m.latent_shape),
        "image_size": m.image_size, "scaling_factor": m.scaling_factor, "shift_factor": m.shift_factor,
        "normalization": m.normalization, "normalization_text": m.norm.describe(), "revision": m.revision,
        "geometry": geometry(m), "vae": m.extraction.get("vae"), "extraction": m.extraction,
        "skipped": len(m.skipped), "skipped_by_reason": dict(sorted(reasons.items())),
        "pixels": m.pixels, "captions": m.captions, "text": text_summary(m),
    }


def text_summary(m: Manifest) -> dict[str, Any] | None:
    """A text set's features at a glance: the encoder, widths, counts, the token-length histogram and what
    storing at true lengths saves against padding every caption to the encoder's max length."""
    if not m.is_text or m.text is None:
        return None
    t = m.text
    itemsize = 4 if m.dtype == "float32" else 2
    padded = t["captions"] * t["max_length"] * t["dim"] * itemsize
    stored = t["tokens"] * t["dim"] * itemsize
    edges, counts = t["length_histogram"]["edges"], t["length_histogram"]["counts"]
    return {"encoder": t["encoder"], "dim": t["dim"], "max_length": t["max_length"], "dtype": m.dtype,
            "captions": t["captions"], "tokens": t["tokens"], "truncated": t["truncated"],
            "mean_tokens": t["tokens"] / t["captions"] if t["captions"] else 0.0, "null_tokens": t["null"]["tokens"],
            "feature_bytes": stored, "padded_feature_bytes": padded,
            "histogram": [{"tokens": [lo, hi - 1], "captions": c} for lo, hi, c in zip(edges, edges[1:], counts)],
            "storage_error": t.get("storage_error"), "source": t.get("source")}


def geometry(m: Manifest) -> dict[str, Any]:
    """The latent geometry: channels, spatial size, the downsampling factor (image size / latent size) and
    what the encoder gave (a posterior or a deterministic latent); a text set: its feature width."""
    if m.is_text:
        return {"feature_dim": m.latent_shape[0]}
    c, h, w = m.latent_shape
    found = m.extraction.get("vae") or m.extraction.get("encoder")  # a feature space records its encoder
    vae: dict[str, Any] = found if isinstance(found, dict) else {}
    return {"latent_channels": c, "latent_size": [h, w], "downsample_factor": m.image_size // h if h else None,
            "vae_class": vae.get("class"), "encoder_output": vae.get("encoder_output", "latent_dist")}


def _scale_line(d: dict[str, Any]) -> str:
    if d["normalization"] is None:
        return (f"  scale:    scaling_factor {d['scaling_factor']:g}"
                + (f", shift_factor {d['shift_factor']:g}" if d["shift_factor"] is not None else ", no shift_factor"))
    return f"  scale:    {d['normalization_text']} (the scalar scaling_factor {d['scaling_factor']:g} is not used)"


def _vae_line(d: dict[str, Any]) -> str:
    enc = d["extraction"].get("encoder")
    if isinstance(enc, dict):  # a feature space (dit-extract --encoder)
        h, w = d["geometry"]["latent_size"]
        weights = enc.get("weights_sha256") or enc.get("weights")
        named = f" (NanoGen's {enc['latent_space']})" if enc.get("latent_space") else ""
        return (f"  encoder:  {enc.get('model')}{named} ({enc.get('formula_name', 'rae')}'s formula, "
                f"{enc.get('input_size')} px, "
                f"patch {enc.get('patch_size')}, last {enc.get('layers')} block(s)), weights {weights}\n"
                f"  geometry: features: {d['image_size']} px -> {d['geometry']['latent_channels']} x {h} x {w} tokens")
    vae = d["vae"] if isinstance(d["vae"], dict) else {}
    text = vae.get("source", "?") + "".join(f", {k} {vae[k]}" for k in ("subfolder", "revision", "commit",
                                                                       "weights_sha256") if vae.get(k))
    if vae.get("latent_space"):
        text += f" (NanoGen's {vae['latent_space']})"
    g = d["geometry"]
    enc = "deterministic latent" if g["encoder_output"] == "latent" else "posterior"
    h, w = g["latent_size"]
    return (f"  vae:      {text}\n  geometry: {g['vae_class'] or 'VAE'}, f{g['downsample_factor']}: "
            f"{d['image_size']} px -> {g['latent_channels']} x {h} x {w} ({enc})")


def _pixels_line(d: dict[str, Any]) -> str:
    px = d["pixels"]
    if px is None:
        return "  pixels:   none (extracted without --pixels)"
    per = px["bytes"] / d["samples"] if d["samples"] else 0
    w, h = px["size"]
    return (f"  pixels:   {px['member']} ({px['encoding']}, {px['mode']} {w}x{h}, the crop of view 0), "
            f"{human_bytes(px['bytes'])} ({human_bytes(per)}/sample)")


def _captions_line(d: dict[str, Any]) -> str:
    c = d["captions"]
    if not c:
        return "  captions: none (extracted without --captions)"
    per = c["captions"] / d["samples"] if d["samples"] else 0
    src = c.get("source") or {}
    return (f"  captions: {c['captions']} ({per:.2f} per sample) from {src.get('kind', '?')} {src.get('file') or ''}"
            f"; dropped: {c['dropped_empty']} empty or whitespace, {c['dropped_undecodable']} undecodable; "
            f"{c['uncaptioned']} images without a caption skipped; {c['unmatched']['count']} captions without an image")


def format_text_info(d: dict[str, Any]) -> str:
    """`dit-shards info` of a text set."""
    t = d["text"]
    enc = t["encoder"]
    per = d["bytes"] / d["samples"] if d["samples"] else 0
    hist = ", ".join(f"{h['tokens'][0]}-{h['tokens'][1]}: {h['captions']}" for h in t["histogram"] if h["captions"])
    err = t.get("storage_error") or {}
    lines = [
        f"text set {d['folder']} (format v{d['format_version']}, written by dit-pipeline {d['tool_version']})",
        f"  samples:  {d['samples']} in {d['shards']} shards of up to {d['samples_per_shard']}, "
        f"{human_bytes(d['bytes'])} ({human_bytes(per)}/sample)",
        f"  encoder:  {enc.get('name')} ({enc.get('class')}, {enc.get('dtype')}, revision {enc.get('revision')}, "
        f"weights {enc.get('weights_sha256')}); {enc.get('hidden_state')}",
        f"  features: {t['dim']} per token, {t['dtype']}, max length {t['max_length']}; {t['captions']} captions, "
        f"{t['tokens']} tokens ({t['mean_tokens']:.1f} per caption), {t['truncated']} truncated at the max length",
        f"  storage:  {human_bytes(t['feature_bytes'])} at true lengths = "
        f"{t['feature_bytes'] / max(1, t['padded_feature_bytes']):.1%} of {human_bytes(t['padded_feature_bytes'])} "
        f"padded to {t['max_length']} tokens; storage error max {err.get('max_abs', 0):.3g} "
        f"({err.get('max_rel', 0):.3g} of the largest value)",
        f"  lengths:  {hist or 'none'}",
        f"  null:     the empty prompt's features: {t['null_tokens']} tokens (stored once, in the manifest)",
        f"  skipped:  {d['skipped']} inputs (those of the latent set)",
        f"  fingerprint: {d['fingerprint']}",
    ]
    return "\n".join(lines)


def format_info(d: dict[str, Any]) -> str:
    if d.get("text"):
        return format_text_info(d)
    per = d["bytes"] / d["samples"] if d["samples"] else 0
    lines = [
        f"shard set {d['folder']} (format v{d['format_version']}, written by dit-pipeline {d['tool_version']})",
        f"  samples:  {d['samples']} in {d['shards']} shards of up to {d['samples_per_shard']}, "
        f"{human_bytes(d['bytes'])} ({human_bytes(per)}/sample)",
        f"  classes:  {d['classes']}",
        f"  latents:  {d['store']} ({_STORED[d['store']]}), "
        f"{d['dtype']}, [{d['views']}, {', '.join(map(str, d['latent_shape']))}] per sample "
        f"({d['views']} view{'s' if d['views'] != 1 else ''}), from {d['image_size']}px images",
        _pixels_line(d),
        *([_captions_line(d)] if d.get("captions") else []),
        _scale_line(d),
        _vae_line(d),
        f"  skipped:  {d['skipped']} inputs"
        + (" (" + ", ".join(f"{r}: {n}" for r, n in d["skipped_by_reason"].items()) + ")" if d["skipped"] else ""),
        f"  fingerprint: {d['fingerprint']}",
    ]
    if d["revision"]:
        r = d["revision"]
        lines.append(f"  revision: {r['number']} (by {r['by']}; the previous manifest is kept as {r['previous']})")
    other = {k: v for k, v in d["extraction"].items() if k not in ("vae", "encoder")}
    if other:
        lines.append("  extraction config: " + ", ".join(f"{k}={v}" for k, v in sorted(other.items())))
    return "\n".join(lines)


def format_verify(r: VerifyReport) -> str:
    mode = "quick check (sizes and tar structure, no hashing)" if r.quick else "full verification"
    head = (f"{r.folder}: {mode} of {r.shards} shards, {r.samples} samples, {human_bytes(r.bytes)} "
            f"in {r.seconds:.1f} s")
    if r.ok:
        return f"{head}\nOK: no problems found"
    lines = [head, f"FAILED: {len(r.problems)} problem{'s' if len(r.problems) != 1 else ''} in "
             f"{len({f for f, _ in r.problems})} file(s)"]
    lines += [f"  {f}: {p}" for f, p in r.problems]
    return "\n".join(lines)
