# Two commands do all the set-up on a fresh machine:
#   make run    # creates .venv, installs everything, runs the embedded default (data/)
#   make test   # creates .venv, installs everything, runs the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup run test lint bench clean

setup: $(VENV)/.installed

# torch first and exactly: 2.13.0 is a CPU build on local disk; anything else pulls CUDA wheels.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

run: setup
	$(BIN)/dflash-etl run

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check src tests benchmarks data

bench: setup
	$(BIN)/python benchmarks/bench_ingest.py

clean:
	rm -rf runs .pytest_cache
