"""The latent shard format: WebDataset tar shards + manifest.json (docs/FORMAT.md).

`extract/` writes shards with `ShardWriter` and `write_manifest`; `train/` reads them with `read_manifest`,
`quick_check` and `iter_shard`; `dit-shards verify | info | stats` inspect them. Nothing outside this
package parses tar files.
"""
from dit_pipeline.shards.format import (FORMAT_VERSION, FORMAT_VERSION_NORMALIZATION, FORMAT_VERSION_PIXELS,
                                        FORMAT_VERSION_TEXT, MANIFEST_NAME, ShardError, key_index, revision_name, sample_key, shard_index,
                                        shard_name)
from dit_pipeline.shards.manifest import (Manifest, ShardRecord, format_version_for, read_manifest, scale_latents,
                                          write_manifest)
from dit_pipeline.shards.pixels import decode_pixels, encode_pixels, view_pixels
from dit_pipeline.shards.reader import LatentSample, iter_shard
from dit_pipeline.shards.text_reader import iter_text_shard
from dit_pipeline.shards.text import TextSample
from dit_pipeline.shards.verify import VerifyReport, quick_check, verify_shards
from dit_pipeline.shards.writer import ShardWriter

__all__ = [
    "FORMAT_VERSION", "FORMAT_VERSION_NORMALIZATION", "FORMAT_VERSION_PIXELS", "FORMAT_VERSION_TEXT", "MANIFEST_NAME",
    "LatentSample", "TextSample", "iter_text_shard",
    "Manifest", "ShardError", "ShardRecord", "ShardWriter", "VerifyReport", "decode_pixels", "encode_pixels",
    "format_version_for", "iter_shard", "key_index", "quick_check", "read_manifest", "revision_name", "sample_key",
    "scale_latents", "shard_index", "shard_name", "verify_shards", "view_pixels", "write_manifest",
]
