"""What every verb shares: the Command record, user errors, and how a command finds the broker."""

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from flightdeck.services.shell import broker

EXIT_ERROR = 1  # something the user can fix in the environment: broker unreachable, port taken
EXIT_NOT_FOUND = 2  # the thing named does not exist: an unknown job
EXIT_INVALID = 2  # a spec the user must fix, like an unknown job: nothing was appended
EXIT_INCOMPLETE = 3  # the history lacks inputs (aged out before they were archived): a check could not be made


@dataclass(frozen=True)
class Command:
    """One verb: its name, one line of help, its arguments, and what runs it (returns the exit code)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class UserError(Exception):
    """An error the user caused or can fix: printed as one line, no traceback."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


def add_json_argument(parser: argparse.ArgumentParser, what: str = "the result") -> None:
    parser.add_argument("--json", action="store_true", help=f"{what} as one JSON object on stdout")


def print_json(body: object) -> None:
    """One JSON document on stdout (NaN as "nan", as every --json prints it)."""
    from flightdeck.events import codec

    sys.stdout.write(codec.to_json(body).decode() + "\n")
    sys.stdout.flush()


def add_nats_argument(parser: argparse.ArgumentParser, help: str = "") -> None:
    parser.add_argument("--nats", metavar="URL", default=None,
                        help=help or f"broker URL (default: $FLIGHTDECK_NATS_URL, else {broker.DEFAULT_URL})")


def unreachable(url: str, reason: object = "") -> UserError:
    why = f" ({reason})" if reason else ""
    return UserError(f"cannot reach the broker at {url}{why}: start it with `flightdeck up`, "
                     "or point --nats / FLIGHTDECK_NATS_URL at a running one")
