#!/usr/bin/env bash
# Every GPU number BENCHMARKS.md asks for, in one process, within 8 minutes on one H100/H200 (bench/gpu.py).
# Run from the repository root. Results: ${OUT:-bench-gpu-out}/results.jsonl (one row per measurement, written
# as it is measured) and gpu.txt. Wheels in .whl/ (make gpu-wheels, for a machine without diffusers or
# webdataset) are installed into /tmp/site first. `bash bench/gpu.sh --smoke` checks the script on a CPU.
set -uo pipefail
out=${OUT:-bench-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "installing the carried wheels failed"; exit 2; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
# 450 s of sections (the script stops starting new ones after that) + start-up, inside a hard 480 s limit.
timeout -k 10 "${LIMIT:-480}" "$py" bench/gpu.py --out "$out" "$@" 2>&1 | tee "$out/log.txt"
exit "${PIPESTATUS[0]}"
