# gpumem developer entry points. Both targets do all the set-up they need on a fresh machine
# (Python 3.10+, node 20 for the front end) and are quick when run again.
#
#   make test   lint, type-check and run the whole test suite (CUDA tests skip without a GPU), and the
#               front end's unit tests (js/test/, make jstest)
#   make demo   start JupyterLab on 127.0.0.1 with a copy of notebooks/demo.ipynb (in .gpumem-demo/, ignored)
#               GPUMEM_DEMO_CHECK=1: start it, check the notebook opens (.ci/demo_check.py), stop; CI runs this
#   make soak   the long reliability tests (1,000 cells under free(), a simulated 24 h session); minutes
#   make screenshots   the README's pictures (docs/images/*.png), taken by the browser tests in a real JupyterLab
#                      from the recorded GPU session in docs/sessions/

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
# JupyterLab autosaves the notebook it has open: the demo runs on a copy, so the checkout stays clean.
DEMO_DIR ?= .gpumem-demo

# Re-install when the package metadata or the front-end sources change (the editable install runs
# the front-end build through hatch-jupyter-builder).
JS_SOURCES := $(wildcard js/package.json js/tsconfig.json js/yarn.lock js/.yarnrc.yml) \
	$(shell find js/src js/style js/schema -type f 2>/dev/null)
INSTALLED := $(VENV)/.gpumem-installed
DEMO_INSTALLED := $(VENV)/.gpumem-demo-installed
# This machine's pip configuration names partial local indexes; pip warns for each missing project.
PIP_NOISE := is ignored: it is neither a file nor a directory

.PHONY: test demo demo-install demo-check-tools soak screenshots install chromium lint typecheck jstest pytest clean

test: install chromium lint typecheck jstest pytest

demo: demo-install $(if $(filter-out 0,$(GPUMEM_DEMO_CHECK)),demo-check-tools)
	@mkdir -p $(DEMO_DIR)
	@if [ ! -e $(DEMO_DIR)/demo.ipynb ]; then cp notebooks/demo.ipynb $(DEMO_DIR)/demo.ipynb; \
	  echo "==> copied notebooks/demo.ipynb to $(DEMO_DIR)/demo.ipynb (your edits stay there; delete it for a fresh copy)"; \
	else echo "==> reusing $(DEMO_DIR)/demo.ipynb (delete it for a fresh copy of notebooks/demo.ipynb)"; fi
	@if [ "$$(id -u)" = 0 ]; then root_flag=--allow-root; else root_flag=; fi; \
	demo_dir=$$(cd $(DEMO_DIR) && pwd); \
	server=("$(abspath $(VENV))/bin/jupyter" lab --ip=127.0.0.1 --port=$(DEMO_PORT) $$root_flag \
	  --ServerApp.root_dir="$$demo_dir" "$$demo_dir/demo.ipynb"); \
	if [ "$${GPUMEM_DEMO_CHECK:-0}" != 0 ]; then exec $(PY) .ci/demo_check.py "$$demo_dir/demo.ipynb" -- "$${server[@]}"; fi; \
	echo "==> starting JupyterLab on http://127.0.0.1:$(DEMO_PORT) with $(DEMO_DIR)/demo.ipynb open (Ctrl-C stops it)"; \
	exec "$${server[@]}"

# GPUMEM_DEMO_CHECK=1 make demo (CI) opens the notebook in headless chromium when it is installed:
# Playwright then joins the demo's environment (the test tools have it anyway).
demo-check-tools: demo-install
	@if [ -x /usr/bin/chromium ] && ! $(PY) -c "import playwright" 2>/dev/null; then \
	  echo "==> installing playwright, to open the demo in headless chromium"; \
	  $(PY) -m pip install -q "playwright>=1.45" 2>&1 | { grep -v "$(PIP_NOISE)" || true; }; \
	fi

# The demo needs the runtime, JupyterLab and a CPU torch; not the test tools. A test install has them all.
demo-install: $(DEMO_INSTALLED)

$(DEMO_INSTALLED): $(PY) pyproject.toml $(JS_SOURCES)
	@if [ -e $(INSTALLED) ] && [ $(INSTALLED) -nt pyproject.toml ]; then \
	  echo "==> gpumem is already installed with the test tools (they include the demo's)"; \
	else \
	  echo "==> installing gpumem (editable: builds the JupyterLab extension with node), JupyterLab and $(TORCH_PIN)"; \
	  echo "    this takes a few minutes the first time; pip shows its progress below"; \
	  $(PY) -m pip install --progress-bar on -e ".[demo]" "$(TORCH_PIN)" 2>&1 | { grep --line-buffered -v "$(PIP_NOISE)" || true; }; \
	fi
	@touch $@

install: $(INSTALLED)

$(PY):
	@echo "==> creating the virtual environment $(VENV)"
	$(PYTHON) -m venv $(VENV)

$(INSTALLED): $(PY) pyproject.toml $(JS_SOURCES)
	@echo "==> installing gpumem (editable) with its test tools and $(TORCH_PIN)"
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

# The front end's tools (ESLint, tsc for node's test runner) come from js/package-lock.json. The install's
# front-end build has usually installed them already (make test runs install first); a checkout without
# js/node_modules, or whose js/node_modules predates the lockfile, gets them here. jstest alone needs no
# Python install, so that it stays quick while the TypeScript changes.
JS_TOOLS := js/node_modules/.package-lock.json

$(JS_TOOLS): js/package.json js/package-lock.json
	@echo "==> installing the front end's tools from js/package-lock.json (npm ci)"
	cd js && npm ci --no-audit --no-fund
	@touch $@

lint: install $(JS_TOOLS)
	$(VENV)/bin/ruff check .
	cd js && npm run --silent lint

# The front end's unit tests: its pure modules (byte formatting, the status comm's protocol, the texts it
# shows), with the cases tests/fixtures/ shares with the Python tests.
jstest: $(JS_TOOLS)
	cd js && npm test --silent

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

# Only this target sets GPUMEM_SCREENSHOTS, so an ordinary test run never rewrites the tracked pictures;
# TZ=UTC: the recorded times on the axes read the same on every machine.
# panel_inline, cell_report and who come from the GPU session recorded on an H200 (docs/sessions/, made by
# benchmarks/record_session.py), shown by %gpumem load with no GPU here; panel_sidebar from a live kernel here.
SCREENSHOT_TESTS := tests/e2e/test_panel_browser.py::test_readme_pictures_from_the_recorded_gpu_session \
	tests/e2e/test_panel_browser.py::test_wide_notebook_panel_fits_and_readme_pictures \
	tests/e2e/test_sidebar_browser.py::test_lab_magic_sidebar_and_reload
screenshots: install chromium
	@mkdir -p $(ARTIFACTS) docs/images
	TZ=UTC GPUMEM_SCREENSHOTS=$(abspath docs/images) GPUMEM_TEST_ARTIFACTS=$(abspath $(ARTIFACTS)) \
	  $(PY) -m pytest $(SCREENSHOT_TESTS) $(PYTEST_ARGS)

clean:
	rm -rf $(ARTIFACTS) $(DEMO_DIR) .pytest_cache .mypy_cache .ruff_cache build dist
