"""What a running rank holds open: its threads and its TCP connections, for the built-in trainer (world 1) started
by hand against a local nats-server. A tree from before issue 33 (no trainer/link.py) gets the broker's URL with
`--nats`, as its ranks did; a tree with the link gets the real agent end (services/agent/links.py) instead.

    .venv/bin/python bench/rank_threads.py                     # this checkout
    .venv/bin/python bench/rank_threads.py --tree /tmp/before   # e.g. `git worktree add /tmp/before 13d7262`
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1])
ap.add_argument("--steps", type=int, default=20, help="steps to wait for before counting")
args = ap.parse_args()
root = args.tree.resolve()
sys.path.insert(0, str(root))

from flightdeck.services.shell import broker as broker_mod  # noqa: E402
from tests.conftest import ensure_streams_at  # noqa: E402
from tests.trainer import ranks  # noqa: E402

linked = (root / "trainer" / "link.py").exists()
tmp = Path(tempfile.mkdtemp(prefix="fd-rank-threads-"))
b = broker_mod.start(tmp / "nats")
host = None
try:
    ensure_streams_at(b.url)
    spec = ranks.write_spec(tmp / "job.toml", train={"steps": 100_000, "checkpoint_every": 100_000})
    if linked:
        from tests.trainer.linkhost import LinkHost

        host = LinkHost(b.url).__enter__()
        flags: tuple[str, ...] = host.args()
    else:
        flags = ("--nats", b.url)
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(broker_mod.free_port()), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    log = tmp / "events.jsonl"
    cmd = [sys.executable, "-m", "flightdeck.trainer", "--job-id", "job-t", "--spec", str(spec), "--device", "cpu",
           "--staging", str(tmp / "staging"), "--events-log", str(log), *flags]
    with (tmp / "rank.log").open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        ranks.wait_for(lambda: len(ranks.events(log, "StepCompleted")) >= args.steps, 300, "steps")
        time.sleep(2.0)  # past start-up: only what stays open
        threads = len(os.listdir(f"/proc/{proc.pid}/task"))
        sockets = subprocess.run(["ss", "-tnp"], capture_output=True, text=True).stdout.count(f"pid={proc.pid},")
    finally:
        proc.kill()
        proc.wait()
    print(json.dumps({"tree": str(root), "link": linked, "threads": threads, "tcp_connections": sockets}))
finally:
    if host is not None:
        host.close()
    b.stop()
