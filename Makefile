# The set-up contract: `make demo` and `make test` work on a fresh machine with only Python.
# Override PYTHON to pick the interpreter, TORCH to choose the torch build ("" keeps whatever pip resolves).
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.14.1 torchvision==0.29.1
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# Test processes (pytest-xdist; whole files per process, so module fixtures are built once). The suite is mostly
# CLI subprocesses that spend seconds importing torch: 2 processes on 2 cores took it from 17 to 11 minutes.
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile

.PHONY: test typecheck test-reliability test-sweep test-min-deps test-determinism demo install bench clean gpu-wheels \
	cli-docs

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml
	@if [ -n "$(TORCH)" ] && ! $(PY) -c "import torch, torchvision" 2>/dev/null; then \
		echo "installing $(TORCH)"; $(PY) -m pip install -q $(TORCH); fi
	$(PY) -m pip install -q -e ".[test,plot]"
	@touch $(STAMP)

install: $(STAMP)

test: typecheck
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

# The type gate: mypy over dit/, train/ and shards/ (pyproject.toml [tool.mypy]). The package `dit_pipeline` is
# the repository root under another name, so mypy reads it through a link of that name inside the venv.
typecheck: $(STAMP)
	@mkdir -p $(VENV)/typecheck && ln -sfn "$(CURDIR)" $(VENV)/typecheck/dit_pipeline
	cd $(VENV)/typecheck && $(abspath $(PY)) -m mypy --config-file "$(CURDIR)/pyproject.toml"

# The whole fault-injection suite: the representative subset that `make test` runs plus the sweep marked
# `reliability` (docs/RELIABILITY.md); 23 minutes on the 2-core machine (2026-12-03: 177 tests).
test-reliability: $(STAMP)
	$(PY) -m pytest -q --run-reliability tests/reliability $(PYTEST_ARGS)

# The further cases of features that make test runs end to end once (other model families through the trainer)
test-sweep: $(STAMP)
	$(PY) -m pytest -q --run-sweep -m sweep $(XDIST) $(PYTEST_ARGS)

# The declared version floors, proven: a separate venv with every dependency of pyproject.toml (and the test and
# plot extras) pinned at exactly its `>=` minimum (tests/min_deps.py), then the suite. Torch's PyPI wheel is the
# CUDA build (5.5 GB installed; the venv took 5.5 minutes to build on 2 cores, 2.3-3 with a filled pip cache),
# see docs/install.md, "Version floors".
# MIN_PYTHON picks the venv's interpreter (e.g. python3.10, the requires-python floor); the host PYTHON only
# reads pyproject.toml (tomllib, Python >= 3.11).
MIN_VENV ?= .venv-min
MIN_PYTHON ?= $(PYTHON)
test-min-deps:
	rm -rf $(MIN_VENV)
	$(MIN_PYTHON) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/python -m pip install -q --upgrade pip
	$(PYTHON) tests/min_deps.py pyproject.toml test plot > $(MIN_VENV)/min-requirements.txt
	$(MIN_VENV)/bin/python -m pip install -q -r $(MIN_VENV)/min-requirements.txt
	$(MIN_VENV)/bin/python -m pip install -q --no-deps -e .
	$(MIN_VENV)/bin/python -m pip check
	$(MIN_VENV)/bin/python -m pip freeze | grep -iE '^(torch|torchvision|diffusers|numpy|webdataset)=='
	$(MIN_VENV)/bin/python -m pytest -q $(XDIST) $(PYTEST_ARGS)

# The bit-identity tests (marker `determinism`) again under other kernels: `make test` runs them with 1 thread
# in pytest and 1 per CLI process; here 2 and 2, then AVX2-only kernels. An identity that held only by one
# thread count's or one CPU's luck fails here (docs/RELIABILITY.md, "Determinism").
ISA_AVX2 := ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2
test-determinism: $(STAMP)
	OMP_NUM_THREADS=2 DIT_TEST_CLI_THREADS=2 $(PY) -m pytest -q -m determinism $(PYTEST_ARGS)
	$(ISA_AVX2) $(PY) -m pytest -q -m determinism $(PYTEST_ARGS)

demo: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) examples/demo.py $(DEMO_ARGS)

# The command-line reference, docs/cli/<command>.md, regenerated from the click commands (cli_docs.py); the suite
# fails while it is stale (tests/test_docs.py).
cli-docs: $(STAMP)
	$(PY) -m dit_pipeline.cli_docs

# Wheels the GPU machine lacks (diffusers, webdataset + deps) into .whl/ for `bash bench/gpu.sh` there.
gpu-wheels: $(STAMP)
	PYTHON=$(PY) bash bench/gpu_wheels.sh

clean:
	rm -rf $(VENV) $(MIN_VENV) demo-out .pytest_cache
