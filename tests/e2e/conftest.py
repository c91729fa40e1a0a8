"""The drill fixture for every e2e test module (tests/e2e/drill_harness.py)."""

from tests.e2e.drill_harness import drill  # noqa: F401
