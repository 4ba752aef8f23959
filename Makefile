# Two commands on a fresh machine: `make demo` and `make test`. Everything they need is installed here:
# the virtualenv, the Python packages, the shim, and the control-plane binaries (cached outside the repo).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: all venv shim control-plane image lint chart-crds test suite unit e2e compat demo bench clean

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

# The oldest Kubernetes release the operator supports (scripts/control-plane's K8S_OLDEST_VERSION);
# the plane's default release is the current one (K8S_DEFAULT_VERSION there).
K8S_OLDEST_VERSION := $(shell sed -n 's/^K8S_OLDEST_VERSION=//p' scripts/control-plane)

# Both releases' binaries, each cached in its own ~/.cache/mig-operator/k8s/<version> (the real node,
# `build --with node`, only for the current one: tests/node builds it when it runs).
control-plane:
	scripts/control-plane build
	MIG_OPERATOR_K8S_VERSION=$(K8S_OLDEST_VERSION) scripts/control-plane build

# The Dockerfile built without a daemon (buildah, chroot isolation) on a Debian-made Python base, and the
# node tests' workload image: OCI archives in build/image/, cached by content under ~/.cache/mig-operator/image
# (scripts/image says how; docs/control-plane.md has the times and sizes).
image:
	scripts/image build

lint: venv
	$(BIN)/ruff check mig_operator tests bench
	$(BIN)/lint-imports --no-cache
	$(BIN)/hadolint Dockerfile

# crds/ is the one source of the CRDs; the chart carries copies: the operator's own in files/crds/ (rendered by
# templates/crds.yaml, so that upgrades update them), the peering CRD in crds/ (installed once, shared with other
# kopf operators).
# tests/helm fails when they differ: run this after changing a CRD. The DeviceClass is a chart template.
chart-crds:
	for f in crds/*.yaml; do case "$$f" in crds/device-class.yaml) ;; crds/peering.yaml) cp "$$f" helm/mig-operator/crds/;; \
	  *) cp "$$f" helm/mig-operator/files/crds/;; esac; done

# pytest-xdist workers for the suite and for `make compat`, which `make test` runs side by side. The e2e
# tests mostly wait on the API server and the operator's processes, so a 2-core machine runs several at
# once; each worker starts its own private control plane (tests/conftest.py says which tests stay together).
TEST_WORKERS ?= 5
COMPAT_WORKERS ?= 2
XDIST = --dist loadgroup -n

# Every test: shim's GPU-free C tests, lint, then pytest (unit, shim, e2e against a real kube-apiserver
# of the current release; tests/gpu skip where no GPU is present) beside the compatibility run on the
# oldest release, each one's output printed whole when it ends. pytest's exit 5 (no tests collected)
# fails the target.
test: venv shim control-plane
	$(MAKE) -C shim test
	$(MAKE) lint
	$(MAKE) --no-print-directory --output-sync=target -j2 suite compat

# pytest over every folder (the first half of `make test`); the tests marked `alone` after the others.
suite: venv
	$(BIN)/pytest $(XDIST) $(TEST_WORKERS) -m "not alone"
	$(BIN)/pytest -m alone tests/e2e

unit: venv
	$(BIN)/pytest tests/unit

e2e: venv control-plane
	$(BIN)/pytest tests/e2e

# The e2e tests marked `compat` (DRA, pods, tenants) on a plane of the oldest supported release, in a
# private state dir of its own (a kept or named plane would be the current release's).
compat: venv control-plane
	@test -n "$(K8S_OLDEST_VERSION)" || { echo "no K8S_OLDEST_VERSION=vX.Y.Z line in scripts/control-plane" >&2; exit 1; }
	env -u MIG_OPERATOR_RUN -u MIG_OPERATOR_KEEP_CLUSTER MIG_OPERATOR_K8S_VERSION=$(K8S_OLDEST_VERSION) \
		$(BIN)/pytest $(XDIST) $(COMPAT_WORKERS) -m compat tests/e2e

# The main job: the operator on a local control plane with simulated GPUs (scripts/demo says what it shows).
# The first run builds only what the demo starts (kube-apiserver, etcd, kubectl, kube-scheduler,
# kube-controller-manager, kwok; progress printed); with those cached, a run took 54 s on 2 cores.
demo: venv
	$(BIN)/python scripts/demo

bench: venv
	$(BIN)/python bench/packing.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
	-$(MAKE) -C shim clean

# Mutation testing of core/ against tests/unit (docs/testing.md: the command, the time it takes, the
# score and every surviving mutant). Slow, so neither `make test` nor CI runs it. mutmut, from the
# `mutation` extra, runs in build/mutation, a copy of the package and of tests/unit in which:
#  - core/'s decorated functions are undecorated, the decorator applied by assignment after the function
#    (`f = lru_cache(maxsize=64)(f)`), because mutmut leaves decorated functions alone;
#  - a conftest empties core's caches before each test, so mutmut's record of which tests reach a
#    function (it runs only those on that function's mutants) misses no test behind a cache hit, and
#    sets hypothesis to keep no example database and not to shrink.
# MUTANTS='mig_operator.core.placement.planner.*' limits a run to one module's mutants (mutmut's name patterns).
.PHONY: mutation
MUTATION_DIR := build/mutation
MUTATION_STAMP := $(VENV)/.mutation-installed
MUTANTS ?=

$(MUTATION_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[test,mutation]'
	touch $(MUTATION_STAMP)

define UNDECORATE
import ast, sys
for path in sys.argv[1:]:
    lines = open(path).read().splitlines(keepends=True)
    edits = []
    for node in ast.walk(ast.parse("".join(lines))):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or not node.decorator_list:
            continue
        names = [ast.unparse(d) for d in node.decorator_list]
        if names in (["staticmethod"], ["classmethod"]):
            continue
        wrapped = node.name
        for name in reversed(names):
            wrapped = "(" + name + ")(" + wrapped + ")"
        first = node.decorator_list[0].lineno - 1
        edits.append((node.end_lineno, 0, [" " * node.col_offset + node.name + " = " + wrapped + "\n"]))
        edits.append((first, node.lineno - 1 - first, []))
        print(path + ": " + node.name + " = " + wrapped)
    for at, count, new in sorted(edits, reverse=True):
        lines[at:at + count] = new
    open(path, "w").write("".join(lines))
endef
export UNDECORATE

define COLD_CACHES
"""Written by make mutation (see the Makefile): core's caches start empty for every test; hypothesis
keeps no example database (a mutant's verdict must not depend on earlier mutants) and does not shrink
a failing example (a killed mutant needs no minimal example)."""
import pytest
from hypothesis import Phase, settings

from mig_operator.core.placement import cluster, planner

settings.register_profile("mutation", database=None, deadline=None, phases=[Phase.explicit, Phase.generate])
settings.load_profile("mutation")


@pytest.fixture(autouse=True)
def _cold_core_caches():
    for module in (cluster, planner):
        for value in vars(module).values():
            if hasattr(value, "cache_clear"):
                value.cache_clear()
endef
export COLD_CACHES

mutation: $(MUTATION_STAMP)
	rm -rf $(MUTATION_DIR) && mkdir -p $(MUTATION_DIR)/tests
	cp -r mig_operator examples pyproject.toml $(MUTATION_DIR)/
	cp -r tests/unit tests/corpus $(MUTATION_DIR)/tests/
	cp tests/seed_examples.py tests/slice_spec_reference.py $(MUTATION_DIR)/tests/
	$(BIN)/python -c "$$UNDECORATE" $(MUTATION_DIR)/mig_operator/core/*/*.py
	printf '%s\n' "$$COLD_CACHES" > $(MUTATION_DIR)/tests/conftest.py
	cd $(MUTATION_DIR) && start=$$(date +%s) && nice -n 19 $(CURDIR)/$(BIN)/mutmut run $(MUTANTS); \
		code=$$?; echo "==> mutmut run: $$(( $$(date +%s) - start )) s"; exit $$code
	cd $(MUTATION_DIR) && $(CURDIR)/$(BIN)/mutmut results
