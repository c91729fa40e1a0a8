"""The nemesis runs on the chaos drills' platform (tests/chaos/harness.py)."""

from tests.chaos.harness import chaos  # noqa: F401
