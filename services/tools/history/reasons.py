"""A decision's reason on one line, for the views that print a line per event (the demo's timeline, `watch`,
`status`). A restart's reason quotes the failed rank's last output, up to 20 lines (scheduler/policy.py):
"rank 1 exited with code 3: <output>; restart 1 of 3". The record keeps it all; `flightdeck logs` shows it."""

QUOTE = ": "
DECISION = "; "


def headline(reason: str) -> str:
    """`reason` without the rank output it quotes, when that output spans lines: what happened, and the
    decision the policy appended ("rank 1 exited with code 3; restart 1 of 3")."""
    text = reason.strip()
    if "\n" not in text:
        return text
    head = text.split("\n", 1)[0].split(QUOTE, 1)[0]
    last = text.rsplit("\n", 1)[1]
    return head + (DECISION + last.rsplit(DECISION, 1)[1] if DECISION in last else "")
