"""`flightdeck pause|resume|checkpoint JOB`: a person's commands to a running job's ranks, appended to its history
(the ranks obey them at their next step boundary, all at the same step). A job that is not running is told so and
nothing is appended: only running ranks read commands. The client (services/tools/client.py) sends them."""

import argparse
import asyncio
from collections.abc import Awaitable, Callable

from flightdeck.services.shell.broker import nats_url
from flightdeck.services.tools.cli import Command, add_json_argument, add_nats_argument, print_json
from flightdeck.services.tools.client import Client

Send = Callable[[Client, str, str], Awaitable[None]]


async def send(url: str, job_id: str, verb: Send, reason: str) -> None:
    async with await Client.connect(url) as fd:
        await verb(fd, job_id, reason)


def _command(name: str, verb: Send, event: str, help: str) -> Command:
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("job", metavar="JOB", help="the job id (as `flightdeck submit` printed it)")
        parser.add_argument("--reason", default="", help="why, for the record")
        add_json_argument(parser, "what was sent (job_id, sent: the command's event type)")
        add_nats_argument(parser)

    def run(args: argparse.Namespace) -> int:
        asyncio.run(send(nats_url(args.nats), args.job, verb, args.reason or f"{name} by the user"))
        if args.json:
            print_json({"job_id": args.job, "sent": event})
        else:
            print(f"{args.job}: {event} sent; its ranks obey it at their next step boundary")
        return 0

    return Command(name, help, add_arguments, run)


PAUSE = _command("pause", Client.pause, "PauseRequested",
                 "pause a running job: its ranks stop stepping (hang detection pauses too)")
RESUME = _command("resume", Client.resume, "ResumeRequested", "resume a paused job")
CHECKPOINT = _command("checkpoint", Client.checkpoint, "CheckpointRequested",
                      "checkpoint a running job now, beside its checkpoint_every")


def _rollback_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="the job id (as `flightdeck submit` printed it)")
    parser.add_argument("--to-step", type=int, required=True, help="roll back to the newest checkpoint at or before "
                        "this step (`flightdeck checkpoints JOB` lists them)")
    parser.add_argument("--skip", type=_window, default=None, metavar="FROM:TO",
                        help="then skip the batches FROM..TO-1 (batch indices, as a loss-spike rollback does)")
    parser.add_argument("--reason", default="", help="why, for the record")
    add_json_argument(parser, "what was asked (job_id, checkpoint_id)")
    add_nats_argument(parser)


def _window(text: str) -> tuple[int, int]:
    a, sep, b = text.partition(":")
    if not sep or not a.isdigit() or not b.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not FROM:TO (two batch indices)")
    return int(a), int(b)


def _rollback(args: argparse.Namespace) -> int:
    async def go() -> str:
        async with await Client.connect(nats_url(args.nats)) as fd:
            return await fd.rollback(args.job, args.to_step, skip=args.skip, reason=args.reason or "asked by the user")
    target = asyncio.run(go())
    if args.json:
        print_json({"job_id": args.job, "checkpoint_id": target, "asked": "RollbackAsked"})
        return 0
    print(f"{args.job}: rollback to {target} asked; the scheduler decides it and the ranks report RolledBack")
    return 0


ROLLBACK = Command("rollback", "roll a running job back to a checkpoint, optionally skipping a batch window",
                   _rollback_arguments, _rollback)
