# Two entry points: `make demo` runs the example workflow on the embedded SQLite default,
# `make test` runs ruff, mypy --strict and the test suite on every backend.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: demo test bench clean

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

bench: $(VENV)/.installed
	$(PY) bench/bench_steps.py

clean:
	rm -rf $(VENV) wf_persist.sqlite3 wf_persist.sqlite3-wal wf_persist.sqlite3-shm
