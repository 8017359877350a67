"""iter_shard's sha256 check against the manifest: a flipped byte inside a latent payload keeps every value
finite, so only the hash catches it; "whole" before any sample is yielded, "stream" at the shard's end."""
from __future__ import annotations

import tarfile

import pytest

from dit_pipeline.shards import ShardError, iter_shard, read_manifest
from tests.train.helpers import make_shard_set


def flip_payload_byte(path, member: str = "mean.npy", index: int = 1) -> None:
    """Flip the low mantissa byte of a float32 value inside sample `index`'s `member` (stays finite)."""
    with tarfile.open(path) as tf:
        m = [x for x in tf.getmembers() if x.name.endswith(member)][index]
        start = m.offset_data
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[start + 8:start + 10], "little")  # NPY v1: magic(6) version(2) len(2)
    pos = start + 10 + header_len + 4 * 5  # the 6th float32, its lowest (little-endian) byte
    data[pos] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def damaged(tmp_path):
    folder = tmp_path / "shards"
    make_shard_set(folder, samples=[4, 4])
    flip_payload_byte(folder / "shard-000001.tar")
    return folder


def test_a_flipped_payload_byte_passes_the_sample_checks(damaged):
    m = read_manifest(damaged)
    assert len(list(iter_shard(str(damaged / "shard-000001.tar"), m, raw=True))) == 4


def test_whole_check_fails_before_any_sample(damaged):
    m = read_manifest(damaged)
    url = str(damaged / "shard-000001.tar")
    it = iter_shard(url, m, raw=True, sha256="whole")
    with pytest.raises(ShardError) as e:
        next(it)
    rec = m.shards[1]
    assert e.value.problem.startswith("sha256 mismatch: the file hashes to ")
    assert e.value.problem.endswith(f"..., the manifest records {rec.sha256[:16]}... for shard-000001.tar "
                                    "(changed or damaged since extraction); none of its samples were used")
    assert len(list(iter_shard(str(damaged / "shard-000000.tar"), m, raw=True, sha256="whole"))) == 4


def test_stream_check_fails_at_the_shard_end(damaged):
    m = read_manifest(damaged)
    seen = []
    with pytest.raises(ShardError) as e:
        for s in iter_shard(str(damaged / "shard-000001.tar"), m, raw=True, sha256="stream"):
            seen.append(s.key)
    assert len(seen) == 4
    assert e.value.problem.endswith("(changed or damaged since extraction); all 4 of its samples were already "
                                    "read (a check as the shard streams comes at its end)")
    assert len(list(iter_shard(str(damaged / "shard-000000.tar"), m, raw=True, sha256="stream"))) == 4


def test_record_given_for_a_url_without_the_shard_name(damaged):
    m = read_manifest(damaged)
    url = f"pipe:cat {damaged / 'shard-000001.tar'}"  # names the file only inside a command
    assert len(list(iter_shard(url, m, raw=True, record=m.shards[1]))) == 4
    with pytest.raises(ShardError, match="sha256 mismatch"):
        list(iter_shard(url, m, raw=True, record=m.shards[1], sha256="whole"))
