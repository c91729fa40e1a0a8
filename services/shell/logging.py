"""Logging for service processes: one JSON object per line on stderr, with context bound per service
and per input (structlog contextvars), and the standard library's records (nats-py's) rendered the same way."""

import logging
import os
import sys
from typing import Any, TextIO

import structlog

LEVEL_ENV = "FLIGHTDECK_LOG_LEVEL"

_SHARED: list[Any] = [
    structlog.contextvars.merge_contextvars,
    structlog.processors.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


class CurrentStderr:
    """A file that is whatever `sys.stderr` is when a line is written. Binding the stream at configure time
    leaves every later logger writing into a file that may be closed by then (a test's captured stderr, a
    process that swapped its streams): the log call then raises instead of logging."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def configure(level: str | None = None, *, stream: TextIO | None = None) -> None:
    """Send structlog and stdlib logging to `stream` (default: the current stderr, looked up per line) as JSON
    lines, at `level` (default: $FLIGHTDECK_LOG_LEVEL or INFO)."""
    out: Any = CurrentStderr() if stream is None else stream
    name = (level or os.environ.get(LEVEL_ENV) or "INFO").upper()
    number = logging.getLevelName(name)
    if not isinstance(number, int):
        raise ValueError(f"log level {name!r} is not one of DEBUG, INFO, WARNING, ERROR")
    structlog.configure(
        processors=[*_SHARED, structlog.processors.StackInfoRenderer(), structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(number),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, structlog.processors.JSONRenderer()],
        foreign_pre_chain=[*_SHARED, structlog.stdlib.add_logger_name],
    ))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(number, logging.INFO))


def bind(**context: Any) -> None:
    """Bind context to every log line of this task and the tasks it starts (e.g. service=...)."""
    structlog.contextvars.bind_contextvars(**context)
