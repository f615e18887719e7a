# Everything a fresh machine needs: `make demo` and `make test` create .venv and install first.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench soak scale clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m pgcdc_assets.demo $(DEMO_ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m bench.decode
	$(BIN)/python -m bench.snapshot
	$(BIN)/python -m bench.cdc

# pgbench load with incremental runs back to back, exact at the end (not part of `make test`).
# SOAK_ARGS, e.g. SOAK_ARGS="--seconds 600 --rate 500 --major 15".
soak: $(STAMP)
	$(BIN)/python -m bench.soak $(SOAK_ARGS)

# The scale benchmarks (docs/benchmarks.md; not part of `make test`), e.g. SCALE_ARGS="idle --tables 1,100,500".
scale: $(STAMP)
	$(BIN)/python -m bench.scale $(SCALE_ARGS)

clean:
	rm -rf $(VENV) lake .demo .pytest_cache
