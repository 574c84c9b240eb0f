# Two commands do all the set-up on a fresh machine:
#   make run    # creates .venv, installs everything, runs the embedded default (data/)
#   make test   # creates .venv, installs everything, runs the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup setup-existing browser run test wheel-check lint bench clean lock

# Set-up time dominated CI on a slow 2-core machine: pip resolves and unpacks on one core and
# byte-compiles every file it installs (measured here: 24 min for the dev set even without
# compiling, 20+ min for torch with it). So pip installs only uv (from PyPI); uv installs torch
# from the machine's local wheel folder (pip's find-links, which uv does not read) and the rest,
# with no compile step; Python caches the bytecode of the modules actually imported, even where
# the environment says not to.
export PYTHONDONTWRITEBYTECODE :=
TORCH_WHEELS ?= $(or $(PIP_FIND_LINKS),/opt/wheels)

setup: $(VENV)/.installed

# Every dependency at the version in the lock (torch exactly 2.13.0+cpu, the CPU build on local
# disk: any other version pulls CUDA wheels), then the package itself: a fresh machine installs
# what CI tested, whatever PyPI released since (`make lock` moves the lock). uv.lock is the lock;
# pylock.toml (PEP 751) is its export of the dev set, which `uv pip` installs into this venv.
$(VENV)/.installed: pyproject.toml uv.lock pylock.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --no-compile uv
	$(BIN)/uv pip install --quiet --python $(BIN)/python \
		$(foreach dir,$(TORCH_WHEELS),--find-links $(dir)) -r pylock.toml
	$(BIN)/uv pip install --quiet --python $(BIN)/python --no-deps -e .
	$(BIN)/uv pip install --quiet --python $(BIN)/python --no-deps $(CONSUMERS)
	touch $@

# uv.lock from pyproject.toml (its dependencies, the dev extra, the cpu group: torch's CPU build;
# [tool.uv] names the one machine kind locked), then pylock.toml, its export of the dev set: run
# it to take newer releases, then `make test`; a release that breaks us gets an upper bound in
# pyproject.toml, with its reason. It names torch's wheel by its path: `make lock
# TORCH_WHEELS=DIR` where it is elsewhere.
lock: $(VENV)/.installed
	$(BIN)/uv lock --upgrade --quiet $(foreach dir,$(TORCH_WHEELS),--find-links $(dir))
	$(BIN)/uv export --frozen --format pylock.toml --extra dev --group cpu --no-emit-project \
		--quiet -o pylock.toml

# The trainers the hand-off tests run (tests/test_handoff.py; yunchang is SpecForge's trainer's,
# whose package is ../shared/fixtures/specforge), without their dependencies: a plain install
# would replace torch with a CUDA build (their other dependencies are in `dev`).
CONSUMERS := speculators==0.9.0 hs-connectors==0.9.0 dflash==0.1.0 yunchang==0.6.4

# A GPU machine: install into an environment that already has its CUDA torch, which is kept
# (torch is not a dependency of this package; nothing here installs or replaces it):
#   make setup-existing PY=/path/to/env/bin/python [EXTRAS=tokenize,regenerate,ray]
EXTRAS ?= tokenize,regenerate
setup-existing:
	@test -n "$(PY)" || { echo "usage: make setup-existing PY=/path/to/env/bin/python"; exit 2; }
	$(PY) -c "import torch; print('keeping torch', torch.__version__, 'CUDA', torch.version.cuda)"
	$(PY) -m pip install -e ".[$(EXTRAS)]"
	$(PY) -c "import torch; print('torch still', torch.__version__)"

run: setup
	$(BIN)/dflash-etl run

# Debian's headless Chromium + ChromeDriver for the report's browser test (installed when root;
# otherwise that test is skipped with the command to run).
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
		if [ "$$(id -u)" = 0 ]; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
				apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null; \
		else \
			echo "note: no headless Chromium; run: sudo apt-get install chromium chromium-driver"; \
		fi; \
	fi

# The Python set-up and the browser install run side by side (both take minutes on a slow machine).
# The suite writes its wall time and its slowest tests to build/test-durations.txt (CI prints it);
# the inner loop is `.venv/bin/python -m pytest -m "not slow"` (docs/tests.md).
test:
	@date -u +"%T set-up starts"
	$(MAKE) --no-print-directory -j2 setup browser
	@date -u +"%T set-up done, tests start"
	$(BIN)/python -m pytest -q

# The package as a user gets it, not this checkout: the sdist and the wheel built from it, the
# wheel installed with its dependencies (torch as above) into a fresh environment, and from an
# empty directory `dflash-etl init` -> ingest -> tokenize -> check on the embedded default.
WHEEL_TRY := build/wheel-try
# the installed commands only: no PYTHONPATH that could reach the checkout's src/
IN_WHEEL_ENV := env -u PYTHONPATH PATH=$(CURDIR)/$(WHEEL_TRY)/venv/bin:$$PATH
wheel-check: setup
	rm -rf dist $(WHEEL_TRY)
	$(BIN)/uv build --quiet --out-dir dist
	$(BIN)/uv venv --quiet --python $(PYTHON) $(WHEEL_TRY)/venv
	$(BIN)/python tools/lock_pins.py > $(WHEEL_TRY)/constraints.txt
	$(BIN)/uv pip install --quiet --python $(WHEEL_TRY)/venv/bin/python \
		$(foreach dir,$(TORCH_WHEELS),--find-links $(dir)) -c $(WHEEL_TRY)/constraints.txt \
		"torch==2.13.0+cpu" "$$(ls dist/dflash_etl-*.whl)[tokenize]"
	mkdir -p $(WHEEL_TRY)/work
	cd $(WHEEL_TRY)/work && $(IN_WHEEL_ENV) python -c 'import sys, dflash_etl as p; \
		print(p.__file__); sys.exit("site-packages" not in p.__file__)'
	cd $(WHEEL_TRY)/work && $(IN_WHEEL_ENV) dflash-etl init default
	cd $(WHEEL_TRY)/work/default && $(IN_WHEEL_ENV) dflash-etl ingest --config pipeline.toml \
		--run runs/try
	cd $(WHEEL_TRY)/work/default && $(IN_WHEEL_ENV) dflash-etl tokenize --config pipeline.toml \
		--run runs/try
	cd $(WHEEL_TRY)/work/default && $(IN_WHEEL_ENV) dflash-etl check runs/try

lint: setup
	$(BIN)/ruff check src tests benchmarks data setup.py

bench: setup
	$(BIN)/python benchmarks/bench_ingest.py

clean:
	rm -rf runs .pytest_cache build dist
