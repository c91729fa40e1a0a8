"""The Python client in one screen (README's "Python client"): submit a spec, follow its events to the end, read
its view and history; then every job's failures, resumably. Run: .venv/bin/python examples/client_quickstart.py"""

import asyncio
import sys

from flightdeck.client import Client, ClientError
from flightdeck.events.job import JobFailed


async def main(spec: str) -> None:
    async with await Client.connect() as fd:  # $FLIGHTDECK_NATS_URL, else the local default
        job = await fd.submit(spec)  # a TOML spec's path, or a JobSpec
        async for event in fd.events(job):  # typed catalog events (events/), live, until the job ends
            print(type(event).__name__)
        view = await fd.wait(job)  # a JobView: phase, steps_done, restarts, checkpoints, reason
        print(job, view.phase, view.steps_done, view.restarts, len(await fd.history(job)))
        try:  # cancel / pause / resume / checkpoint(job), rollback(job, to_step, skip=(a, b))
            await fd.pause(job)
        except ClientError as refused:  # one line, and nothing appended, when the job cannot take it
            print(refused)


async def page_on_failures(seq: int | None = None) -> None:
    """Every job's JobFailed, forever: keep the last `seq` and pass it back after a restart to miss none."""
    async with await Client.connect() as fd:
        async for stored in fd.follow([JobFailed], after_seq=seq):
            assert isinstance(stored.event, JobFailed)
            print("failed:", stored.event.job_id, stored.event.reason)
            seq = stored.seq


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "examples/drill.toml"))
