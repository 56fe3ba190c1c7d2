# Two entry points: `make demo` runs the example workflow on the embedded SQLite default,
# `make test` runs ruff, mypy --strict and the test suite on every backend.
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

# Backend-independent code is mutated once, on SQLite: a fresh process per mutant on the
# embedded database keeps the run within the hour on two cores. MUTANTS narrows the run to
# mutant names matching a glob (MUTANTS='wf_persist.replay.*'); results are kept in mutants/
# and a second run only tests what is new or changed.
MUTANTS ?=
mutation: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[dev,mutation]'
	WF_PERSIST_TEST_BACKENDS=sqlite WF_PERSIST_TEST_STRICT= $(VENV)/bin/mutmut run $(if $(MUTANTS),"$(MUTANTS)")
	$(PY) -m tests.mutation_report

bench: $(VENV)/.installed
	$(PY) bench/bench_steps.py

clean:
	rm -rf $(VENV) mutants wf_persist.sqlite3 wf_persist.sqlite3-wal wf_persist.sqlite3-shm
