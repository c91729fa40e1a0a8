"""The arguments every history verb shares (JOB, --from, --data-dir, --nats) and the history they name."""

import argparse

from flightdeck.services.tools.cli import add_nats_argument
from flightdeck.services.tools.history.library import History, open_history


def add_history_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", nargs="?",
                        help="the job id: an imported history (flightdeck import) first, else the live broker")
    parser.add_argument("--from", dest="from_file", metavar="FILE", default=None,
                        help="read this history file (.fdh, as `flightdeck export` writes) instead")
    parser.add_argument("--data-dir", metavar="DIR", default=None, help="where imported histories live (default: "
                        "$FLIGHTDECK_DATA_DIR, else ./.flightdeck)")
    add_nats_argument(parser)


async def history_from_args(args: argparse.Namespace, *, output: bool = False) -> History:
    """The history the verb's arguments name; with `output`, read from the broker, the ranks' output too."""
    return await open_history(args.job, from_file=args.from_file, data_dir=args.data_dir, nats=args.nats,
                              output=output)
