"""The one line a failed rank's exit record carries as its error (RankExit.error, JobFailed's reason): the
exception its traceback ended with, not the log lines around it (a reason read "rank 1 exited with code 3:
2026-11-28 10:50:49 [info] bus.connected ...")."""

from flightdeck.services.agent.rankproc import error_line


def test_the_error_is_the_last_unindented_line_after_the_last_traceback() -> None:
    tail = """2026-11-28 10:50:49 [info] bus.connected
Traceback (most recent call last):
  File "/x/train.py", line 3, in <module>
    import nope
ModuleNotFoundError: No module named 'nope'"""
    assert error_line(tail) == "ModuleNotFoundError: No module named 'nope'"
    chained = """Traceback (most recent call last):
  File "a.py", line 1, in <module>
KeyError: 'a'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "a.py", line 3, in <module>
    raise RuntimeError("boom")
RuntimeError: boom
2026-11-28 10:50:50 [info] a line printed by a thread after the traceback
"""
    assert error_line(chained) == "RuntimeError: boom"
    multiline = "Traceback (most recent call last):\n  File \"a.py\"\nValueError: first line\nsecond line\n"
    assert error_line(multiline) == "ValueError: first line"


def test_no_traceback_no_error() -> None:
    assert error_line("") == ""
    assert error_line("exiting with 3\nbye") == ""
    assert error_line("Traceback (most recent call last):\n  File \"a.py\"") == ""
