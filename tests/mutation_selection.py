"""Pytest plugin that narrows the suite to the tests ``make mutation`` runs against mutants.

Loaded only by mutmut (``-p tests.mutation_selection`` in ``[tool.mutmut]``), never by
``make test``. Every mutant is tested by the selected tests that call the mutated function,
so the selection has to be fast and has to run the code in this process: a test whose
workflow runs in a child process imports the unmutated package there and can neither kill
nor keep a mutant, only cost time. Dropped: tests using the ``procs`` fixture (child
processes), tests no listed backend can run (mutation runs list only SQLite) and the few
in-process tests slower than about a second whose behaviour faster tests also pin.
docs/mutation.md lists what is run.
"""

from __future__ import annotations

import pytest

#: In-process tests dropped for their run time (each > ~1 s on SQLite); the behaviour they
#: pin is also asserted by faster tests of the same files.
SLOW: frozenset[str] = frozenset(
    {
        "tests/test_host.py::test_cli_purge",
        "tests/test_host.py::test_documented_queries_run_on_every_backend",
        "tests/test_host.py::test_upgrade_keeps_data_from_the_oldest_revision",
        "tests/test_replay_properties.py::"
        "test_a_crash_anywhere_resumes_to_the_same_outcome_and_history",
        "tests/test_core_regressions.py::test_a_run_failing_the_same_way_every_drive_ends",
        "tests/test_host_engines.py::test_runs_are_driven_correctly_on_every_host_configuration",
        "tests/test_fencing.py::test_leases_are_renewed_on_a_connection_of_their_own",
        "tests/test_workers.py::test_suspended_runs_cost_the_worker_no_memory",
        "tests/test_replay_properties.py::test_random_programs_run_as_the_model_predicts",
        "tests/test_replay_properties.py::"
        "test_an_edited_program_replays_iff_it_is_consistent_with_the_history",
        "tests/test_promises.py::test_a_step_longer_than_the_lease_is_not_taken_over",
    }
)


def _dropped(item: pytest.Item) -> bool:
    base = item.nodeid.split("[", 1)[0]
    if base in SLOW:
        return True
    if "no-backend" in item.nodeid:
        return True
    return "procs" in getattr(item, "fixturenames", ())


def pytest_configure(config: pytest.Config) -> None:
    """mutmut tests each mutant in a process forked from one that already ran the tests:
    statements the backends build once per process (``functools`` caches) would still hold
    the SQL of the unmutated code there, hiding mutants of the functions that build them
    (``claim_values``, ``due``, ``pinned``). Build them again in every run."""
    from wf_persist.backends import sql

    for built in (sql.claim_one, sql.bump, sql.bump_returning):
        built.cache_clear()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    dropped = [item for item in items if _dropped(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not _dropped(item)]
