"""Event-driven automation written only against Flightdeck's Python client (`flightdeck.client`) and its event
catalog (`events`): post a signed JSON webhook for every JobFailed and LossSpikeDetected of any job. It runs as a
service of its own, on any machine that reaches the broker.

    python examples/webhook_notifier/notifier.py --url https://hooks.example/flightdeck --secret-file hook.secret \\
        [--nats nats://broker:4222] [--state notifier.json] [--on JobFailed,LossSpikeDetected,RankLost]

Each POST carries a JSON body (README.md beside this file shows one) and these headers:
    X-Flightdeck-Event      the event's type
    X-Flightdeck-Delivery   the event's id: the same on every retry, so a receiver can drop duplicates
    X-Flightdeck-Timestamp  unix seconds when this try was signed
    X-Flightdeck-Signature  "sha256=" + hex HMAC-SHA256(secret, timestamp + "." + body)

Delivery is at least once. The state file keeps the control stream's sequence of the last event handled, written
after each one, so a restart resumes there. A 2xx answer is delivered; a 4xx other than 408 and 429 is a refusal
(logged and skipped: the same body would be refused again); anything else, or no answer, is retried with backoff
for as long as it takes, since the broker keeps what comes meanwhile.
"""

import argparse
import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import msgspec
import structlog

from flightdeck.client import Client, ClientError
from flightdeck.events.base import Event, JobEvent
from flightdeck.events.catalog import BY_NAME
from flightdeck.events.findings import LossSpikeDetected
from flightdeck.events.job import JobFailed

log = structlog.get_logger("flightdeck.notifier")
DEFAULT_ON = ("JobFailed", "LossSpikeDetected")
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 60.0)  # then 60 s between tries, until the endpoint answers
RETRIED = frozenset({408, 429})  # 4xx answers that mean "later", not "never"


@dataclass(frozen=True)
class Config:
    url: str
    secret: bytes
    state: Path
    on: tuple[type[Event], ...]
    nats: str | None = None
    timeout_s: float = 10.0
    backoff_s: Sequence[float] = BACKOFF_S


def sign(secret: bytes, timestamp: int, body: bytes) -> str:
    return "sha256=" + hmac.new(secret, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def summary(event: Event) -> str:
    """One line a person reads in a chat channel."""
    job = event.job_id if isinstance(event, JobEvent) else ""
    match event:
        case JobFailed(reason=reason):
            return f"{job} failed: {reason}"
        case LossSpikeDetected(step=step, loss=loss, baseline=baseline, z=z, threshold=threshold):
            return (f"{job}: loss spike at step {step}: {loss:.4g} against a median of {baseline:.4g} "
                    f"({z:.1f} deviations, threshold {threshold:g})")
    return f"{job or getattr(event, 'node', '')}: {type(event).__name__}"


def body(event: Event, seq: int) -> bytes:
    """The webhook's JSON: the catalog event as the wire contract has it (a NaN loss is null), plus a summary."""
    return msgspec.json.encode({
        "id": event.event_id, "type": type(event).__name__, "seq": seq,
        "job_id": event.job_id if isinstance(event, JobEvent) else None,
        "occurred_at": event.occurred_at, "summary": summary(event), "event": event,
    })


async def deliver(http: aiohttp.ClientSession, cfg: Config, event: Event, seq: int) -> str:
    """POST one event until it is delivered or refused: "delivered" or "refused"."""
    data = body(event, seq)
    bound = log.bind(event_id=event.event_id, type=type(event).__name__, seq=seq)
    for attempt in range(1, sys.maxsize):
        now = int(time.time())
        headers = {"Content-Type": "application/json", "X-Flightdeck-Event": type(event).__name__,
                   "X-Flightdeck-Delivery": event.event_id, "X-Flightdeck-Timestamp": str(now),
                   "X-Flightdeck-Signature": sign(cfg.secret, now, data)}
        try:
            async with http.post(cfg.url, data=data, headers=headers) as answer:
                status = answer.status
            if 200 <= status < 300:
                bound.info("webhook.delivered", status=status, attempt=attempt)
                return "delivered"
            if 400 <= status < 500 and status not in RETRIED:
                bound.error("webhook.refused", status=status, attempt=attempt,
                            detail="the endpoint refused it; skipped, since the same body would be refused again")
                return "refused"
            why = f"HTTP {status}"
        except (TimeoutError, aiohttp.ClientError) as exc:
            why = f"{type(exc).__name__}: {exc}"
        wait = cfg.backoff_s[min(attempt - 1, len(cfg.backoff_s) - 1)]
        bound.warning("webhook.retrying", attempt=attempt, error=why, retry_in_s=wait)
        await asyncio.sleep(wait)
    raise AssertionError("unreachable")


def load_state(path: Path) -> int | None:
    """The sequence of the last event handled, or None on a first start."""
    try:
        return int(json.loads(path.read_text())["seq"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as exc:
        raise ClientError(f"{path} is not a notifier state file ({exc}); move it away to start afresh", 2) from None


def save_state(path: Path, seq: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"seq": seq}) + "\n")
    os.replace(tmp, path)  # whole or not at all: a crash mid-write never leaves a cursor that skips events


async def follow(fd: Client, http: aiohttp.ClientSession, cfg: Config, after: int) -> None:
    async with contextlib.aclosing(fd.follow(cfg.on, after_seq=after)) as events:
        async for stored in events:
            if stored.event is None:  # a type newer than this code: the rest still gets through
                log.warning("notifier.undecodable", seq=stored.seq, subject=stored.subject)
            else:
                await deliver(http, cfg, stored.event, stored.seq)
            save_state(cfg.state, stored.seq)


async def run(cfg: Config, stop: asyncio.Event) -> None:
    async with await Client.connect(cfg.nats, producer="notifier") as fd:
        after = load_state(cfg.state)
        if after is None:  # a first start: only what happens from now on
            after = await fd.last_seq()
            save_state(cfg.state, after)
        log.info("notifier.following", after_seq=after, on=[t.__name__ for t in cfg.on], url=cfg.url)
        timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            following = asyncio.create_task(follow(fd, http, cfg, after))
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait({following, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            following.cancel()  # a post in flight is not recorded as handled: the next start posts it again
            with contextlib.suppress(asyncio.CancelledError):
                await following
    log.info("notifier.stopped")


def config(argv: Sequence[str]) -> Config:
    parser = argparse.ArgumentParser(prog="notifier.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the webhook endpoint (http or https)")
    parser.add_argument("--secret-file", type=Path, required=True, help="the shared HMAC secret, one line")
    parser.add_argument("--nats", default=None, help="the broker (default: $FLIGHTDECK_NATS_URL, else local)")
    parser.add_argument("--state", type=Path, default=Path("notifier.json"),
                        help="where the last handled sequence is kept (default: ./notifier.json)")
    parser.add_argument("--on", default=",".join(DEFAULT_ON), help="event types to post, comma-separated")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="per request (default: 10)")
    args = parser.parse_args(argv)
    url = urlsplit(args.url)
    if url.scheme not in ("http", "https") or not url.netloc:
        parser.error(f"--url {args.url!r}: give an http:// or https:// URL")
    try:
        secret = args.secret_file.read_bytes().strip()
    except OSError as exc:
        parser.error(f"--secret-file {args.secret_file}: {exc.strerror or exc}")
    if not secret:
        parser.error(f"--secret-file {args.secret_file} is empty: a webhook signed with no secret proves nothing")
    names = [n.strip() for n in args.on.split(",") if n.strip()]
    if unknown := [n for n in names if n not in BY_NAME]:
        parser.error(f"--on: no event type {', '.join(unknown)} in the catalog")
    if not names:
        parser.error("--on: name at least one event type")
    if not args.timeout_s > 0:
        parser.error("--timeout-s must be above 0")
    return Config(url=args.url, secret=secret, state=args.state, on=tuple(BY_NAME[n] for n in names),
                  nats=args.nats, timeout_s=args.timeout_s)


def main(argv: Sequence[str] | None = None) -> int:
    cfg = config(sys.argv[1:] if argv is None else argv)

    async def go() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await run(cfg, stop)

    try:
        asyncio.run(go())
    except (ClientError, ValueError) as exc:  # ValueError: an --on type that is not a control event
        print(f"notifier: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
