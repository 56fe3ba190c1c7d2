"""The benchmark suite (``make bench``, ``python -m bench.suite``): wf_persist against raw-SQL
floors, DBOS and Absurd, in the same run. See ``bench/suite.py``."""
