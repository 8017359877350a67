"""bench/gpu.py --smoke: the GPU measuring script runs end to end on a CPU, every section writes its rows,
and no section fails (so the script is known to work before it meets a GPU)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_bench_smoke_writes_every_row(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--smoke", "--out", str(out)],
                       capture_output=True, text=True, timeout=900, cwd=ROOT)  # a hang guard only
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    names = [(row["section"], row["name"]) for row in rows]
    assert ("env", "machine") in names and names[-1] == ("env", "done")
    assert rows[-1]["errors"] == 0 and rows[-1]["skipped"] == 0, [r for r in rows if r["name"] in ("error", "skipped")]
    want = {("train", "fast-DiT-style fp16 eager"), ("train", "ours bf16 eager, attention auto"),
            ("train", "ours bf16 per-block compile, attention auto"), ("train", "memory-table row (eager)"),
            ("extract", "baseline fp32 batch 1, one view"), ("extract", "ours fp32 eager 2 view(s)"),
            ("extract", "ours fp32 compiled 2 view(s)"), ("repa", "teacher forward (tiny, no grad)"),
            ("repa", "plain flow step (no REPA)"), ("repa", "REPA step (teacher + projector + loss)")}
    assert want <= set(names), sorted(set(names))
    rates = [row.get("img_s") or row.get("encodes_s") or row.get("latents_s") for row in rows
             if row["section"] in ("train", "extract", "sample", "loader", "repa") and "row" not in row["name"]
             and "/" not in row["name"]]
    assert len(rates) >= 13 and all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in rates), rates
    sample = next(row for row in rows if row["section"] == "sample")
    assert sample["batch"] == 2 and sample["fid50k_hours"] > 0
    ratio = next(row for row in rows if row["name"] == "REPA step / plain step")
    assert ratio["time_ratio"] > 0 and ratio["flops_ratio"] > 1
    table = next(row for row in rows if row["name"] == "memory-table row (eager)")
    assert table["key"] == ["DiT-S/2", 8, "bf16", False, False] and set(table["peaks_gib"]) == {"1", "2", "4"}
