"""Benchmark: `dit-shards verify` throughput beside `sha256sum` on the same files, in the same run.

Builds (or reuses) a synthetic shard set shaped like ImageNet 256px posterior latents (2 views of
[4, 32, 32], float16: ~36 KiB per sample), reads it once so every contender hashes from the page cache,
then times, interleaved and repeated (median reported):

  sha256sum        coreutils, one process over all shards (the reference rate); also N processes over
                   disjoint files, the machine's own ceiling for --jobs N
  openssl dgst     another single-core sha256 (informative)
  hashlib          Python's sha256 over each file (the floor for our full verify)
  verify jobs=N    shards.verify_shards, full (sha256 + tar structure + every array, label, JSON)
  verify --quick   sizes and tar structure only
  iter_shard       decoding rate of the training reader (samples/s, one process)

    python bench/verify.py                       # 16 shards x 2000 samples (~1.1 GiB) in a temp folder
    python bench/verify.py --shards 8 --samples-per-shard 500 --jobs 1 2 4 --repeat 5 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_checkout  # noqa: E402

use_checkout()  # run from a checkout without installing

import numpy as np

from dit_pipeline.common.io import sha256_file
from dit_pipeline.shards import FORMAT_VERSION, Manifest, ShardWriter, iter_shard, sample_key, shard_name, verify_shards, write_manifest


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="shard folder to build or reuse (default: a temp folder, removed)")
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--samples-per-shard", type=int, default=2000)
    p.add_argument("--latent", type=int, nargs=3, default=[4, 32, 32], metavar=("C", "H", "W"))
    p.add_argument("--views", type=int, default=2)
    p.add_argument("--dtype", default="float16", choices=["float16", "float32", "bfloat16"])
    p.add_argument("--jobs", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeat", type=int, default=3, help="interleaved rounds; medians are reported")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    return p.parse_args(argv)


def build(folder: Path, a: argparse.Namespace) -> Manifest:
    """A shard set of random posterior latents (the bytes, not the values, are what is measured)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    shape = (a.views, *a.latent)
    records = []
    for s in range(a.shards):
        with ShardWriter(folder / shard_name(s), dtype=a.dtype) as w:
            for g in range(s * a.samples_per_shard, (s + 1) * a.samples_per_shard):
                mean = rng.standard_normal(shape, dtype=np.float32)
                w.write(sample_key(g), label=g % 1000, meta={"path": f"n{g % 1000:08d}/img{g}.JPEG",
                                                            "class": f"n{g % 1000:08d}", "size": [500, 375]},
                        mean=mean, std=np.abs(mean) * 0.1 + 0.01)
        records.append(w.record)
    m = Manifest(format_version=FORMAT_VERSION, tool_version="bench", extraction={"vae": {"source": "synthetic"}},
                 scaling_factor=0.18215, shift_factor=None, image_size=8 * a.latent[1], views=a.views,
                 store="posterior", dtype=a.dtype, latent_shape=list(a.latent),
                 class_names=[f"n{i:08d}" for i in range(1000)], num_classes=1000,
                 total_samples=a.shards * a.samples_per_shard, samples_per_shard=a.samples_per_shard,
                 shards=records, skipped=[])
    write_manifest(folder, m)
    return m


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process and its finished children): on a shared machine the
    CPU time is the fair per-core measure, the wall time what a user waits."""
    def cpu() -> float:
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    c0, t0 = cpu(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, cpu() - c0


def contenders(folder: Path, m: Manifest, jobs: list[int]) -> dict:
    files = [str(folder / s.name) for s in m.shards]

    def run(cmd: list[str]) -> None:
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)

    def verify(**kw):
        def go():
            r = verify_shards(folder, progress=False, **kw)
            assert r.ok, r.problems[:3]
        return go

    def decode():
        n = sum(1 for u in m.shard_urls(str(folder))[:2] for _ in iter_shard(u, m))
        assert n == 2 * m.samples_per_shard or n == m.total_samples

    def parallel_sha256sum(j: int):
        def go():  # the machine's own scaling ceiling: j sha256sum processes over disjoint files
            procs = [subprocess.Popen(["sha256sum", *files[i::j]], stdout=subprocess.DEVNULL) for i in range(j)]
            assert all(p.wait() == 0 for p in procs)
        return go

    out = {"sha256sum": lambda: run(["sha256sum", *files])}
    for j in jobs:
        if j > 1:
            out[f"sha256sum x{j} processes"] = parallel_sha256sum(j)
    if shutil.which("openssl"):
        out["openssl dgst -sha256"] = lambda: run(["openssl", "dgst", "-sha256", *files])
    out["hashlib sha256 (python)"] = lambda: [sha256_file(f) for f in files]
    for j in jobs:
        out[f"verify --jobs {j}"] = verify(jobs=j)
    out["verify --quick"] = verify(quick=True)
    out["iter_shard decode"] = decode
    return out


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    tmp = None if a.dir else tempfile.mkdtemp(prefix="bench-verify-")
    folder = Path(a.dir or tmp)
    try:
        from dit_pipeline.shards import read_manifest

        m = read_manifest(folder) if (folder / "manifest.json").is_file() else build(folder, a)
        for s in m.shards:  # into the page cache: every contender then hashes the same cached bytes
            with open(folder / s.name, "rb") as f:
                while f.read(1 << 22):
                    pass
        import webdataset  # noqa: F401  (the reader's url opener; its import time is not decoding)

        fns = contenders(folder, m, a.jobs)
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in fns}
        for fn in fns.values():  # one untimed round: imports, worker start-up code paths, caches
            fn()
        for _ in range(a.repeat):
            for name, fn in fns.items():
                times[name].append(timed(fn))
        med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
        report(a, m, med)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def report(a: argparse.Namespace, m: Manifest, t: dict[str, tuple[float, float]]) -> None:
    total = m.total_bytes
    decoded = min(2, len(m.shards)) * m.samples_per_shard
    ref_wall, ref_cpu = (total / x for x in t["sha256sum"])
    rows = []
    for name, (wall, cpu) in t.items():
        n = decoded if name == "iter_shard decode" else m.total_samples
        row = {"name": name, "wall_s": wall, "cpu_s": cpu, "samples_per_s": n / wall,
               "samples_per_cpu_s": n / cpu}
        if name != "iter_shard decode":
            row.update(MB_per_s=total / wall / 1e6, MB_per_cpu_s=total / cpu / 1e6,
                       vs_sha256sum=total / wall / ref_wall, per_cpu_vs_sha256sum=total / cpu / ref_cpu)
        rows.append(row)
    print(f"{len(m.shards)} shards, {m.total_samples} samples, {total / 2**20:.0f} MiB, {a.dtype} "
          f"[{a.views}, {', '.join(map(str, a.latent))}]; {platform.machine()}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.2f}; median of {a.repeat}")
    print(f"{'contender':24s} {'wall s':>7s} {'MB/s':>6s} {'x sha256sum':>11s} {'CPU s':>6s} {'MB/CPU-s':>8s} "
          f"{'x sha256sum':>11s} {'samples/s':>9s}")
    for r in rows:
        if "MB_per_s" in r:
            print(f"{r['name']:24s} {r['wall_s']:7.2f} {r['MB_per_s']:6.0f} {r['vs_sha256sum']:11.2f} "
                  f"{r['cpu_s']:6.2f} {r['MB_per_cpu_s']:8.0f} {r['per_cpu_vs_sha256sum']:11.2f} "
                  f"{r['samples_per_s']:9.0f}")
        else:
            print(f"{r['name']:24s} {r['wall_s']:7.2f} {'':6s} {'':11s} {r['cpu_s']:6.2f} {'':8s} {'':11s} "
                  f"{r['samples_per_s']:9.0f}  ({r['samples_per_cpu_s']:.0f} per CPU-s)")
    base = t.get(f"verify --jobs {a.jobs[0]}")
    scaling = {j: base[0] / t[f"verify --jobs {j}"][0] for j in a.jobs} if base else {}
    if len(scaling) > 1:
        print("verify --jobs wall-clock speed-up: " + ", ".join(f"{j} jobs {s:.2f}x" for j, s in scaling.items()))
        ceiling = {j: t["sha256sum"][0] / t[f"sha256sum x{j} processes"][0] for j in a.jobs if j > 1}
        print("sha256sum, same split, for comparison: " + ", ".join(f"{j} processes {s:.2f}x"
                                                                   for j, s in ceiling.items()))
        scaling = {"verify": scaling, "sha256sum": ceiling}
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "scaling": scaling, "bytes": total,
                                            "samples": m.total_samples, "load": os.getloadavg()[0],
                                            "argv": sys.argv[1:]}, indent=2))


if __name__ == "__main__":
    main()
