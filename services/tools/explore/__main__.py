"""Run seeds of the fault explorer: `python -m flightdeck.services.tools.explore --seeds 1000 [--from N]`, or one
seed with its schedule and outcome: `python -m flightdeck.services.tools.explore --seed N -v`. Exit 1 when any seed
broke an invariant."""

import argparse
import asyncio
import logging
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import structlog

from flightdeck.services.tools.explore.invariants import violations
from flightdeck.services.tools.explore.world import plan, simulate


def replay_command(seed: int) -> str:
    return f".venv/bin/python -m flightdeck.services.tools.explore --seed {seed} -v"


async def explore(first: int, count: int, *, verbose: bool = False, budget_s: float = 0.0,
                  progress_every: int = 0) -> tuple[int, list[str]]:
    """Run seeds first .. first+count-1 (stopping early once `budget_s` CPU-seconds are spent, when given); returns
    how many ran and one line per failing seed. `progress_every`: print a line every that many seeds (a long soak
    cut short still says how far it got)."""
    failures = []
    began = time.process_time()
    ran = 0
    for seed in range(first, first + count):
        if budget_s and time.process_time() - began > budget_s:
            break
        p = plan(seed)
        run = await simulate(p)
        ran += 1
        broken = await violations(run)
        for _ in range(3):  # a simulation never waits, so the loop runs no callback until here: let it close the
            await asyncio.sleep(0)  # replays' unfinished readers, or each holds its run's whole history (13 GB)
        if verbose:
            print(f"seed {seed}: {len(p.jobs)} jobs, faults: {'; '.join(map(str, p.faults)) or 'none'}")
            print(f"  ended after {run.ended_at:.1f}s simulated, {len(run.store.rows('FD_CONTROL'))} control events")
            for line in broken:
                print(f"  VIOLATION {line}")
        if broken:
            failures.append(f"seed {seed}: {broken[0]} (and {len(broken) - 1} more) -- replay: {replay_command(seed)}")
            print(failures[-1], flush=True)
        if progress_every and ran % progress_every == 0:
            print(f"progress: {ran} seeds from {first}, {len(failures)} violating, "
                  f"{time.process_time() - began:.0f} CPU-s", flush=True)
    return ran, failures


def _worker(first: int, count: int, budget_s: float) -> tuple[int, list[str]]:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    return asyncio.run(explore(first, count, budget_s=budget_s, progress_every=1000))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flightdeck.services.tools.explore", description=__doc__)
    ap.add_argument("--seed", type=int, help="run this one seed")
    ap.add_argument("--from", dest="first", type=int, default=0, help="the first seed (default 0)")
    ap.add_argument("--seeds", type=int, default=100, help="how many seeds (default 100)")
    ap.add_argument("--budget-s", type=float, default=0.0, help="stop after this many CPU-seconds")
    ap.add_argument("-j", "--jobs", type=int, default=1, help="processes, each a share of the seeds (default 1)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    first, count = (args.seed, 1) if args.seed is not None else (args.first, args.seeds)
    began, wall = time.process_time(), time.monotonic()
    if args.jobs > 1:
        share = -(-count // args.jobs)
        with ProcessPoolExecutor(args.jobs) as pool:
            done = list(pool.map(_worker, [first + i * share for i in range(args.jobs)],
                                 [min(share, count - i * share) for i in range(args.jobs)],
                                 [args.budget_s] * args.jobs))
        ran, failures = sum(n for n, _ in done), [f for _, fs in done for f in fs]
        took = args.jobs * (time.monotonic() - wall)  # the workers' CPU: each keeps one core busy
    else:
        ran, failures = asyncio.run(explore(first, count, verbose=args.verbose, budget_s=args.budget_s,
                                            progress_every=1000 if args.budget_s else 0))
        took = time.process_time() - began
    print(f"{ran} seeds from {first}, {len(failures)} violating, {took:.1f} CPU-s in {time.monotonic() - wall:.0f} s, "
          f"{ran / max(took, 1e-9):.1f} seeds per CPU-second")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
