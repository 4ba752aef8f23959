# Two commands on a fresh machine: `make demo` and `make test`. Everything they need is installed here:
# the virtualenv, the Python packages, the shim, and the control-plane binaries (cached outside the repo).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: all venv shim control-plane lint chart-crds test unit e2e demo bench clean

all: test

$(STAMP): pyproject.toml
	@echo "==> creating $(VENV) and installing mig-operator with its test dependencies"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

shim:
	$(MAKE) -C shim

control-plane:
	scripts/control-plane build

lint: venv
	$(BIN)/ruff check mig_operator tests bench
	$(BIN)/lint-imports --no-cache
	$(BIN)/hadolint Dockerfile

# crds/ is the one source of the CRDs; the chart carries copies (Helm installs only files in its crds/).
# tests/helm fails when they differ: run this after changing a CRD. The policy is a chart template.
chart-crds:
	for f in crds/*.yaml; do [ "$$f" = crds/slice-node-label.yaml ] || cp "$$f" helm/mig-operator/crds/; done

# Every test: shim's GPU-free C tests, lint, then pytest (unit, shim, e2e against a real kube-apiserver;
# tests/gpu skip where no GPU is present). pytest's exit 5 (no tests collected) fails the target.
test: venv shim control-plane
	$(MAKE) -C shim test
	$(MAKE) lint
	$(BIN)/pytest

unit: venv
	$(BIN)/pytest tests/unit

e2e: venv control-plane
	$(BIN)/pytest tests/e2e

# The main job: the operator on a local control plane with simulated GPUs (scripts/demo says what it shows).
# The first run builds the control plane (about 9 minutes on 2 cores, progress printed); later runs take ~30 s.
demo: venv
	$(BIN)/python scripts/demo

bench: venv
	$(BIN)/python bench/packing.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
	-$(MAKE) -C shim clean
