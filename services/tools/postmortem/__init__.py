"""Postmortems: what happened to one job, told from its recorded history (`flightdeck postmortem`).

Analysis is separate from rendering: scan.py reads the rows once into columns and the few events that
matter; incidents.py walks each fault to its detection and the decision taken, resolution.py to how that
played out; goodput.py splits the wall time into useful training and the badput parts; analysis.py puts
them together. plots.py draws the PNGs and report.py writes report.md and a self-contained report.html.
synthetic.py makes realistic histories of any length for the benchmark and the tests.

    pm = analyse(rows, job_id)            # rows: list[events.store.Stored], each stream in order
    paths = write_report(pm, out_dir)     # report.md, report.html, loss.png, step_rate.png, time.png
"""

from services.tools.postmortem.analysis import Postmortem, analyse
from services.tools.postmortem.report import write_report

__all__ = ["Postmortem", "analyse", "write_report"]
