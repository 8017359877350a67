"""Names, keys and member-name rules (shards.format) and the NPY encoding (shards.npy)."""
import io
import pickle

import numpy as np
import pytest
import torch

from dit_pipeline.shards import ShardError, key_index, sample_key, shard_index, shard_name
from dit_pipeline.shards.format import split_member
from dit_pipeline.shards.npy import all_finite, decode_raw, encode_array, from_bfloat16_bits, npy_header, to_bfloat16_bits, widen


def test_names_and_keys():
    assert shard_name(0) == "shard-000000.tar" and shard_name(123) == "shard-000123.tar"
    assert shard_name(1_234_567) == "shard-1234567.tar"
    assert shard_index("shard-000123.tar") == 123 and shard_index("shard-1234567.tar") == 1_234_567
    for bad in ("shard-123.tar", "shard-0000123.tar", "shard-000001.tar.gz", "x.tar", "shard-00000a.tar"):
        assert shard_index(bad) is None, bad
    assert sample_key(1234) == "000001234" and sample_key(0) == "000000000"
    assert sample_key(1_234_567_890) == "1234567890"
    assert key_index("000001234") == 1234 and key_index("1234567890") == 1_234_567_890
    for bad in ("1234", "0000001234", "00000123a", "", "٠٠٠٠٠٠٠٠١", None):
        with pytest.raises(ValueError, match="not a sample key"):
            key_index(bad)
    with pytest.raises(ValueError):
        sample_key(-1)


@pytest.mark.parametrize("name,message", [
    ("../000000001.cls", "unsafe member name '../000000001.cls' (a path, not a plain file name)"),
    ("/etc/passwd", "unsafe member name '/etc/passwd' (a path, not a plain file name)"),
    ("a/000000001.cls", "unsafe member name 'a/000000001.cls' (a path, not a plain file name)"),
    ("000000001..cls", "unsafe member name '000000001..cls' (contains '..')"),
    ("000000001.cls\n", "unsafe member name '000000001.cls\\n' (control or non-ASCII characters)"),
    ("000000001.pyd", "pickle payload member '000000001.pyd' (refused, never unpickled)"),
    ("000000001.pickle", "pickle payload member '000000001.pickle' (refused, never unpickled)"),
    ("000000001.txt", "unexpected member '000000001.txt'"),
    ("1.cls", "unexpected member '1.cls'"),
    ("0000000001.cls", "unexpected member '0000000001.cls' (key is not a canonical zero-padded index)"),
])
def test_member_names_refused(name, message):
    with pytest.raises(ValueError) as e:
        split_member(name)
    assert str(e.value).startswith(message)


def test_member_names_accepted():
    assert split_member("000000007.cls") == ("000000007", "cls")
    assert split_member("000000007.mean.npy") == ("000000007", "mean.npy")
    assert split_member("1234567890.latent.npy") == ("1234567890", "latent.npy")


def test_shard_error_names_url_key_problem_and_pickles():
    e = ShardError("s3://b/shard-000001.tar", "000000004", "label 9 out of range [0, 3)")
    assert (e.url, e.key, e.problem) == ("s3://b/shard-000001.tar", "000000004", "label 9 out of range [0, 3)")
    assert str(e).startswith("shard s3://b/shard-000001.tar, sample 000000004: label 9 out of range [0, 3)")
    e2 = pickle.loads(pickle.dumps(e))  # crosses process boundaries (DataLoader workers, verify jobs)
    assert (e2.url, e2.key, e2.problem, str(e2)) == (e.url, e.key, e.problem, str(e))


@pytest.mark.parametrize("shape", [(2, 4, 32, 32), (1, 4, 8, 8), (2, 16, 64, 64), (5,), (3, 1000)])
@pytest.mark.parametrize("storage", ["<f2", "<f4", "<u2"])
def test_npy_header_is_valid_npy_1_0(shape, storage):
    ours = npy_header(storage, shape)
    assert ours[:8] == b"\x93NUMPY\x01\x00" and len(ours) % 64 == 0 and ours.endswith(b"\n")
    arr = (np.arange(int(np.prod(shape))) % 1000).reshape(shape).astype(storage)
    b = io.BytesIO()
    np.save(b, arr)
    # For these shapes today's numpy writes the very same header; ours stays fixed whatever numpy does.
    assert ours == b.getvalue()[:-arr.nbytes]
    back = np.lib.format.read_array(io.BytesIO(ours + arr.tobytes()), allow_pickle=False)
    assert back.dtype == arr.dtype and np.array_equal(back, arr)


def test_encode_decode_round_trip_exact():
    x = np.random.default_rng(0).standard_normal((2, 4, 3, 5)).astype(np.float32) * 10
    back32 = widen(decode_raw(encode_array(x, "float32")), "float32")
    assert back32.dtype == np.float32 and np.array_equal(back32, x)
    back16 = widen(decode_raw(encode_array(x, "float16")), "float16")
    assert np.array_equal(back16, x.astype(np.float16).astype(np.float32))
    raw_bf = decode_raw(encode_array(x, "bfloat16"))
    assert raw_bf.dtype == np.dtype("<u2")
    expect = torch.from_numpy(x).to(torch.bfloat16).float().numpy()  # torch rounds to nearest even
    assert np.array_equal(widen(raw_bf, "bfloat16"), expect)
    assert np.load(io.BytesIO(encode_array(x, "float16")), allow_pickle=False).dtype == np.float16


def test_bfloat16_rounding_ties_to_even_and_exact_widening():
    bits = np.array([0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F80FFFF, 0x00000001, 0x80000000], np.uint32)
    x = bits.view(np.float32)
    got = to_bfloat16_bits(x)
    assert got.tolist() == [0x3F80, 0x3F82, 0x3F80, 0x3F81, 0x0000, 0x8000]
    assert torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).tolist() == got.tolist()
    every = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16)
    wide = from_bfloat16_bits(every)
    assert np.array_equal(wide.view(np.uint32) >> 16, every.astype(np.uint32))


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_all_finite_on_stored_bits(dtype):
    big = {"float16": 65504.0, "float32": 3.4028235e38, "bfloat16": 3.3895314e38}[dtype]
    ok = np.array([0.0, -0.0, 1e-8, -big, big, 1.5], np.float32)
    raw = decode_raw(encode_array(ok, dtype))
    assert all_finite(raw)
    for bad in (np.inf, -np.inf, np.nan):
        x = ok.copy()
        x[3] = bad
        stored = x.astype(np.float16) if dtype == "float16" else x
        raw = (to_bfloat16_bits(stored) if dtype == "bfloat16" else stored).astype(raw.dtype.str)
        assert not all_finite(raw), (dtype, bad)


def test_decode_refuses_pickle_fortran_and_bad_length(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (marker.touch, ())

    b = io.BytesIO()
    np.save(b, np.array([Evil()], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="pickle payload"):
        decode_raw(b.getvalue())
    assert not marker.exists()
    f = io.BytesIO()
    np.save(f, np.asfortranarray(np.zeros((3, 2), np.float16)))
    with pytest.raises(ValueError, match="Fortran-ordered"):
        decode_raw(f.getvalue())
    good = encode_array(np.zeros((1, 2, 2, 2)), "float16")
    with pytest.raises(ValueError, match="NPY data is 14 bytes, header <f2\\[1, 2, 2, 2\\] needs 16"):
        decode_raw(good[:-2])
    with pytest.raises(ValueError, match="bad magic"):
        decode_raw(b"PK\x03\x04" + good[4:])
