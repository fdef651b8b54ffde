# Every target sets itself up: the first run creates .venv and installs the project into it.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PIP := $(PY) -m pip install -q --disable-pip-version-check -c constraints.txt
export OMP_NUM_THREADS ?= 1
# Bytecode caches are written (__pycache__, ignored by git) where the environment says not to:
# without them every test process rewrites every test module's asserts while collecting, and
# every interpreter started compiles the modules of ours it imports.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup test test-fast test-browser demo lint bench soak clean browser

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev]'
	@touch $@

# The HTML report test drives Debian's Chromium (no browser download); install it if missing.
browser:
	@command -v chromium >/dev/null || { \
	  echo "installing Debian's chromium for the HTML report test"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q chromium >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; } || \
	  { echo "could not install chromium: run 'apt-get install chromium' as root" >&2; exit 1; }; }

# The whole suite (CI), in two parts: every test but the serial ones on TEST_WORKERS processes
# (pytest-xdist; each has its own launch server, tests/launchpad.py, so a launch forks instead
# of starting an interpreter that imports torch), then the serial ones (they measure time or
# CPU shares) alone; the slowest tests are listed at the end of each part. The unit tests share
# the first part, filling the CPU the multi-process tests leave idle while they wait; three
# processes on two cores, as those tests wait often (detection windows, restarts, pods).
TEST_WORKERS ?= 3
xdist = $(if $(filter-out 1,$(1)),-n $(1) --dist worksteal)
test: $(STAMP) browser
	$(PY) -m pytest -q $(call xdist,$(TEST_WORKERS)) -m "not serial" --durations=25 tests
	$(PY) -m pytest -q -m serial --durations=10 tests

# A change's inner loop (about a minute): the unit tests that start no processes and take no
# seconds, on TEST_WORKERS processes.
test-fast: $(STAMP)
	$(PY) -m pytest -q $(call xdist,$(TEST_WORKERS)) -m "unit and not slow" --durations=10 tests

# The tests that drive Chromium (installed here if missing, and only here and in make test).
test-browser: $(STAMP) browser
	$(PY) -m pytest -q -m browser tests

demo: $(STAMP)
	@bash scripts/demo.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples
	$(VENV)/bin/ruff format --check src tests examples
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(VENV)/bin/unbroken bench ledger

# 100 seeded random faults of every single-node kind under unbroken-run, bit-exact with the
# fault-free run, nothing leaked (10-20 min; not part of `make test`). FAULTS=, SEED= to vary.
soak: $(STAMP)
	@bash scripts/soak.sh

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
