"""verify_shards / quick_check: every corruption named in the issue is detected and named exactly."""
import json
import shutil
import tarfile

import numpy as np
import pytest

from dit_pipeline.shards import quick_check, read_manifest, shard_name, verify_shards
from dit_pipeline.shards.tario import end_of_archive
from tests.shards._helpers import edit_manifest, make_set, npy, read_members, refresh_record, replace_member, write_tar

S1, S2 = shard_name(1), shard_name(2)


@pytest.fixture
def folder(tmp_path):
    """Keys 0..11 (5 skipped), 4 per shard: shard 0 = 0-3, shard 1 = 4,6,7, shard 2 = 8-11."""
    make_set(tmp_path / "set")
    return tmp_path / "set"


def problems(folder, **kw):
    return verify_shards(folder, progress=False, **kw).problems


def test_clean_set_passes_full_and_quick(folder):
    for quick in (False, True):
        r = verify_shards(folder, quick=quick, progress=False)
        assert r.ok and r.problems == [] and (r.shards, r.samples) == (3, 11)
        assert r.bytes == sum(s.bytes for s in read_manifest(folder).shards)
        assert r.to_dict()["ok"] is True and r.to_dict()["problems"] == []
    assert quick_check(folder, read_manifest(folder)) == []


def test_truncated_shard(folder):
    rec = read_manifest(folder).shards[1]
    with open(folder / S1, "r+b") as f:
        f.truncate(3000)
    got = problems(folder)
    assert [f for f, _ in got] == [S1, S1, S1]
    assert got[0][1] == f"size 3000 bytes, the manifest says {rec.bytes}"
    assert got[1][1].startswith("sha256 mismatch: the file hashes to ")
    assert got[2][1] == "after sample 000000004: truncated: the archive ends inside member '000000004.mean.npy' (byte 3000)"
    quick = problems(folder, quick=True)
    assert quick[0] == (S1, f"size 3000 bytes, the manifest says {rec.bytes}") and "truncated" in quick[1][1]
    assert len(quick) == 2  # quick does not hash
    assert quick_check(folder, read_manifest(folder)) == [
        f"{S1}: 3000 bytes, the manifest says {rec.bytes} (truncated, replaced or still being written; "
        "run `dit-shards verify` for details)"]


def test_one_flipped_byte_in_data_and_in_a_header(folder):
    data = bytearray((folder / shard_name(0)).read_bytes())
    data[2560 + 200] ^= 0x01  # inside the first mean.npy's values: only the hash can tell
    (folder / shard_name(0)).write_bytes(bytes(data))
    got = problems(folder)
    assert len(got) == 1 and got[0][0] == shard_name(0)
    assert got[0][1].startswith("sha256 mismatch: the file hashes to ") and got[0][1].endswith(
        "(bit rot or a modified file)")
    assert problems(folder, quick=True) == []  # same size, valid structure: by design only hashing sees it
    data[2560 + 200] ^= 0x01
    data[2048 + 3] ^= 0x01  # the name field of the first mean.npy header
    (folder / shard_name(0)).write_bytes(bytes(data))
    got = problems(folder)
    assert got[1:] == [(shard_name(0), "after sample 000000000: corrupt member header at byte 2048 (checksum mismatch)")]


def test_missing_and_extra_shards_and_files(folder):
    (folder / S2).unlink()
    shutil.copy(folder / shard_name(0), folder / shard_name(3))
    (folder / "notes.txt").write_text("x")
    (folder / "junk").mkdir()
    for ignored in ("logs", ".extract"):
        (folder / ignored).mkdir()
    (folder / ".tmp-shard-000004.tar.abc").write_bytes(b"partial")
    assert problems(folder) == [
        (S2, "missing: listed in the manifest but not found"),
        ("junk", "extra folder not listed in the manifest"),
        ("notes.txt", "extra file not listed in the manifest"),
        (shard_name(3), "extra shard not listed in the manifest (from another run? move it away)"),
    ]
    assert quick_check(folder, read_manifest(folder)) == [
        f"{S2}: missing (listed in the manifest, not found in {folder})"]


def test_duplicate_key_across_shards(folder):
    key3 = [m for m in read_members(folder / shard_name(0)) if m[0].startswith("000000003.")]
    write_tar(folder / S1, key3 + read_members(folder / S1))
    refresh_record(folder, S1, samples=4, first_key="000000003")
    assert problems(folder) == [
        (S1, "sample 000000003: key outside this shard's range [000000004, 000000008) (samples_per_shard 4)"),
        (S1, "duplicate key 000000003: stored in shard-000000.tar and shard-000001.tar"),
        ("manifest.json", "1 keys in [0, 13) are neither stored nor listed as skipped: 000000012"),
    ]


def test_duplicate_key_within_a_shard(folder):
    members = read_members(folder / S1)
    write_tar(folder / S1, members + members[:4])
    refresh_record(folder, S1)
    assert problems(folder) == [(S1, "after sample 000000007: key 000000004 follows key 000000007: keys repeat "
                                     "or are out of order (duplicate sample or non-contiguous members)")]


def test_manifest_count_mismatch(folder):
    d = json.loads((folder / "manifest.json").read_text())
    d["shards"][0]["samples"] = 5
    (folder / "manifest.json").write_text(json.dumps(d))
    assert problems(folder) == [("manifest.json", f"{folder / 'manifest.json'}: invalid manifest: total_samples "
                                                  "is 11 but the shard records add up to 12")]
    edit_manifest(folder, total_samples=12)
    assert problems(folder) == [
        (shard_name(0), "holds 4 samples, the manifest says 5"),
        ("manifest.json", "1 keys in [0, 13) are neither stored nor listed as skipped: 000000012"),
    ]
    d["shards"][0]["samples"], d["shards"][0]["last_key"], d["total_samples"] = 4, "000000002", 11
    (folder / "manifest.json").write_text(json.dumps(d))
    assert problems(folder) == [(shard_name(0), "key range 000000000..000000003, the manifest says "
                                                "000000000..000000002")]


def test_skipped_key_that_is_stored(folder):
    d = json.loads((folder / "manifest.json").read_text())
    d["skipped"].append({"key": "000000000", "path": "cat/img0.JPEG", "reason": "bad"})
    (folder / "manifest.json").write_text(json.dumps(d))
    assert problems(folder) == [
        ("manifest.json", "key 000000000 is listed as skipped but is stored in a shard"),
        ("manifest.json", "1 keys in [0, 13) are neither stored nor listed as skipped: 000000012"),
    ]


def _append_member(folder, member, data=None):
    write_tar(folder / S2, read_members(folder / S2) + [(member, data)])
    refresh_record(folder, S2)


def _info(name, kind, **kw):
    info = tarfile.TarInfo(name)
    info.type = kind
    for k, v in kw.items():
        setattr(info, k, v)
    return info


@pytest.mark.parametrize("member,data,problem", [
    ("../evil.cls", b"0", "unsafe member name '../evil.cls' (a path, not a plain file name)"),
    ("/abs/000000012.cls", b"0", "unsafe member name '/abs/000000012.cls' (a path, not a plain file name)"),
    (_info("000000012.cls", tarfile.SYMTYPE, linkname="/etc/passwd"), None,
     "symbolic link member '000000012.cls' refused (a shard holds only regular files; links and devices are "
     "never followed)"),
    (_info("000000012.cls", tarfile.LNKTYPE, linkname="000000008.cls"), None, "hard link member '000000012.cls'"),
    (_info("000000012.cls", tarfile.CHRTYPE, devmajor=1, devminor=3), None, "character device member"),
    (_info("sub", tarfile.DIRTYPE), None, "directory member 'sub/' refused"),
    ("000000012.pyd", b"\x80\x04K\x01.", "pickle payload member '000000012.pyd' (refused, never unpickled)"),
    ("000000012.pickle", b"\x80\x04K\x01.", "pickle payload member '000000012.pickle' (refused, never unpickled)"),
])
def test_refused_members(folder, member, data, problem):
    if isinstance(member, str):
        _append_member(folder, member, data)
    else:
        write_tar(folder / S2, read_members(folder / S2) + [(member, data)])
        refresh_record(folder, S2)
    got = problems(folder)
    assert len(got) == 1 and got[0][0] == S2
    assert got[0][1].startswith("after sample 000000011: " + problem), got[0][1]


def test_huge_member_refused_before_reading(folder):
    members = b"".join(_raw(n, d) for n, d in read_members(folder / S2))
    big = tarfile.TarInfo("000000012.cls")
    big.size = 200 << 20
    data = members + big.tobuf(tarfile.USTAR_FORMAT) + b"1" * 512
    (folder / S2).write_bytes(data + end_of_archive(len(data)))
    refresh_record(folder, S2)
    assert problems(folder) == [(S2, "after sample 000000011: huge member '000000012.cls' (209715200 bytes > "
                                     "67108864) refused")]


def _raw(name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info.tobuf(tarfile.USTAR_FORMAT) + data + bytes(-len(data) % 512)


def test_trailing_data_after_end_of_archive(folder):
    with open(folder / S2, "ab") as f:
        f.write(b"junk")
    refresh_record(folder, S2)
    at = (folder / S2).stat().st_size - 4
    assert problems(folder) == [(S2, f"after sample 000000011: non-zero data after the end-of-archive marker "
                                     f"(byte {at})")]


@pytest.mark.parametrize("member,data,problem", [
    ("000000009.mean.npy", "nan", "sample 000000009: mean.npy holds NaN or Inf"),
    ("000000009.std.npy", "inf", "sample 000000009: std.npy holds NaN or Inf"),
    ("000000009.std.npy", "shape", "sample 000000009: std.npy has shape [2, 4, 4, 3], the manifest says [2, 4, 4, 4]"),
    ("000000009.std.npy", "dtype", "sample 000000009: std.npy has dtype <f4, the manifest says float16 (<f2)"),
    ("000000009.mean.npy", "object", "sample 000000009: mean.npy: pickle payload (NPY array of Python objects; "
                                     "refused, never unpickled)"),
    ("000000009.cls", b"3", "sample 000000009: label 3 out of range [0, 3)"),
    ("000000009.cls", b"-1", "sample 000000009: cls is not a non-negative ASCII integer: b'-1'"),
    ("000000009.json", b"{not json", "sample 000000009: json is not valid JSON"),
    ("000000009.std.npy", None, "sample 000000009: missing field(s) std.npy (store 'posterior')"),
    ("000000009.cls", None, "sample 000000009: missing field(s) cls (store 'posterior')"),
])
def test_bad_sample_contents(folder, tmp_path, member, data, problem):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (marker.touch, ())

    data = {"nan": npy(np.full((2, 4, 4, 4), np.nan, np.float16)),
            "inf": npy(np.full((2, 4, 4, 4), np.inf, np.float16)),
            "shape": npy(np.ones((2, 4, 4, 3), np.float16)), "dtype": npy(np.ones((2, 4, 4, 4), np.float32)),
            "object": npy(np.array([Evil()], object))}.get(data, data)
    replace_member(folder, S2, member, data)
    got = problems(folder)
    assert len(got) == 1 and got[0][0] == S2 and got[0][1].startswith(problem), got
    assert not marker.exists()
    # --quick reads headers only: it sees a missing field, not values.
    assert problems(folder, quick=True) == ([got[0]] if data is None else [])


def test_jobs_give_the_same_report(folder):
    (folder / shard_name(0)).unlink()
    replace_member(folder, S2, "000000009.cls", b"9")
    with open(folder / S1, "r+b") as f:
        f.truncate(4096)
    one = problems(folder, jobs=1)
    size = read_manifest(folder).shards[1].bytes
    assert [one[i] for i in (0, 1, 3, 4)] == [
        (shard_name(0), "missing: listed in the manifest but not found"),
        (S1, f"size 4096 bytes, the manifest says {size}"),
        (S1, "after sample 000000004: truncated: the archive ends at byte 4096, before the end-of-archive marker"),
        (S2, "sample 000000009: label 9 out of range [0, 3)"),
    ]
    assert one[2][0] == S1 and one[2][1].startswith("sha256 mismatch") and len(one) == 5
    assert problems(folder, jobs=2) == one


def test_missing_manifest_is_a_problem_not_a_crash(tmp_path):
    make_set(tmp_path / "set")
    (tmp_path / "set" / "manifest.json").unlink()
    got = problems(tmp_path / "set")
    assert len(got) == 1 and got[0][0] == "manifest.json" and "no manifest" in got[0][1]


def test_parallel_start_method(monkeypatch):
    import sys
    import types

    from dit_pipeline.shards.verify import _mp_context

    assert _mp_context().get_start_method() == "fork"
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert _mp_context().get_start_method() == "spawn"  # never fork a process holding CUDA state


def test_jobs_work_from_any_main_module(folder):
    import subprocess
    import sys

    code = f"from shards import verify_shards; r = verify_shards({str(folder)!r}, jobs=2, progress=False); print(r.ok)"
    out = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == "True\n", out.stderr
