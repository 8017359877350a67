"""Reading a text set's shards (shards/text.py): `iter_text_shard`, the latent reader's shell (shards.reader:
the url opener, the sha256 modes, the record's keys and count) with the text samples' own check."""
from __future__ import annotations

from typing import Any, Generator, Iterator

from dit_pipeline.shards.format import ShardError
from dit_pipeline.shards.manifest import Manifest, ShardRecord
from dit_pipeline.shards.npy import all_finite
from dit_pipeline.shards.reader import Stage, _record_of, _stream, counted, hash_checked, in_record_keys
from dit_pipeline.shards.sample_checks import Expect
from dit_pipeline.shards.tario import TarReader
from dit_pipeline.shards.text import TextSample, check_text_sample


def iter_text_shard(url: str, manifest: Manifest, *, record: ShardRecord | None = None,
                    sha256: str | None = None) -> Generator[TextSample, None, None]:
    """Stream the samples of one shard of a text set (shards/text.py): per sample its captions' token counts and
    stored features, checked against the manifest (fields, dtype, width, lengths within the encoder's max length,
    finite values) and, like `iter_shard`, against the shard's record (keys, count, optionally sha256)."""
    url = str(url)
    if not manifest.is_text:
        raise ShardError(url, None, "not a shard of a text set (its manifest has store "
                         f"{manifest.store!r}); read it with shards.iter_shard")
    expect = Expect.from_manifest(manifest)
    record = record if record is not None else _record_of(url, manifest)

    def stages(reader: TarReader, hasher: Any) -> list[Stage]:
        out: list[Stage] = []
        if record is not None:
            out.append(lambda items: in_record_keys(items, url, record))
        out.append(lambda items: checked_text(items, url, expect))
        if record is not None:
            out.append(lambda items: counted(items, url, record))
            if hasher is not None:
                out.append(lambda items: hash_checked(items, url, record, reader, hasher))
        return out

    yield from _stream(url, record, sha256, None, stages)


def checked_text(items: Iterator[tuple[str, dict]], url: str, expect: Expect) -> Iterator[TextSample]:
    """Stage: each text sample checked (fields, dtype, shape, lengths, finite values)."""
    assert expect.max_length is not None
    for key, fields in items:
        try:
            sample = check_text_sample(key, fields, dtype=expect.dtype, dim=expect.shape[0],
                                       max_length=expect.max_length)
        except ValueError as e:
            raise ShardError(url, key, str(e)) from None
        if not all_finite(sample.text):
            raise ShardError(url, key, "text.npy holds NaN or Inf")
        yield sample
