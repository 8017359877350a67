#!/usr/bin/env bash
# One prepared pass of every GPU measurement BENCHMARKS.md asks for (about 8 minutes on one H100/H200).
# Run from the repository root with a Python that has torch (CUDA), diffusers, webdataset, click installed
# and this package importable (e.g. PYTHONPATH=.); results go to ${OUT:-bench-gpu-out}/ as logs.
# Order: cheapest and most important first, so a cut-off run still yields the headline numbers.
set -uo pipefail
out=${OUT:-bench-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
run() { local name=$1; shift; echo "=== $name: $*"; timeout "${LIMIT:-240}" "$py" "$@" 2>&1 | tee "$out/$name.log"; }
# 1. DiT-XL/2 256px training step: images/s, TFLOP/s, MFU, peak memory (goal >= 50% MFU).
run model-xl2 bench/model.py --model DiT-XL/2 --batch 32 64 --precision bf16 --compile off on --repeat 2
# 2. bf16 numerics of the model output vs fp32.
run numerics bench/model.py --numerics --model DiT-XL/2 --batch 8
# 3. The full trainer step (DDP wrapper, AMP, EMA) vs a reference-style loop.
run train-xl2 bench/train.py --models DiT-XL/2 --input-size 32 --batch 32 64 --precision bf16 --compile off on
# 4. Extraction: our pipeline vs the one-image fp32 baseline, and the encoder precision comparison.
run extract bench/extract.py --images 1024 --num-workers 16 --precision-compare
# 5. Sampling: DDPM-250 / DDIM-50 with CFG, ours vs the reference loop; hours for 50K.
run sample-xl2 bench/sample.py --model DiT-XL/2 --input-size 32 --batch 64 --precision bf16 --compile --repeat 1
