"""The three examples as entrypoint jobs through every drill fault (tests/e2e/user_drill.py). One module on
purpose: its drills run one after another on one worker. Split over three workers they ran at once at the
end of a suite run and loaded the 2-core box past what the other drills there tolerate."""

import pytest

from tests.e2e.user_drill import survives_every_drill_fault
from tests.integration.lifecycle_harness import Platform

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("example", ["pytorch_ddp", "hf_causal_lm", "fsdp2"])
async def test_an_example_survives_every_drill_fault(drill: Platform, example: str) -> None:
    await survives_every_drill_fault(drill, example)
