"""The nats-server under a running job: SIGKILLed and started again on the same store, then frozen with SIGSTOP past
every client timeout (a request waits 5 s, a service's ack wait is 2 s, heartbeats are lost after 2 s) and let go
with SIGCONT. The broker fsyncs every write (sync_interval: always), so nothing acknowledged is lost; the services,
the agent and the ranks ride both outages out. The job completes, the cores replay to the recorded decisions, no
step is lost or reported twice, and no decision is taken twice. And nothing is restarted: with the drills' 2 s
heartbeat deadline the health monitor finds no live rank lost: its ticks name the telemetry stored by their time
(services/shell/tap.py; before, a tick named the last message a dead feed delivered, and health raised RankLost
"heartbeats stopped" for both ranks after the broker restart), and silence is counted from the end of an outage the
service saw (ClockTick.recovered_at: a rank resends its backlog only once its in-flight publish times out)."""

import pytest

from tests.chaos.harness import Chaos, chaos_spec, progress, step_reached
from tests.e2e.drill_harness import wait_lineage

pytestmark = [pytest.mark.chaos, pytest.mark.slow]
STEPS = 130
PAUSE_S = 7.0


@pytest.mark.timeout(240)
async def test_the_broker_killed_then_paused_mid_job(chaos: Chaos) -> None:
    c, job = chaos, "chaos-broker-000001"
    p = c.platform
    p.agent("n1", "--grace-s", "2")
    await p.ready("n1")
    spec = chaos_spec("chaos-broker", STEPS)
    assert spec.policy.heartbeat_interval_s * spec.policy.heartbeat_misses == 2.0  # the drills' deadline
    await p.submit(spec, job)

    await step_reached(p, job, 0, 3)
    await c.kill_broker(down_s=1.0)
    await progress(p, job, 0, 5)  # telemetry flows again: the ranks reconnected, and so did the recorder
    await c.pause_broker(PAUSE_S)
    outcome = await c.outcome(job, STEPS, "broker", ["SIGKILL nats-server (down 1 s), restart",
                                                     f"SIGSTOP nats-server {PAUSE_S:g} s, SIGCONT"])
    assert await wait_lineage(p, job, STEPS) == []
    assert outcome.held, outcome
    assert outcome.attempts == 1 and outcome.findings == [], outcome  # the outages cost no restart
