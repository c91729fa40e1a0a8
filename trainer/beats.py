"""Who reports steps: with an agent relaying heartbeats, ranks other than 0 may leave their steps to its
batches (the protocol itself is events/nodelocal.py)."""

import os

from flightdeck.events.nodelocal import STEP_REPORTS, STEP_REPORTS_ENV, BeatChannel


def steps_to_bus(rank: int, channel: BeatChannel | None) -> bool:
    """Whether this rank publishes a StepCompleted per step. With "rank0" (a fleet setting: one message per
    rank per step is more than a broker stores at thousands of ranks) only rank 0 does, and only while an
    agent carries the others' steps and step times in its batches."""
    mode = os.environ.get(STEP_REPORTS_ENV, "") or "all"
    if mode not in STEP_REPORTS:
        raise ValueError(f"${STEP_REPORTS_ENV}={mode!r}: choose one of {', '.join(STEP_REPORTS)}")
    return mode == "all" or rank == 0 or channel is None
