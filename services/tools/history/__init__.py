"""A job's recorded history: the `.fdh` file format, reading it from a broker, a read-only store over it.

Why it works this way: docs/internals.md, "8. Operator tools".
"""

from flightdeck.services.tools.history.args import add_history_arguments, history_from_args
from flightdeck.services.tools.history.library import BadHistory, History, HistoryNotFound, open_history

__all__ = ["BadHistory", "History", "HistoryNotFound", "add_history_arguments", "history_from_args", "open_history"]
