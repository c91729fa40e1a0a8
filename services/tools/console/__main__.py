"""The `flightdeck` entry point. A verb is one module exposing `COMMAND`, plus one line in COMMANDS."""

import argparse
import logging
import os
import sys

import structlog

from events.store import StoreUnavailable
from services.shell.broker import BrokerError
from services.shell.logging import CurrentStderr
from services.tools.cli import EXIT_ERROR, Command, UserError
from services.tools.console import (
    agent_cmd,
    cancel,
    checkpoints_cmd,
    command_cmds,
    down,
    events_cmd,
    logs_cmd,
    plan_cmd,
    status,
    submit,
    ui_cmd,
    up,
    watch_cmd,
)
from services.tools.console.export_cmd import COMMAND as EXPORT
from services.tools.console.import_cmd import COMMAND as IMPORT
from services.tools.console.postmortem_cmd import COMMAND as POSTMORTEM
from services.tools.console.replay_cmd import COMMAND as REPLAY
from services.tools.console.verify_cmd import COMMAND as VERIFY
from services.tools.console.whatif_cmd import COMMAND as WHATIF

COMMANDS: tuple[Command, ...] = (
    up.COMMAND,
    down.COMMAND,
    events_cmd.COMMAND, logs_cmd.COMMAND,
    submit.COMMAND, watch_cmd.COMMAND, status.COMMAND, cancel.COMMAND,
    command_cmds.PAUSE, command_cmds.RESUME, command_cmds.CHECKPOINT, command_cmds.ROLLBACK, checkpoints_cmd.COMMAND,
    agent_cmd.COMMAND,
    plan_cmd.COMMAND,
    REPLAY, EXPORT, IMPORT,
    VERIFY,
    WHATIF,
    POSTMORTEM,
    ui_cmd.COMMAND,
)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="flightdeck", description="Flightdeck: an event-sourced control plane "
                                  "for distributed PyTorch training on NATS JetStream")
    verbs = top.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        sub = verbs.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    return top


def configure_logging() -> None:
    """Our own logs go to stderr, so stdout carries only what a command prints (pipes, --json)."""
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="%H:%M:%S"),
                    structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(CurrentStderr()),  # type: ignore[arg-type]
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    configure_logging()
    try:
        code: int = args.run(args)
    except UserError as exc:
        print(f"flightdeck {args.command}: {exc}", file=sys.stderr)
        return exc.code
    except (StoreUnavailable, BrokerError) as exc:
        print(f"flightdeck {args.command}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`flightdeck events ... | head`): not an error; keep Python from
        # complaining again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
