"""The job gate: nats-server's auth callout for jobs' ranks. A job needs no user in the server's config and no
reload: a rank connects as `job-<id>` with the password its agent derived from the job key, the server hands the
attempt to the gate ($SYS.REQ.USER.AUTH), and the gate answers with a user JWT signed by the issuer account the
server trusts, carrying the job's permissions (permissions.job: its own telemetry and history, nothing else) and
an expiry. The gate admits a job from its first grant until it ends (completed, failed or cancelled); after that
no identity is issued again, and the one in use stops working when it expires (`ttl_s`): the server closes the
connection and the rank's reconnect is refused.

Why it works this way: docs/internals.md, "9. Security and deployment".
"""

import asyncio
import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import nats
import structlog
from nats.aio.msg import Msg

from events import subjects
from events.admission import Admission
from events.fleet import NodeRegistered
from events.jetstream import JetStreamStore
from events.job import AllocationGranted, JobCancelled, JobCompleted, JobFailed
from events.store import Stored
from services.shell.security import natsjwt, permissions
from services.shell.security.passwords import job_password

log = structlog.get_logger("flightdeck.gate")

DEFAULT_TTL_S = 300.0  # an identity's life; a rank reconnects (and is admitted again) when it expires
JOB_PREFIX = "job-"
WATCHED = (*(f"fd.ctl.job.*.{t}" for t in ("AllocationGranted", "JobCompleted", "JobFailed", "JobCancelled")),
           "fd.ctl.node.*.NodeRegistered")


@dataclass
class Jobs:
    """Which jobs may connect: granted and not ended. Folded from the control stream."""

    live: set[str] = field(default_factory=set)
    ended: set[str] = field(default_factory=set)
    nodes: set[str] = field(default_factory=set)  # every node registered: its agent's durable is no job's to create
    admission: Admission = field(default_factory=Admission)

    def fold(self, stored: Stored) -> None:
        if self.admission.refusal(stored):  # a forged end must not lock a running job's ranks out
            return
        ev = stored.event
        if isinstance(ev, AllocationGranted) and ev.job_id not in self.ended:
            self.live.add(ev.job_id)
        elif isinstance(ev, JobCompleted | JobFailed | JobCancelled):
            self.live.discard(ev.job_id)
            self.ended.add(ev.job_id)
        elif isinstance(ev, NodeRegistered):
            self.nodes.add(ev.node)


@dataclass
class Verdict:
    user_jwt: str = ""
    error: str = ""


@dataclass
class Gate:
    job_key: str
    issuer_seed: bytes
    ttl_s: float = DEFAULT_TTL_S
    jobs: Jobs = field(default_factory=Jobs)

    def decide(self, request: Mapping[str, Any], now: float) -> Verdict:
        """Admit a connection attempt (the claims of the server's authorization request), or say why not."""
        nats_claims = request.get("nats") or {}
        opts = nats_claims.get("connect_opts") or {}
        user, password, user_nkey = opts.get("user") or "", opts.get("pass") or "", nats_claims.get("user_nkey", "")
        if not user.startswith(JOB_PREFIX) or not user_nkey:
            return Verdict(error=f"unknown user {user!r}: only a job's ranks are admitted here")
        job_id = user.removeprefix(JOB_PREFIX)
        try:
            expected = job_password(self.job_key, job_id)
        except ValueError:
            return Verdict(error=f"{user!r} names no job")
        if password != expected:
            return Verdict(error=f"wrong password for {user!r}")
        if job_id in self.jobs.ended:
            return Verdict(error=f"job {job_id} has ended: its identity is revoked")
        if job_id not in self.jobs.live:
            return Verdict(error=f"job {job_id} is not running (no grant yet)")
        perms = permissions.job(job_id, tuple(sorted(self.jobs.nodes)))
        claims = natsjwt.user_claims(user_nkey=user_nkey, name=user, publish=list(perms.publish),
                                     publish_deny=list(perms.publish_deny), subscribe=list(perms.subscribe),
                                     expires_at=int(now + self.ttl_s))
        return Verdict(user_jwt=natsjwt.encode(claims, self.issuer_seed))

    def answer(self, data: bytes, now: float) -> bytes:
        """The signed authorization response to one request, admitting or refusing."""
        try:
            request = natsjwt.decode(data.decode())
        except (ValueError, UnicodeDecodeError) as exc:
            log.warning("authorization request refused: unreadable", error=str(exc))
            return b""
        nats_claims = request.get("nats") or {}
        verdict = self.decide(request, now)
        user = (nats_claims.get("connect_opts") or {}).get("user", "")
        if verdict.error:
            log.warning("connection refused", user=user, reason=verdict.error)
        else:
            log.info("job identity issued", user=user, ttl_s=self.ttl_s)
        claims = natsjwt.response_claims(user_nkey=nats_claims.get("user_nkey", ""),
                                         server_id=(nats_claims.get("server_id") or {}).get("id", ""),
                                         user_jwt=verdict.user_jwt, error=verdict.error)
        return natsjwt.encode(claims, self.issuer_seed).encode()

    async def run(self, url: str, options: Mapping[str, Any], stop: asyncio.Event,
                  ready: asyncio.Event | None = None) -> None:
        """Follow the control stream and answer the server's requests until `stop` is set."""
        store = await JetStreamStore.connect(url, name="gate", provision=False, **options)
        nc: nats.NATS = store.nc
        follower: asyncio.Task[None] | None = None
        try:
            until = await store.last_seq(subjects.CONTROL)
            async for batch in store.read(subjects.CONTROL, WATCHED, until_seq=until):
                for stored in batch:
                    self.jobs.fold(stored)

            async def follow() -> None:
                async for stored in store.follow(subjects.CONTROL, WATCHED, from_seq=until + 1):
                    self.jobs.fold(stored)

            follower = asyncio.create_task(follow())

            async def on_request(msg: Msg) -> None:
                reply = self.answer(msg.data, time.time())
                if reply and msg.reply:
                    await msg.respond(reply)

            await nc.subscribe(permissions.AUTH_REQUESTS, cb=on_request)
            log.info("gate ready", live_jobs=len(self.jobs.live), ttl_s=self.ttl_s)
            if ready is not None:
                ready.set()
            await stop.wait()
        finally:
            if follower is not None:
                follower.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await follower
            await store.close()
