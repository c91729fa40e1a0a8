"""The three examples as entrypoint jobs through every drill fault (tests/e2e/user_drill.py). One module on
purpose: its drills run one after another on one worker. Split over three workers they ran at once at the
end of a suite run and loaded the 2-core box past what the other drills there tolerate."""

import pytest

from tests.e2e.user_drill import survives_every_drill_fault
from tests.integration.lifecycle_harness import Platform

pytestmark = [pytest.mark.slow]


LOST_ROLLEDBACK = pytest.mark.xfail(strict=False, reason="open bug (issue 15): in 2 of 5 fresh-clone runs "
                                   "rank 0's RolledBack never reached telemetry in the FSDP2 drill")


@pytest.mark.timeout(420)
@pytest.mark.parametrize("example", ["pytorch_ddp", "hf_causal_lm", pytest.param("fsdp2", marks=LOST_ROLLEDBACK)])
async def test_an_example_survives_every_drill_fault(drill: Platform, example: str) -> None:
    await survives_every_drill_fault(drill, example)
