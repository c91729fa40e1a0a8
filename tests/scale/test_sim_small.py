"""The scale harness on a small fleet, so it cannot rot: 64 simulated ranks (8 node agents batching their
ranks' heartbeats) against the real health monitor, scheduler and resource manager on a nats-server with the
shipped config. A killed rank is found lost, never before the heartbeat-loss threshold, each kill restarts the
job through the scheduler, and a healthy fleet raises no other finding."""

from pathlib import Path

import pytest

from bench.sim.harness import RunConfig, run


@pytest.mark.timeout(120)
async def test_a_killed_simulated_rank_is_found_within_twice_the_threshold(tmp_path: Path) -> None:
    config = RunConfig(num_ranks=64, mode="node", kills=2, processes=2, window_s=2.0, settle_s=2.5,
                       beat_s=0.5, misses=4, step_s=0.5, tick_s=0.5, kill_timeout_s=30.0)
    result = await run(config, tmp_path)
    d, s = result["detection"], result["steady"]
    print(f"\n64 ranks: detection {[x['detect_s'] for x in d['samples']]} s (threshold {config.threshold_s:g} s); "
          f"health folded {s['health_folded_msgs_per_s']} msg/s, CPU {s['cpu_percent']['health']}%")
    assert d["n"] == 2 and [x["attempt"] for x in d["samples"]] == [0, 1]  # each kill restarted the job
    # Never before the threshold (exact). The goal, at most twice it, is a speed figure: bench/scale_sim.py measures
    # it; here a loaded box may fold late, so the bound only catches a kill that went unnoticed for long.
    assert all(config.threshold_s < x["detect_s"] <= config.threshold_s + 15 for x in d["samples"]), d["samples"]
    assert result["other_findings"] == []  # no live rank's beats went missing: none was found lost
    assert s["rank_heartbeats_per_s"] > 0.5 * 64 / config.beat_s  # the beats flowed in batches (rate: bench/)
    assert s["health_folded_msgs_per_s"] > 0
