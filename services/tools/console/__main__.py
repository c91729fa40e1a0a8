"""The `flightdeck` entry point. A verb is one module exposing `COMMAND`, plus one line in VERBS."""

import argparse
import importlib
import importlib.metadata
import logging
import os
import sys

import structlog

from flightdeck.events.store import StoreUnavailable
from flightdeck.services.shell.broker import BrokerError
from flightdeck.services.shell.logging import CurrentStderr
from flightdeck.services.tools.cli import EXIT_ERROR, Command, UserError

# Verb -> (module under services.tools.console, attribute), in the order `--help` lists them. Only the verb that runs
# is imported (`flightdeck --help` imports them all): `status` need not load the dashboard's server, the node agent
# or the postmortem's plotting, which made every command's start cost four times what its own module does.
VERBS: dict[str, tuple[str, str]] = {
    "up": ("up", "COMMAND"), "down": ("down", "COMMAND"),
    "events": ("events_cmd", "COMMAND"), "logs": ("logs_cmd", "COMMAND"),
    "submit": ("submit", "COMMAND"), "watch": ("watch_cmd", "COMMAND"), "status": ("status", "COMMAND"),
    "jobs": ("jobs_cmd", "COMMAND"),
    "cancel": ("cancel", "COMMAND"),
    "pause": ("command_cmds", "PAUSE"), "resume": ("command_cmds", "RESUME"),
    "checkpoint": ("command_cmds", "CHECKPOINT"), "rollback": ("command_cmds", "ROLLBACK"),
    "checkpoints": ("checkpoints_cmd", "COMMAND"),
    "agent": ("agent_cmd", "COMMAND"),
    "plan": ("plan_cmd", "COMMAND"),
    "replay": ("replay_cmd", "COMMAND"), "export": ("export_cmd", "COMMAND"), "import": ("import_cmd", "COMMAND"),
    "verify": ("verify_cmd", "COMMAND"),
    "whatif": ("whatif_cmd", "COMMAND"),
    "postmortem": ("postmortem_cmd", "COMMAND"),
    "ui": ("ui_cmd", "COMMAND"),
    "completion": ("completion_cmd", "COMMAND"),
}


def version() -> str:
    """The installed distribution's version (a checkout installed with `pip install -e .` has one too)."""
    try:
        return importlib.metadata.version("flightdeck")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed: `pip install -e .`)"


def command(verb: str) -> Command:
    module, attribute = VERBS[verb]
    found: Command = getattr(importlib.import_module(f"flightdeck.services.tools.console.{module}"), attribute)
    return found


def commands() -> tuple[Command, ...]:
    """Every verb's command (imports them all)."""
    return tuple(command(verb) for verb in VERBS)


def parser(verb: str | None = None) -> argparse.ArgumentParser:
    """The command line; with `verb` (a known one), that verb alone: the others are never imported."""
    top = argparse.ArgumentParser(prog="flightdeck", description="Flightdeck: an event-sourced control plane "
                                  "for distributed PyTorch training on NATS JetStream")
    top.add_argument("--version", "-V", action="version", version=f"flightdeck {version()}")
    verbs = top.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for found in (command(verb),) if verb in VERBS else commands():
        sub = verbs.add_parser(found.name, help=found.help, description=found.help)
        found.add_arguments(sub)
        sub.set_defaults(run=found.run)
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
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["--version"], ["-V"]):  # no verb needs importing for it
        print(f"flightdeck {version()}")
        return 0
    args = parser(argv[0] if argv else None).parse_args(argv)
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
