# gpumem developer entry points. Both targets do all the set-up they need on a fresh machine
# (Python 3.10+, node 20 for the front end) and are quick when run again.
#
#   make test   lint, type-check and run the whole test suite (CUDA tests skip without a GPU)
#   make demo   start JupyterLab on 127.0.0.1 with notebooks/demo.ipynb
#   make soak   the long reliability tests (1,000 cells under free(), a simulated 24 h session); minutes

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := test

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of this exact version is served from local disk; an unpinned torch would pull GBs.
TORCH_PIN ?= torch==2.13.0
ARTIFACTS ?= test-artifacts
PYTEST_ARGS ?=
DEMO_PORT ?= 8888

# Re-install when the package metadata or the front-end sources change (the editable install runs
# the front-end build through hatch-jupyter-builder).
JS_SOURCES := $(wildcard js/package.json js/tsconfig.json js/yarn.lock js/.yarnrc.yml) \
	$(shell find js/src js/style js/schema -type f 2>/dev/null)
INSTALLED := $(VENV)/.gpumem-installed
# This machine's pip configuration names partial local indexes; pip warns for each missing project.
PIP_NOISE := is ignored: it is neither a file nor a directory

.PHONY: test demo soak install chromium lint typecheck pytest clean

test: install chromium lint typecheck pytest

demo: install
	@if [ "$$(id -u)" = 0 ]; then root_flag=--allow-root; else root_flag=; fi; \
	exec $(VENV)/bin/jupyter lab --ip=127.0.0.1 --port=$(DEMO_PORT) $$root_flag notebooks/demo.ipynb

install: $(INSTALLED)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(INSTALLED): $(PY) pyproject.toml $(JS_SOURCES)
	$(PY) -m pip install -q -e ".[test]" "$(TORCH_PIN)" 2>&1 | { grep -v "$(PIP_NOISE)" || true; }
	@touch $@

# Debian's chromium drives the browser tests (Playwright's downloaded builds are not used).
chromium:
	@if ! command -v chromium >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then sudo=; \
	  elif command -v sudo >/dev/null 2>&1; then sudo="sudo -n"; \
	  else echo "chromium is missing and apt-get needs root: install the Debian package 'chromium'" >&2; exit 1; fi; \
	  echo "Installing chromium with apt-get"; \
	  $$sudo apt-get update -qq; \
	  DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq --no-install-recommends \
	    chromium fonts-liberation >/dev/null; \
	fi
	@command -v chromium >/dev/null

lint: install
	$(VENV)/bin/ruff check .

typecheck: install
	$(VENV)/bin/mypy

# No "|| true" anywhere: a failing test, or no test collected (exit 5), fails the target.
pytest: install
	@mkdir -p $(ARTIFACTS)
	GPUMEM_TEST_ARTIFACTS=$(abspath $(ARTIFACTS)) $(PY) -m pytest \
	  --junitxml=$(ARTIFACTS)/junit.xml $(PYTEST_ARGS)

# The soak tests skip themselves unless GPUMEM_SOAK=1 (a marker in addopts would override a user's -m).
soak: install
	@mkdir -p $(ARTIFACTS)
	GPUMEM_SOAK=1 GPUMEM_TEST_ARTIFACTS=$(abspath $(ARTIFACTS)) $(PY) -m pytest -m soak -s \
	  --junitxml=$(ARTIFACTS)/soak-junit.xml tests/reliability $(PYTEST_ARGS)

clean:
	rm -rf $(ARTIFACTS) .pytest_cache .mypy_cache .ruff_cache build dist
