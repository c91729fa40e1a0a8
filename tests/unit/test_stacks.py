"""SIGUSR1 makes a process say where it waits (services/shell/stacks.py): every thread's stack from
faulthandler, then every asyncio task's await chain as log lines. A hung agent in a test is asked for it."""

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sigusr1_dumps_every_threads_stack_and_every_tasks_await_chain() -> None:
    probe = subprocess.Popen([sys.executable, str(ROOT / "tests/fixtures/stacks_probe.py")], cwd=ROOT,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    try:
        assert probe.stdout is not None and probe.stdout.readline() == "ready\n"
        probe.send_signal(signal.SIGUSR1)
        assert probe.stderr is not None
        lines: list[str] = []
        while not any('"tasks dumped"' in line for line in lines):
            line = probe.stderr.readline()
            assert line, f"the probe ended before its dump: {''.join(lines)}"
            lines.append(line)
        assert probe.poll() is None  # a dump, not an exit
    finally:
        assert probe.stdin is not None
        probe.stdin.close()
        probe.wait(60)
    text = "".join(lines)
    # faulthandler's part: every thread, the probe's holder among them, innermost frame first.
    assert text.count("hread 0x") >= 2
    assert re.search(r'stacks_probe.py", line \d+ in hold_here', text)
    tasks = {e["task"]: e["awaiting"] for e in map(json.loads, (x for x in lines if x.startswith("{")))
             if e["event"] == "task waiting"}
    assert tasks["parked"][0].endswith(" park_here")
    assert [where.rsplit(" ", 1)[-1] for where in tasks["parked"][:2]] == ["park_here", "wait"]
    assert tasks["parked"][-1] == "FutureIter"
    assert tasks["Task-1"][0].endswith(" main")
