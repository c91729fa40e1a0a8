"""`flightdeck events --json`: the envelope of each line (where the message is stored) is never replaced by an
event's own field of the same name (HistoryArchived's `stream` names the stream it archived)."""

import json

from flightdeck.events import codec, subjects
from flightdeck.events.archive import HistoryArchived
from flightdeck.events.store import decoded
from flightdeck.services.tools.console.output import json_line


def test_an_events_own_stream_field_does_not_replace_where_it_is_stored() -> None:
    ev = HistoryArchived(job_id="j-000001", stream=subjects.TELEMETRY, first_seq=1, last_seq=9, count=9, bytes=99,
                         sha256="0" * 64, key="history/j-000001/FD_TELEMETRY/1-9.seg", job_version=7)
    subject = subjects.job("j-000001", "HistoryArchived")
    row = json.loads(json_line(decoded(subjects.CONTROL, 42, subject, codec.encode(ev), "m")))
    assert (row["stream"], row["seq"], row["subject"]) == (subjects.CONTROL, 42, subject)
    assert row["event_stream"] == subjects.TELEMETRY and row["job_version"] == 7 and row["type"] == "HistoryArchived"
