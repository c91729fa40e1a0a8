"""The one line a failed rank's exit record carries as its error (RankExit.error, JobFailed's reason): the
exception its traceback ended with, not the log lines around it (a reason read "rank 1 exited with code 3:
2026-11-28 10:50:49 [info] bus.connected ...")."""

from flightdeck.services.agent.rankproc import error_line, error_of


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


def test_without_a_traceback_the_error_is_the_last_line_naming_one_never_a_library_s_info_record() -> None:
    assert error_of("step 3\nCUDA error: an illegal memory access was encountered\n"
                    "2026-11-28 10:50:49 [info     ] bus.closed\nINFO:root:bye\n"
                    "2026-11-28 10:50:49,123 WARNING shutting down") \
        == "CUDA error: an illegal memory access was encountered"
    assert error_of("loading\n2026-11-28 10:50:49 [error    ] shard 3 missing\n2026-11-28 10:50:50 [info ] exit") \
        == "2026-11-28 10:50:49 [error    ] shard 3 missing"  # a record logged as an error is one
    assert error_of("terminate called after throwing an instance of 'c10::Error'\nAborted (core dumped)") \
        == "Aborted (core dumped)"
    assert error_of("Traceback (most recent call last):\n  File \"a.py\"\nOSError: disk full\nfatal: later") \
        == "OSError: disk full"  # the traceback's exception first
    # nothing names an error: none is made up (the reason then says only how the rank ended)
    assert error_of("2026-11-28 10:50:49 [info     ] bus.connected\nexiting with 3\nbye") == ""
    assert error_of("") == ""
