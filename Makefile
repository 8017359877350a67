# The set-up contract: `make demo` and `make test` work on a fresh machine with only Python.
# Override PYTHON to pick the interpreter, TORCH to choose the torch build ("" keeps whatever pip resolves).
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.14.1 torchvision==0.29.1
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: test test-reliability demo install bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml
	@if [ -n "$(TORCH)" ] && ! $(PY) -c "import torch, torchvision" 2>/dev/null; then \
		echo "installing $(TORCH)"; $(PY) -m pip install -q $(TORCH); fi
	$(PY) -m pip install -q -e ".[test,plot]"
	@touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The whole fault-injection suite: the representative subset that `make test` runs plus the sweep marked
# `reliability` (docs/RELIABILITY.md); under 20 minutes on 2 cores.
test-reliability: $(STAMP)
	$(PY) -m pytest -q --run-reliability tests/reliability $(PYTEST_ARGS)

demo: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) examples/demo.py $(DEMO_ARGS)

clean:
	rm -rf $(VENV) demo-out .pytest_cache
