"""The chaos fixture for every chaos drill (tests/chaos/harness.py)."""

from tests.chaos.harness import chaos  # noqa: F401
