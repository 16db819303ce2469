# ultrascale: `make demo` installs what is missing and runs the main job; `make test` runs the suite.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH_CPU ?= torch==2.13.0
# The one version: pyproject's. Images are tagged with it; deploy/k8s references that tag.
VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml | head -n 1)
IMAGE   ?= ultrascale/ultrad
ENGINE  ?= $(shell command -v podman 2>/dev/null || command -v docker 2>/dev/null)
CUDA_BASE ?= docker.io/pytorch/pytorch:2.13.0-cuda12.8-cudnn9-devel
CPU_BASE  ?= docker.io/library/python:3.11-slim-bookworm
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: image image-cpu image-tag k8s-rules install test test-unit test-distributed test-integration chaos lint demo demo-resume bench proto clean

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

# Two pytest processes, whole files each: the suite waits on etcd leases, process starts and
# timeouts as much as it computes (tests/README.md). Tests marked `alone` compare wall-time
# measurements, which the other process's ranks would skew: they run after, by themselves.
TEST_WORKERS ?= 2
test: $(VENV)/.installed
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=30 -m "not alone" tests
	$(PY) -m pytest -q -m alone tests

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

# Container images (deploy/container): podman or docker, whichever is installed (ENGINE=...).
image:
	@test -n "$(ENGINE)" || { echo "make image: neither podman nor docker is installed; install one, or set ENGINE=/path/to/engine" >&2; exit 2; }
	$(ENGINE) build -f deploy/container/Containerfile --build-arg BASE=$(CUDA_BASE) \
		--build-arg VERSION=$(VERSION) -t $(IMAGE):$(VERSION) .

image-cpu:
	@test -n "$(ENGINE)" || { echo "make image-cpu: neither podman nor docker is installed; install one, or set ENGINE=/path/to/engine" >&2; exit 2; }
	$(ENGINE) build -f deploy/container/Containerfile.cpu --build-arg BASE=$(CPU_BASE) \
		--build-arg TORCH=$(TORCH_CPU) --build-arg TORCH_INDEX=$(TORCH_INDEX) \
		--build-arg VERSION=$(VERSION) -t $(IMAGE):$(VERSION)-cpu .

# The tag `make image` gives (deploy/k8s/kustomization.yaml's images: entry must name it).
image-tag:
	@echo $(IMAGE):$(VERSION)

# deploy/k8s/monitoring/prometheusrule.yaml from deploy/prometheus/*.rules.yml.
k8s-rules: $(VENV)/.installed
	$(PY) deploy/k8s/monitoring/render_rules.py > deploy/k8s/monitoring/prometheusrule.yaml

clean:
	rm -rf runs .pytest_cache .ruff_cache
