"""examples/hf_causal_lm/ as an entrypoint job through every drill fault (tests/e2e/user_drill.py)."""

import pytest

from tests.e2e.user_drill import survives_every_drill_fault
from tests.integration.lifecycle_harness import Platform

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(420)
async def test_the_example_survives_every_drill_fault(drill: Platform) -> None:
    await survives_every_drill_fault(drill, "hf_causal_lm")
