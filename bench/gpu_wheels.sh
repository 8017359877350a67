#!/usr/bin/env bash
# Download the wheels that the GPU machine (Python 3.12, torch, no diffusers/webdataset/timm) lacks into .whl/,
# which bench/gpu.sh installs and the device tool carries (`carry: [".whl"]`). Versions: the ones this venv uses.
set -euo pipefail
py=${PYTHON:-.venv/bin/python}
mkdir -p .whl
for name in diffusers webdataset braceexpand importlib_metadata lazy-importer timm; do
    version=$("$py" -c "import importlib.metadata as m; print(m.version('$name'))")
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d .whl "$name==$version"
done
ls -l .whl
