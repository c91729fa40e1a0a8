"""A job's recorded history: the `.fdh` file format, reading it from a broker, a read-only store over it.

What the history verbs (replay, export, import, postmortem, verify, whatif) build on:

    from services.tools.history import History, open_history, add_history_arguments, history_from_args

    async def open_history(job: str | None = None, *, from_file: Path | str | None = None,
                           data_dir: Path | str | None = None, nats: str | None = None) -> History
        from_file given: that .fdh file (job picks one of its jobs, else the header's / the only one);
        else job from <data-dir>/histories/<job>.fdh if imported, else from the broker at nats.
        Errors are UserErrors (one line, an exit code: HistoryNotFound -> 2, BadHistory -> 1);
        StoreUnavailable passes through (the CLI's main prints it).

    History: .job_id: str, .rows: list[Stored] (FD_CONTROL, then FD_TELEMETRY, then FD_DEAD, each in
        recorded stream order, recorded sequences kept, gaps allowed), .store: RecordedStore (read-only
        EventStore over rows: services.fold.replay(service, history.store) folds as live),
        .source: str (where it came from, for output), .header: fdh.Header | None,
        .stream(name) -> list[Stored], .job_control() -> the job's own fd.ctl.job.<job>.* rows.

    add_history_arguments(parser)   JOB, --from FILE, --data-dir, --nats (argparse)
    await history_from_args(args)   open_history from those arguments

    fdh.load(path | bytes) -> list[Stored]; fdh.read(...) -> Recorded(header, rows); fdh.dump(rows, job_id=...,
        source=...) -> Iterator[bytes] (lines); fdh.BadHistoryFile names the file and line.
    read.job_rows(store, job_id) -> list[Stored]: FD_CONTROL up to the job's last event, fd.tel.<job>.>, FD_DEAD.
    library.import_file(path, data_dir, job_id=None) -> (History, Path)
"""

from services.tools.history.args import add_history_arguments, history_from_args
from services.tools.history.library import BadHistory, History, HistoryNotFound, open_history

__all__ = ["BadHistory", "History", "HistoryNotFound", "add_history_arguments", "history_from_args", "open_history"]
