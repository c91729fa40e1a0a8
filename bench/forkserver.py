"""What it costs a node agent to have its warm standbys ready and its self-check done: started cold (each an
interpreter that imports torch and the trainer itself, as before the fork server) against forked by the node's
fork server (services/agent/forkserver.py, the default now), interleaved in one run on this machine.

    .venv/bin/python bench/forkserver.py                      # 3 standbys (2 slots + 1) and a self-check, 3 rounds
    .venv/bin/python bench/forkserver.py --rounds 5 --out bench/results/cpu-forkserver.json

Per round and way:
    selfcheck_s   the self-check's verdict, from asking (forked: the fork server's own start and imports included,
                  as an agent waits for them)
    ready_s       then the pool's standbys, all started at once as an agent's pool fills: each one's start to READY
                  (forked: once the server has imported all a rank imports)
    all_ready_s   from asking for the self-check until every standby is ready: a new node's warm-up
    cpu_s         CPU time (user + sys) of every process involved, the fork server's imports included, read from
                  RUSAGE_CHILDREN once all of them have been reaped
"""

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flightdeck.services.agent.forkserver import ForkServer
from flightdeck.services.agent.inventory import Inventory, selfcheck
from flightdeck.services.agent.launch import REPO, die_with_agent, standby_env
from flightdeck.services.agent.standbys import StandbyPool


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


async def one(way: str, standbys: int, tmp: Path) -> dict[str, Any]:
    log = tmp / f"{way}.log"
    preexec = die_with_agent(os.getpid())
    forks = ForkServer(python=sys.executable, env=standby_env(), cwd=REPO, log_file=log, preexec=preexec) \
        if way == "forked" else None
    pool = StandbyPool(size=standbys, python=sys.executable, env=standby_env(), cwd=REPO, log_file=log,
                       preexec=preexec, producer="bench", refill_delay_s=0.0, forks=forks)
    cpu0 = children_cpu()
    try:
        asked = time.perf_counter()
        verdict = await selfcheck(sys.executable, Inventory(kind="cpu", slots=2, devices=["cpu", "cpu"],
                                                            memory_gb=0.0), 300, forks)
        selfcheck_s = time.perf_counter() - asked
        assert verdict.ok, verdict
        pool.start()
        ready: dict[int, float] = {}
        deadline = time.monotonic() + 300
        while len(ready) < standbys:
            assert time.monotonic() < deadline, "standbys not ready in 300 s"
            for s in pool.idle:
                if s.ready and s.proc.pid not in ready:
                    ready[s.proc.pid] = time.monotonic() - s.started
            await asyncio.sleep(0.01)
        all_ready_s = time.perf_counter() - asked
    finally:
        await pool.close()
        if forks is not None:
            await forks.close()
    return {"way": way, "selfcheck_s": round(selfcheck_s, 3), "ready_s": sorted(round(v, 3) for v in ready.values()),
            "all_ready_s": round(all_ready_s, 3),
            "cpu_s": round(children_cpu() - cpu0, 2), "load": round(os.getloadavg()[0], 2)}


async def bench(rounds: int, standbys: int) -> list[dict[str, Any]]:
    runs = []
    with tempfile.TemporaryDirectory(prefix="fd-forkserver-") as tmp:
        for n in range(rounds):
            for way in ("cold", "forked") if n % 2 == 0 else ("forked", "cold"):
                run = await one(way, standbys, Path(tmp))
                print(json.dumps(run), flush=True)
                runs.append(run)
    return runs


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def med(way: str, key: str) -> float:
        values: list[float] = []
        for r in runs:
            v = r[key]
            if r["way"] == way:
                values.extend(v if isinstance(v, list) else [v])
        return round(statistics.median(values), 3)

    out: dict[str, Any] = {}
    for key in ("selfcheck_s", "ready_s", "all_ready_s", "cpu_s"):
        cold, forked = med("cold", key), med("forked", key)
        out[key] = {"cold": cold, "forked": forked, "forked_over_cold": round(forked / cold, 3)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--standbys", type=int, default=3, help="the pool's size (an agent's default: slots + 1)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))  # the pool's info lines: quiet
    runs = asyncio.run(bench(args.rounds, args.standbys))
    result = {"rounds": args.rounds, "standbys": args.standbys, "cpus": os.cpu_count(), "runs": runs,
              "medians": summary(runs)}
    print(json.dumps(result["medians"], indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
