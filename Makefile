# Two entry points: `make demo` runs the example workflow on the embedded SQLite default,
# `make test` runs ruff, mypy --strict and the test suite on every backend. `make bench` runs
# the benchmark suite.
# `make mutation` (not part of `make test` or CI) runs mutmut over the core modules; see
# docs/mutation.md.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: demo test bench mutation clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/order.py

test: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest

# Mutants are tested on SQLite (one forked pytest per mutant, the covering tests of the
# selection in tests/mutation_selection.py). A run stops after MUTATION_MINUTES (default
# 45) and keeps its results in mutants/: the next `make mutation` goes on where it stopped,
# re-testing only what changed. MUTANTS narrows a run to names matching a glob, e.g.
# MUTANTS='wf_persist.replay.*'. The summary is printed either way.
MUTATION_MINUTES ?= 45
MUTANTS ?=
# Mutants mostly wait (leases, timers, polls) rather than compute: more than one per core.
MUTATION_CHILDREN ?= 8
mutation: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[dev,mutation]'
	WF_PERSIST_TEST_BACKENDS=sqlite WF_PERSIST_TEST_STRICT= timeout --signal=INT \
		--kill-after=120 $(MUTATION_MINUTES)m $(VENV)/bin/mutmut run \
		--max-children $(MUTATION_CHILDREN) $(if $(MUTANTS),"$(MUTANTS)") || test $$? -eq 124
	$(PY) -m tests.mutation_report

# The benchmark suite (bench/suite.py; README, "Performance"): SQLite and PostgreSQL
# ($WF_PERSIST_BENCH_POSTGRES_URL), against raw-SQL floors, DBOS and Absurd. BENCH_ARGS passes
# options, e.g. BENCH_ARGS='--quick' or BENCH_ARGS='--backend postgresql --write-readme'.
BENCH_ARGS ?=
$(VENV)/.bench-installed: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install -q -e '.[dev,bench]'
	touch $@

bench: $(VENV)/.bench-installed
	$(PY) -m bench.suite $(BENCH_ARGS)
	@if [ -f bench/bench_scale.py ]; then $(PY) bench/bench_scale.py; fi

clean:
	rm -rf $(VENV) mutants wf_persist.sqlite3 wf_persist.sqlite3-wal wf_persist.sqlite3-shm
