"""The trainer API's refusals of how a script calls it (a wrong type, a call out of order). They are raised as the
plain TypeError, ValueError or RuntimeError a user expects, marked so the rank's fault says a restart cannot help:
the same code fails the same way on any slot (events/training.RankFault.usage)."""

_MARK = "flightdeck_usage"


def refused(exc: BaseException) -> BaseException:
    """`exc`, marked as the API's refusal of the script's call: `raise refused(TypeError(...))`."""
    setattr(exc, _MARK, True)
    return exc


def is_refusal(exc: BaseException) -> bool:
    return bool(getattr(exc, _MARK, False))
