"""`flightdeck import job.fdh`: keep an exported history in the data dir's library, where replay, postmortem,
verify and whatif find it by its job id (a broker could not store it again at its recorded sequences)."""

import argparse
import sys
from pathlib import Path

from flightdeck.events import subjects
from flightdeck.services.tools.cli import EXIT_ERROR, Command, UserError, add_json_argument, print_json
from flightdeck.services.tools.history import fdh, library


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="a history file, as `flightdeck export` writes it")
    parser.add_argument("--job", default=None, help="the job to import when the file holds several")
    parser.add_argument("--data-dir", metavar="DIR", default=None, help="where imported histories live (default: "
                        "$FLIGHTDECK_DATA_DIR, else ./.flightdeck)")
    parser.add_argument("--force", action="store_true", help="replace a different history already imported "
                        "for the same job")
    add_json_argument(parser, "what was imported (job_id, path, messages per stream)")


def run(args: argparse.Namespace) -> int:
    incoming = library.file_history(args.file, args.job)  # the whole file is checked before anything is written
    target = library.library_path(args.data_dir, incoming.job_id)
    if target.exists() and not args.force:
        kept = fdh.load(target)
        same = [(s.stream, s.seq, s.msg_id, s.data) for s in kept] == [
            (s.stream, s.seq, s.msg_id, s.data) for s in incoming.rows]
        if not same:
            raise UserError(f"{target} already holds a different history of {incoming.job_id}: pass --force to "
                            "replace it", EXIT_ERROR)
    history, path = library.import_file(Path(args.file), args.data_dir, incoming.job_id)
    if args.json:
        print_json({"job_id": history.job_id, "path": str(path),
                    "messages": {s: len(history.stream(s)) for s in subjects.HISTORY_STREAMS}})
        return 0
    counts = ", ".join(f"{len(history.stream(s))} {s}" for s in subjects.HISTORY_STREAMS)
    print(f"imported {history.job_id} ({counts}) into {path}; `flightdeck replay {history.job_id}"
          f"{'' if args.data_dir is None else ' --data-dir ' + str(args.data_dir)}` reads it")
    sys.stdout.flush()
    return 0


COMMAND = Command("import", "keep an exported history (.fdh) where replay/postmortem/verify/whatif find it",
                  add_arguments, run)
