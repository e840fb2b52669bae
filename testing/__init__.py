"""Servers that stand in for real workers in tests and benchmarks; the product never imports
this package and the distribution does not ship it (pyproject's package list leaves it out).
Import it from a checkout: `python -m pytest` and `python -m testing.fake_worker` from the
repository root put the root on `sys.path`."""
