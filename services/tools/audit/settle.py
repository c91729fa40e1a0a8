"""Verifying a job on a live broker: first wait until every audited service has folded the job's history.

A service appends its decisions about an input before it acks it. Until every service's durable consumer has
acked everything up to the job's last event, a replay up to there may decide what the live service has not
stored yet, which would read as a missing decision. Once they have, the job's history is settled for verify.
"""

import asyncio
import time

import nats.errors
from nats.js.errors import NotFoundError, ServiceUnavailableError

from flightdeck.events import subjects
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.jsreader import cancellable
from flightdeck.services import registry
from flightdeck.services.shell.runtime import consumer_name
from flightdeck.services.tools.audit.verify import NoSuchJob, Verdict, verify
from flightdeck.services.tools.history.read import job_rows
from flightdeck.services.tools.history.recorded import RecordedStore


class NotSettled(TimeoutError):
    """Some service did not fold the job's history in time (stopped, or stuck)."""


async def lagging(store: JetStreamStore, horizon: int) -> dict[str, str]:
    """Audited services whose consumer has not yet acked every input up to FD_CONTROL seq `horizon`, with how far
    they have. A service that never ran (no consumer) lags at 0; one whose consumer info did not come (a cluster
    electing a stream leader answers late, or 503) counts as behind until it does."""
    out: dict[str, str] = {}
    for name in registry.BUILTIN:
        try:
            info = await cancellable(store.js.consumer_info(subjects.CONTROL, consumer_name(name)))
        except NotFoundError:  # the service has not started yet
            out[name] = "acked up to 0"
            continue
        except (nats.errors.TimeoutError, ServiceUnavailableError):  # the cluster is still electing
            out[name] = "consumer info not answered"
            continue
        floor = info.ack_floor.stream_seq if info.ack_floor else 0
        idle = not info.num_pending and not info.num_ack_pending
        if floor < horizon and not idle:
            out[name] = f"acked up to {floor or 0}"
    return out


async def settle(store: JetStreamStore, job_id: str, *, within: float = 30.0) -> int:
    """Wait until every audited service has folded up to the job's last event (and no new event of the job came
    meanwhile); return that event's sequence. Raises NotSettled naming the services still behind."""
    deadline = time.monotonic() + within
    while True:
        last = await store.last(subjects.CONTROL, subjects.job_all(job_id))
        if last is None:
            raise NoSuchJob(job_id)
        behind = await lagging(store, last.seq)
        again = await store.last(subjects.CONTROL, subjects.job_all(job_id))
        if not behind and again is not None and again.seq == last.seq:
            return last.seq
        if time.monotonic() > deadline:
            raise NotSettled(f"job {job_id}: services still behind its last event (FD_CONTROL seq {last.seq}) "
                             f"after {within:.0f} s: " + ", ".join(f"{n} {s}" for n, s in behind.items()))
        await asyncio.sleep(0.2)


async def verify_live(store: JetStreamStore, job_id: str, *, within: float = 30.0) -> Verdict:
    """`flightdeck verify` of a job on a live broker, once its history has settled."""
    await settle(store, job_id, within=within)
    return await verify(RecordedStore(await job_rows(store, job_id)), job_id)
