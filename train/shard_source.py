"""The shard set a run trains on: `--shards` (+ `--manifest`) resolved into a validated `ShardSource`.

A local folder is checked against its manifest at once (every shard present with its recorded size,
`shards.quick_check`); a URL list or brace pattern (WebDataset's `expand_urls`) is matched to the manifest's
shards by name. Anything missing or foreign is a `UserError` naming it; the trainer's readers (train.data) then
read `ShardSource.urls` in manifest order.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dit_pipeline.common.errors import UserError
from dit_pipeline.shards import Manifest, quick_check, read_manifest


@dataclass
class ShardSource:
    """A validated shard set: its manifest and one readable location per manifest shard (same order)."""

    manifest: Manifest
    urls: list[str]
    folder: Path | None
    fingerprint: str

    @property
    def sizes(self) -> list[int]:
        return [rec.samples for rec in self.manifest.shards]

    def index_of(self, name: str) -> int:
        """The index of the manifest shard `name`."""
        return next(i for i, rec in enumerate(self.manifest.shards) if rec.name == name)


def _shard_name_in(url: str, names: set[str]) -> str | None:
    """The manifest shard name a URL refers to (its last path component, or inside a pipe: command)."""
    tail = url.rstrip("/").rsplit("/", 1)[-1]
    if tail in names:
        return tail
    hits = [n for n in names if n in url]
    return hits[0] if len(hits) == 1 else None


def open_shards(shards: str, manifest: str | None = None) -> ShardSource:
    """Resolve `--shards` (+ `--manifest`) into a ShardSource; UserError naming anything missing or foreign.

    A local folder is checked against its manifest at once (every shard present with its recorded size).
    A URL list ("a::b") or brace pattern ("s3://b/shard-{000000..000099}.tar") needs `--manifest`; each URL
    must name exactly one manifest shard and every manifest shard must be listed.
    """
    from webdataset.shardlists import expand_urls

    from dit_pipeline.shards.manifest import require_latents

    folder = Path(shards).expanduser()
    if folder.is_dir():
        m = require_latents(read_manifest(Path(manifest).expanduser() if manifest else folder), folder, "--shards")
        problems = quick_check(folder, m)
        if problems:
            shown = problems[:10] + ([f"... and {len(problems) - 10} more"] if len(problems) > 10 else [])
            raise UserError(f"the shard set in {folder} does not match its manifest:\n  "
                            + "\n  ".join(shown) + "\nRun `dit-shards verify` for a full report; re-extract or "
                            "re-copy the listed shards.")
        return ShardSource(m, m.shard_urls(str(folder)), folder, m.fingerprint())
    if manifest is None:
        raise UserError(f"--shards {shards!r} is not a folder; for a URL list or brace pattern also pass "
                        "--manifest (the manifest.json of that shard set)")
    m = require_latents(read_manifest(Path(manifest).expanduser()), manifest, "--shards")
    names = {rec.name for rec in m.shards}
    by_name: dict[str, str] = {}
    for url in expand_urls(shards):
        name = _shard_name_in(url, names)
        if name is None:
            raise UserError(f"--shards: {url!r} names no shard of the manifest {manifest} (expected names "
                            f"like {m.shards[0].name if m.shards else 'shard-000000.tar'})")
        if name in by_name:
            raise UserError(f"--shards lists {name} twice ({by_name[name]!r} and {url!r})")
        by_name[name] = url
    missing = [rec.name for rec in m.shards if rec.name not in by_name]
    if missing:
        raise UserError(f"--shards lists {len(by_name)} of the {len(m.shards)} shards of {manifest}; missing: "
                        f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    return ShardSource(m, [by_name[rec.name] for rec in m.shards], None, m.fingerprint())

