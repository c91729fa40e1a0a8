"""`flightdeck checkpoints JOB`: the job's committed checkpoints from its history, oldest first: when each was
last verified against its manifest (its commit, then the scrubber's reads of the store), the ones found bad and
why, and the ones deleted and why (`--json` for scripts)."""

import argparse
import asyncio
import sys
from datetime import UTC, datetime

import msgspec

from flightdeck.events import codec
from flightdeck.services.shell.broker import nats_url
from flightdeck.services.tools.cli import Command, add_nats_argument
from flightdeck.services.tools.client import Client
from flightdeck.services.tools.connect import open_store
from flightdeck.services.tools.history.jobview import CheckpointEntry


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="the job id (as `flightdeck submit` printed it)")
    parser.add_argument("--json", action="store_true", help="a JSON list, one object per checkpoint")
    add_nats_argument(parser)


def size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def state(c: CheckpointEntry) -> str:
    if c.bad:
        return f"BAD ({c.bad[:160]})" + (", deleted" if c.deleted else "")
    return f"deleted ({c.deleted_reason})" if c.deleted else "kept"


def verified(c: CheckpointEntry) -> str:
    """When its stored bytes last matched the manifest, in UTC ("-" when a scrub found them changed)."""
    if c.bad or not c.verified_at:
        return "-"
    return datetime.fromtimestamp(c.verified_at, UTC).strftime("%Y-%m-%d %H:%M:%S")


def table(entries: tuple[CheckpointEntry, ...]) -> str:
    head = ("CHECKPOINT", "STEP", "WORLD", "SIZE", "VERIFIED (UTC)", "STATE", "URI")
    rows = [head] + [(c.checkpoint_id, str(c.step), str(c.world_size), size(c.bytes), verified(c), state(c), c.uri)
                     for c in entries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    right = {1, 2, 3}
    return "\n".join("  ".join(c.rjust(w) if i in right else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip() for r in rows)


def run(args: argparse.Namespace) -> int:
    url = nats_url(args.nats)

    async def go() -> tuple[CheckpointEntry, ...]:
        async with open_store(url) as store:
            return (await Client(store, url).status(args.job)).checkpoints

    entries = asyncio.run(go())
    if args.json:
        sys.stdout.write(codec.to_json(msgspec.to_builtins(list(entries))).decode() + "\n")
    elif entries:
        print(table(entries))
    else:
        print(f"{args.job} has no committed checkpoint yet")
    return 0


COMMAND = Command("checkpoints", "a job's committed checkpoints: last verified, found bad, deleted", add_arguments,
                  run)
