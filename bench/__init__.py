"""Benchmarks, never part of the test run (bench/README.md). Each runs as a module from the
checkout (`python -m bench.e2e`) or as a file (`python bench/e2e.py`, through
bench/_shim.py)."""
