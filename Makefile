# ultrascale: `make demo` installs what is missing and runs the main job; `make test` runs the suite.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH_CPU ?= torch==2.13.0

.PHONY: install test test-unit test-distributed test-integration chaos lint demo demo-resume bench proto clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Keeps a torch that is already importable (a CUDA build on GPU machines); otherwise installs the
# pinned CPU build, since a bare `torch` from PyPI pulls a multi-GB CUDA build.
install: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_CPU)" numpy
	$(PIP) install -q -e ".[dev]"
	@touch $(VENV)/.installed

$(VENV)/.installed: pyproject.toml | $(PY)
	$(MAKE) install

test: $(VENV)/.installed
	$(PY) -m pytest -q tests

test-unit: $(VENV)/.installed
	$(PY) -m pytest -q -m unit tests

test-distributed: $(VENV)/.installed
	$(PY) -m pytest -q -m distributed tests

test-integration: $(VENV)/.installed
	$(PY) -m pytest -q -m integration tests

# Every chaos scenario and a long random fault sequence (tests/chaos); prints the report table.
chaos: $(VENV)/.installed
	ULTRA_CHAOS=1 $(PY) -m pytest -q tests/chaos

lint: $(VENV)/.installed
	$(PY) -m ruff check .

demo: $(VENV)/.installed
	$(PY) -m examples.demo

demo-resume: $(VENV)/.installed
	$(PY) -m examples.resume_demo

proto: $(VENV)/.installed
	$(PY) -m proto.generate

bench: $(VENV)/.installed
	$(PY) -m bench.checkpoint

clean:
	rm -rf runs .pytest_cache .ruff_cache
