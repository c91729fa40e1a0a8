"""What ranks print: their stdout and stderr, shipped line by line by the node agent that runs them, on the
FD_LOGS stream (size- and age-limited, apart from telemetry so a chatty script cannot crowd it out)."""

from flightdeck.events.base import RankEvent

MAX_LINE = 2048  # characters of one line; a longer one is cut, saying how much was cut
MAX_LINES = 512  # lines in one RankOutput


class RankOutput(RankEvent, frozen=True, kw_only=True):
    """Lines a rank printed, in order. `first_line` numbers them within the rank's attempt (from 0), so a reader
    sees gaps; `dropped` lines were over the rank's rate limit just before these (their count, not their text)."""

    first_line: int
    lines: list[str]
    dropped: int = 0
