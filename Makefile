# Everything a fresh machine needs: each target creates .venv and installs what it needs first.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider
# Two pytest-xdist workers (the CI machine has 2 cores): a test mostly waits on PostgreSQL, the engine or a
# child process, so a second worker fills the idle core. Every JVM test runs on one worker (the modules of
# JVM_MODULES, tests/support/tiers.py), one JVM at a time. WORKERS=0 runs the suite in this process.
WORKERS ?= 2
PARALLEL := $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadgroup)
# Bytecode written and reused: with PYTHONDONTWRITEBYTECODE set, every worker compiles and rewrites the
# assertions of every test module at collection, and every child interpreter a test starts compiles the
# runtime modules again (collecting the unit tier took 14 s of CPU per worker that way, 8 s with bytecode).
unexport PYTHONDONTWRITEBYTECODE
# Runs alone after the others: under the other worker's load its kept JVM answered the probe and then let
# the client's connect (about 3 s of retries, resources/engines/spark_connect.py) run out.
ALONE := tests/test_spark_kept_jvm.py
# The runtime packages that lint and the type check cover.
RUNTIME := resources pgcdc_assets sensors

.PHONY: demo test test-unit test-fast lint format bench soak scale clean

# One stamp per extra: `make demo` installs only what the demo needs (.[demo]), the others .[dev].
$(VENV)/.installed-%: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[$*]'
	touch $@

demo: $(VENV)/.installed-demo
	$(BIN)/python -m pgcdc_assets.demo $(DEMO_ARGS)

# The whole suite (every tier; what .ci/run runs).
test: $(VENV)/.installed-dev
	$(PYTEST) $(PARALLEL) --ignore=$(ALONE) $(PYTEST_ARGS)
	$(PYTEST) $(ALONE) $(PYTEST_ARGS)

# No server at all: decoders, folds, layouts, configuration, the in-memory destination (docs/testing.md, "Tiers").
# On two workers too: its time is CPU (imports in child interpreters, property tests), which a second core halves.
test-unit: $(VENV)/.installed-dev
	$(PYTEST) -m unit $(PARALLEL) $(PYTEST_ARGS)

# PostgreSQL 15 and 18 and the embedded Sail engine, no JVM, none of the slow tier.
test-fast: $(VENV)/.installed-dev
	$(PYTEST) -m 'unit or pg or sail' $(PARALLEL) $(PYTEST_ARGS)

# ruff's lint rules and mypy on the runtime packages; import order and ruff's format everywhere
# (pyproject.toml configures them; `make format` applies the last two).
lint: $(VENV)/.installed-dev
	$(BIN)/ruff check $(RUNTIME)
	$(BIN)/ruff check --select I $(RUNTIME) tests bench
	$(BIN)/ruff format --check $(RUNTIME) tests bench
	$(BIN)/mypy $(RUNTIME)

# Sorts imports and applies ruff's formatter (pyproject.toml configures both).
format: $(VENV)/.installed-dev
	$(BIN)/ruff check --select I --fix $(RUNTIME) tests bench
	$(BIN)/ruff format $(RUNTIME) tests bench

bench: $(VENV)/.installed-dev
	$(BIN)/python -m bench.decode
	$(BIN)/python -m bench.snapshot
	$(BIN)/python -m bench.cdc

# pgbench load with incremental runs back to back, exact at the end (not part of `make test`).
# SOAK_ARGS, e.g. SOAK_ARGS="--seconds 600 --rate 500 --major 15".
soak: $(VENV)/.installed-dev
	$(BIN)/python -m bench.soak $(SOAK_ARGS)

# The scale benchmarks (docs/benchmarks.md; not part of `make test`), e.g. SCALE_ARGS="idle --tables 1,100,500".
scale: $(VENV)/.installed-dev
	$(BIN)/python -m bench.scale $(SCALE_ARGS)

clean:
	rm -rf $(VENV) lake .demo .pytest_cache
