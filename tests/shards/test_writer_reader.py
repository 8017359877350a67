"""ShardWriter -> iter_shard round trips, determinism, crash safety, and readability without our code."""
import hashlib
import os
import subprocess
import tarfile
import warnings

import numpy as np
import pytest
import torch

from dit_pipeline.shards import ShardError, ShardWriter, iter_shard, read_manifest, sample_key, shard_name
from dit_pipeline.shards.npy import widen
from tests.shards._helpers import arrays_for, make_set, npy, read_members, replace_member, write_tar


def _write(path, keys, dtype="float16", store="posterior"):
    with ShardWriter(path, dtype=dtype) as w:
        for g in keys:
            w.write(sample_key(g), label=g % 3, meta={"path": f"c/{g}.JPEG", "size": [48, 40]},
                    **arrays_for(g, store=store))
    return w.record


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("store", ["posterior", "sample"])
def test_round_trip_bit_identical(tmp_path, dtype, store):
    m = make_set(tmp_path / "set", dtype=dtype, store=store)
    got = []
    for url in m.shard_urls(str(tmp_path / "set")):
        got += list(iter_shard(url, m, with_meta=True))
    assert [s.key for s in got] == [sample_key(g) for g in range(12) if g != 5]
    for s in got:
        g = int(s.key)
        assert s.label == g % 3
        assert s.meta == {"class": ["cat", "dog", "eel"][g % 3], "path": f"{['cat', 'dog', 'eel'][g % 3]}/img{g}.JPEG",
                          "size": [48, 40]}
        for field, x in arrays_for(g, store=store).items():
            if dtype == "bfloat16":
                x = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
            y = getattr(s, field)
            assert y.dtype == np.float32 and y.shape == (2, 4, 4, 4) and y.flags.writeable
            assert np.array_equal(y.view(np.uint32), x.view(np.uint32))  # bit-identical, -0.0 included
        assert (s.latent is None) == (store == "posterior") and (s.mean is None) == (store == "sample")
    raw = [s for url in m.shard_urls(str(tmp_path / "set")) for s in iter_shard(url, m, raw=True)]
    assert [(r.key, r.label, r.meta) for r in raw] == [(s.key, s.label, None) for s in got]
    for r, s in zip(raw, got):  # raw=True: the stored arrays, read-only; widening them gives the float32 ones
        for field in ("mean", "std", "latent"):
            a, b = getattr(r, field), getattr(s, field)
            if b is not None:
                assert a.dtype.str == {"float16": "<f2", "float32": "<f4", "bfloat16": "<u2"}[dtype]
                assert not a.flags.writeable and np.array_equal(widen(a, dtype), b)


def test_same_writes_give_identical_bytes_and_record_matches_file(tmp_path):
    a = _write(tmp_path / "a" / shard_name(0), range(6))
    b = _write(tmp_path / "b" / shard_name(0), range(6))
    data = (tmp_path / "a" / shard_name(0)).read_bytes()
    assert data == (tmp_path / "b" / shard_name(0)).read_bytes()
    assert a == b
    assert (a.name, a.samples, a.first_key, a.last_key) == ("shard-000000.tar", 6, "000000000", "000000005")
    assert a.bytes == len(data) and a.sha256 == hashlib.sha256(data).hexdigest()
    assert len(data) % 10240 == 0  # padded to whole tar records, as tar and tarfile do
    with tarfile.open(tmp_path / "a" / shard_name(0)) as t:
        members = t.getmembers()
    assert [m.name for m in members[:5]] == ["000000000.cls", "000000000.json", "000000000.mean.npy",
                                             "000000000.std.npy", "000000001.cls"]
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode, m.type) for m in members} == {
        (0, 0, 0, "", "", 0o644, tarfile.REGTYPE)}
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(tmp_path / "a" / shard_name(0)).st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600


def test_empty_shard_is_valid(tmp_path):
    rec = ShardWriter(tmp_path / shard_name(3)).close()
    assert (rec.samples, rec.first_key, rec.last_key) == (0, None, None)
    assert list(iter_shard(str(tmp_path / shard_name(3)))) == []


def test_abort_and_exception_leave_previous_file_untouched(tmp_path):
    path = tmp_path / shard_name(0)
    path.write_bytes(b"previous complete shard")
    w = ShardWriter(path)
    w.write(sample_key(0), label=0, meta={}, **arrays_for(0))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]  # hidden temp while writing
    w.abort()
    with pytest.raises(RuntimeError, match="boom"):
        with ShardWriter(path) as w2:
            w2.write(sample_key(0), label=0, meta={}, **arrays_for(0))
            raise RuntimeError("boom")
    assert path.read_bytes() == b"previous complete shard"
    assert sorted(p.name for p in tmp_path.iterdir()) == [shard_name(0)]


def test_disk_full_fails_cleanly(tmp_path, monkeypatch):
    import errno

    from dit_pipeline.common.io import HashingWriter

    path = tmp_path / shard_name(0)
    _write(path, range(2))
    before = path.read_bytes()
    real_write = HashingWriter.write

    def full(self, data):
        if self.bytes > 1000:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, data)

    monkeypatch.setattr(HashingWriter, "write", full)
    with pytest.raises(OSError, match="No space left"):
        _write(path, range(4))
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == [shard_name(0)]


def test_compressed_shard_is_named(tmp_path):
    import gzip

    _write(tmp_path / shard_name(0), range(1))
    (tmp_path / "x.tar").write_bytes(gzip.compress((tmp_path / shard_name(0)).read_bytes()))
    with pytest.raises(ShardError, match="gzip-compressed file: shards are plain"):
        list(iter_shard(str(tmp_path / "x.tar")))


def test_writer_refuses_bad_input(tmp_path):
    w = ShardWriter(tmp_path / shard_name(0))
    a = arrays_for(0)
    with pytest.raises(ValueError, match="either mean and std"):
        w.write(sample_key(0), label=0, meta={}, latent=a["mean"], **a)
    with pytest.raises(ValueError, match="pass both mean and std"):
        w.write(sample_key(0), label=0, meta={}, mean=a["mean"])
    with pytest.raises(ValueError, match=r"shape \[V, C, h, w\]"):
        w.write(sample_key(0), label=0, meta={}, mean=a["mean"][0], std=a["std"][0])
    with pytest.raises(ValueError, match="label must be a non-negative integer"):
        w.write(sample_key(0), label=-1, meta={}, **a)
    with pytest.raises(ValueError, match="not a sample key"):
        w.write("12", label=0, meta={}, **a)
    nan = dict(a, std=np.full_like(a["std"], np.nan))
    with pytest.raises(ShardError, match="std.npy holds NaN or Inf"):
        w.write(sample_key(0), label=0, meta={}, **nan)
    big = dict(a, mean=np.full_like(a["mean"], 70000.0))  # finite in float32, Inf in float16
    with pytest.raises(ShardError, match=r"overflows float16"):
        w.write(sample_key(0), label=0, meta={}, **big)
    w.write(sample_key(3), label=0, meta={}, **a)
    with pytest.raises(ValueError, match="keys must increase"):
        w.write(sample_key(3), label=0, meta={}, **a)
    with pytest.raises(ValueError, match="same store and shape"):
        w.write(sample_key(4), label=0, meta={}, latent=a["mean"])
    rec = w.close()
    assert rec.samples == 1  # refused writes left no trace
    assert [s.key for s in iter_shard(str(tmp_path / shard_name(0)))] == ["000000003"]


def test_tar_lists_and_extracts_with_gnu_tar(tmp_path):
    _write(tmp_path / shard_name(0), range(2))
    out = subprocess.run(["tar", "-tf", str(tmp_path / shard_name(0))], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["000000000.cls", "000000000.json", "000000000.mean.npy", "000000000.std.npy",
                                  "000000001.cls", "000000001.json", "000000001.mean.npy", "000000001.std.npy"]
    assert out.stderr == ""


def test_plain_webdataset_reads_the_shards(tmp_path):
    import webdataset as wds

    m = make_set(tmp_path / "set")
    urls = m.shard_urls(str(tmp_path / "set"))
    with warnings.catch_warnings():  # webdataset's own advice to set shardshuffle; the plain call is the point
        warnings.simplefilter("ignore")
        samples = list(wds.WebDataset(urls).decode())
    assert sorted(s["__key__"] for s in samples) == [sample_key(g) for g in range(12) if g != 5]
    for s in samples:
        g = int(s["__key__"])
        assert isinstance(s["cls"], int) and s["cls"] == g % 3
        assert isinstance(s["mean.npy"], np.ndarray) and s["mean.npy"].dtype == np.float16
        assert np.array_equal(s["mean.npy"].astype(np.float32), arrays_for(g)["mean"])
        assert np.array_equal(s["std.npy"].astype(np.float32), arrays_for(g)["std"])
        assert s["json"]["path"].endswith(f"img{g}.JPEG")


def test_urls_file_and_pipe(tmp_path):
    m = make_set(tmp_path / "set", n=4, skipped=())
    path = tmp_path / "set" / shard_name(0)
    want = [s.key for s in iter_shard(str(path), m)]
    assert want == ["000000000", "000000001", "000000002", "000000003"]
    assert [s.key for s in iter_shard(f"file:{path}", m)] == want
    assert [s.key for s in iter_shard(f"pipe:cat '{path}'", m)] == want
    assert m.shard_urls("file:/data/set/") == ["file:/data/set/shard-000000.tar"]
    assert m.shard_urls("s3://bucket/set") == ["s3://bucket/set/shard-000000.tar"]
    with pytest.raises(ShardError) as e:
        list(iter_shard(f"pipe:cat '{tmp_path}/nope.tar'", m))
    assert e.value.url == f"pipe:cat '{tmp_path}/nope.tar'" and "read failed" in e.value.problem
    with pytest.raises(ShardError, match="cannot open"):
        list(iter_shard(str(tmp_path / "nope.tar")))


def test_stopping_early_closes_the_stream(tmp_path):
    m = make_set(tmp_path / "set", n=4, skipped=())
    it = iter_shard(f"pipe:cat '{tmp_path / 'set' / shard_name(0)}'", m)
    assert next(it).key == "000000000"
    it.close()  # no exception: the pipe's early end is not an error


@pytest.mark.parametrize("plant,problem", [
    (("000000001.mean.npy", "nan"), "mean.npy holds NaN or Inf"),
    (("000000001.std.npy", "inf1"), "std.npy holds NaN or Inf"),
    (("000000001.std.npy", "shape"), "std.npy has shape [2, 4, 4, 3], the manifest says [2, 4, 4, 4]"),
    (("000000001.std.npy", "dtype"), "std.npy has dtype <f4, the manifest says float16 (<f2)"),
    (("000000001.cls", b"7"), "label 7 out of range [0, 3)"),
    (("000000001.cls", b" 1\n"), "cls is not a non-negative ASCII integer: b' 1\\n'"),
    (("000000001.json", b"[1]"), None),
    (("000000001.std.npy", None), "missing field(s) std.npy (store 'posterior')"),
])
def test_reader_refuses_bad_samples_with_key(tmp_path, plant, problem):
    folder = tmp_path / "set"
    m = make_set(folder, n=4, skipped=())
    member, what = plant
    one_inf = np.ones((2, 4, 4, 4), np.float16)
    one_inf[1, 2, 3, 1] = -np.inf
    data = {"nan": npy(np.full((2, 4, 4, 4), np.nan, np.float16)), "shape": npy(np.zeros((2, 4, 4, 3), np.float16)),
            "dtype": npy(np.zeros((2, 4, 4, 4), np.float32)), "inf1": npy(one_inf)}.get(what, what)
    replace_member(folder, shard_name(0), member, data)
    url = str(folder / shard_name(0))
    if problem is None:  # meta is only parsed on request
        assert len(list(iter_shard(url, m))) == 4
        with pytest.raises(ShardError, match="json is not a JSON object"):
            list(iter_shard(url, m, with_meta=True))
        return
    for raw in (False, True):  # the trainer's raw path keeps every check
        with pytest.raises(ShardError) as e:
            list(iter_shard(url, m, raw=raw))
        assert (e.value.url, e.value.key, e.value.problem) == (url, "000000001", problem)


def test_reader_never_follows_links_or_unpickles(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (marker.touch, ())

    link = tarfile.TarInfo("000000000.mean.npy")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    cases = {
        "link": ([("000000000.cls", b"0"), (link, None)], "symbolic link member '000000000.mean.npy' refused"),
        "object": ([("000000000.cls", b"0"), ("000000000.json", b"{}"),
                    ("000000000.mean.npy", npy(np.array([Evil()], object))), ("000000000.std.npy", npy(np.zeros(1)))],
                   "mean.npy: pickle payload (NPY array of Python objects; refused, never unpickled)"),
        "pyd": ([("000000000.pyd", b"\x80\x04K\x01.")], "pickle payload member '000000000.pyd'"),
        "path": ([("../../000000000.cls", b"0")], "unsafe member name '../../000000000.cls'"),
    }
    for name, (members, problem) in cases.items():
        write_tar(tmp_path / f"{name}.tar", members)
        with pytest.raises(ShardError) as e:
            list(iter_shard(str(tmp_path / f"{name}.tar")))
        assert problem in e.value.problem, (name, e.value.problem)
    assert not marker.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.tar", "object.tar", "path.tar", "pyd.tar"]


def test_members_are_read_in_place_without_touching_disk(tmp_path):
    m = make_set(tmp_path / "set", n=4, skipped=())
    before = sorted(os.listdir(tmp_path / "set"))
    assert len(list(iter_shard(str(tmp_path / "set" / shard_name(0)), m))) == 4
    assert sorted(os.listdir(tmp_path / "set")) == before
    assert read_members(tmp_path / "set" / shard_name(0))[0] == ("000000000.cls", b"0")
    assert read_manifest(tmp_path / "set").shards[0].samples == 4
