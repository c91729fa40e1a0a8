"""Postmortems: what happened to one job, told from its recorded history (`flightdeck postmortem`).

Why it works this way: docs/internals.md, "8. Operator tools".
"""

from flightdeck.services.tools.postmortem.analysis import Postmortem, analyse
from flightdeck.services.tools.postmortem.report import write_report

__all__ = ["Postmortem", "analyse", "write_report"]
