"""The archiver's record: which of a job's telemetry and output is kept in the object store past the streams'
age-out, and what was already gone when it looked."""

from flightdeck.events.base import JobEvent


class HistoryArchived(JobEvent, frozen=True, kw_only=True):
    """Every message of the job in `stream` with a sequence from `first_seq` to `last_seq` is in the segment at
    `key` (`count` messages, `bytes` stored, their `sha256`). `lost_from`..`lost_to` (when `lost_to` > 0): stream
    sequences that had aged out before the archiver read them; the job's messages among them, if any, are lost
    (`lost_from` 0: from the job's start). `final`: the job had ended, nothing of it in `stream` comes later."""

    stream: str
    first_seq: int
    last_seq: int
    count: int
    bytes: int
    sha256: str
    key: str
    lost_from: int = 0
    lost_to: int = 0
    final: bool = False
