"""How `dit-eval` reads an ADM `.npz`: every byte once, counted by the kernel (/proc/self/io `rchar`: bytes
returned by read(2) and pread(2) of this process, whatever layer issued them), for stored (`np.savez`,
`dit-sample`) and compressed (`np.savez_compressed`) members, one rank or one of two; the pixels equal
np.load's."""
from __future__ import annotations

import logging
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.evaluate.features import source_features
from dit_pipeline.evaluate.inputs import open_source
from dit_pipeline.sample.plan import rank_batches

PROC_IO = Path("/proc/self/io")
pytestmark = pytest.mark.skipif(not PROC_IO.is_file(), reason="byte counting needs Linux's /proc/self/io")

N, SIZE, BATCH = 2000, 16, 64  # the batches of 64; 1.5 MB of pixels, 32 batches


def _rchar() -> int:
    return int(next(line for line in PROC_IO.read_text().splitlines() if line.startswith("rchar:")).split()[1])


def _images() -> np.ndarray:
    """Compressible pixels (smooth ramps plus a little noise), so the compressed file is smaller than the pixels."""
    rng = np.random.default_rng(0)
    ramp = (np.arange(SIZE)[None, :, None, None] * 8 + np.arange(N)[:, None, None, None]) % 256
    return (np.broadcast_to(ramp, (N, SIZE, SIZE, 3)) + rng.integers(0, 4, (N, SIZE, SIZE, 3))).astype(np.uint8)


@pytest.fixture(params=["stored", "compressed"])
def npz(request, tmp_path) -> tuple[Path, np.ndarray]:
    images = _images()
    path = tmp_path / f"{request.param}.npz"
    (np.savez_compressed if request.param == "compressed" else np.savez)(path, arr_0=images, arr_1=np.arange(N))
    with zipfile.ZipFile(path) as zf:
        kind = zf.getinfo("arr_0.npy").compress_type
    assert kind == (zipfile.ZIP_DEFLATED if request.param == "compressed" else zipfile.ZIP_STORED)
    return path, images


@pytest.mark.parametrize("world_size", [1, 2])
def test_each_rank_reads_each_byte_of_the_file_at_most_once(npz, world_size):
    path, images = npz
    size = path.stat().st_size
    src = open_source(path, "SAMPLES")
    compressed = "compressed" in path.name
    if compressed:
        assert size < 0.75 * images.nbytes
    for rank in range(world_size):
        batches = rank_batches(range(N), BATCH, rank, world_size)
        before = _rchar()
        with src.reader() as r:
            got = [r.read(b[0], b[-1] + 1) for b in batches]
        used = _rchar() - before
        mine = [i for b in batches for i in b]
        assert np.array_equal(np.concatenate(got), images[mine])
        assert used <= 1.05 * size, f"rank {rank}/{world_size} read {used / size:.2f}x the file's {size} bytes"
        if not compressed:  # a stored member: only this rank's own pixels (plus the zip directory and headers)
            assert used <= 1.05 * len(mine) * SIZE * SIZE * 3 + 65536, used


@pytest.mark.parametrize("use_cache", [False, True])
def test_feature_extraction_reads_the_npz_once_plus_the_cache_hash(npz, use_cache):
    """The whole `source_features` path (a stand-in network): one pass over the file; with the cache (the
    default) one more, the content hash that keys it."""
    path, images = npz
    size = path.stat().st_size

    class Stub(torch.nn.Module):
        def forward(self, x):
            self.seen.append(x.clone())
            n = x.shape[0]
            return {"pool": torch.zeros(n, 2048), "spatial": torch.zeros(n, 2023), "logits": torch.zeros(n, 1008)}

    model = Stub()
    model.seen = []
    src = open_source(path, "SAMPLES")
    before = _rchar()
    out = source_features(src, model, {"extractor": "stub", "weights": "none"}, batch_size=BATCH,
                          device=torch.device("cpu"), use_cache=use_cache, quiet=True, log=logging.getLogger("t"))
    used = _rchar() - before
    assert out["pool"].shape == (N, 2048)
    assert np.array_equal(torch.cat(model.seen).numpy(), images)
    assert used <= (2.05 if use_cache else 1.05) * size, f"read {used / size:.2f}x the file's {size} bytes"
    if not use_cache:
        assert not list(path.parent.glob(".*.features.npz"))


def test_a_member_shorter_than_its_header_says_is_named(tmp_path):
    """A header that claims more images than the member holds: the reader stops at the member's end (it never
    reads on into the next member or the zip directory) and names the missing images."""
    path = tmp_path / "short.npz"
    with zipfile.ZipFile(path, "w") as zf:
        with zf.open("arr_0.npy", "w") as f:
            np.lib.format.write_array_header_1_0(f, {"descr": "|u1", "fortran_order": False, "shape": (6, 2, 2, 3)})
            f.write(bytes(range(48)))  # 4 of the 6 images
        with zf.open("arr_1.npy", "w") as f:
            np.lib.format.write_array(f, np.arange(6))
    src = open_source(path, "SAMPLES")
    with src.reader() as r:
        assert r.read(0, 4).reshape(-1).tolist() == list(range(48))
        with pytest.raises(UserError, match=r"short.npz: arr_0 ends early \(images 3..5 missing\); the file is "
                                            r"truncated, write it again"):
            r.read(3, 6)


def test_label_sampling_comes_from_the_dit_sample_record_of_this_npz(tmp_path):
    """dit-eval reports how the classes were chosen from the record dit-sample writes beside the npz, only when
    that record is of an npz of as many samples; records from before --labels mean uniform or given classes."""
    import json

    np.savez(tmp_path / "s.npz", arr_0=np.zeros((5, 4, 4, 3), np.uint8), arr_1=np.array([0, 1, 1, 2, 2]))

    def record(**kw):
        fp = {"format": "dit-pipeline.samples", "num_samples": 5}
        (tmp_path / "s.npz.json").write_text(json.dumps({"fingerprint": fp, "config": {"class_labels": None}, **kw}))
        return open_source(tmp_path / "s.npz", "SAMPLES")

    assert open_source(tmp_path / "s.npz", "SAMPLES").label_sampling is None  # no record
    assert record(label_sampling="equal").label_sampling == "equal"
    assert record().label_sampling == "uniform"
    assert record(config={"class_labels": [1, 2]}).label_sampling == "given"
    (tmp_path / "s.npz.json").write_text(json.dumps({"fingerprint": {"format": "dit-pipeline.samples",
                                                                     "num_samples": 6}, "label_sampling": "equal"}))
    src = open_source(tmp_path / "s.npz", "SAMPLES")
    assert src.label_sampling is None  # a record of another npz
    assert src.class_counts == {"classes": 3, "min_per_class": 1, "max_per_class": 2}
    np.savez(tmp_path / "o.npz", arr_0=np.zeros((5, 4, 4, 3), np.uint8), arr_1=np.array(["a"] * 5, dtype=object))
    assert open_source(tmp_path / "o.npz", "SAMPLES").class_counts is None  # unreadable labels only add nothing
