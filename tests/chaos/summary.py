"""The chaos runs as the README's reliability table wants them: per drill and per fault, how many times it ran and
what held, from the outcome lines the drills append to $FLIGHTDECK_CHAOS_RECORD (tests/chaos/checks.py).

    FLIGHTDECK_CHAOS_RECORD=/tmp/chaos.jsonl make chaos     # as many times as wanted
    python -m tests.chaos.summary /tmp/chaos.jsonl --out bench/results/chaos-runs.json
"""

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def summarize(outcomes: list[dict[str, Any]], suites: Sequence[str] = (), notes: Sequence[str] = ()) -> dict[str, Any]:
    drills: dict[str, Any] = {}
    for drill in sorted({o["drill"] for o in outcomes}):
        runs = [o for o in outcomes if o["drill"] == drill]
        faults: dict[str, int] = {}
        for o in runs:
            for f in o["faults"]:
                faults[f] = faults.get(f, 0) + 1
        drills[drill] = {
            "runs": len(runs),
            "faults_injected": faults,
            "held": sum(o["held"] for o in runs),
            "job_completed": sum(o["completed"] for o in runs),
            "verify_passed": sum(not o["divergences"] for o in runs),
            "no_step_lost": sum(not o["missing_steps"] for o in runs),
            "no_step_twice": sum(not o["repeated_steps"] for o in runs),
            "no_decision_twice": sum(not o["repeated_decisions"] for o in runs),
            "decisions_verified": [sum(o["decisions_verified"].values()) for o in runs],
            "attempts": [o["attempts"] for o in runs],
            "rank_findings": [len(o["findings"]) for o in runs],
            "seconds_median": statistics.median(o["seconds"] for o in runs),
        }
    return {"outcomes": len(outcomes), "suite_runs": list(suites), "drills": drills, "notes": list(notes)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.summary", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("record", type=Path, help="the JSON-lines file the drills appended to")
    parser.add_argument("--out", type=Path, help="write the summary here (default: print it)")
    parser.add_argument("--suite", action="append", default=[], help="one whole run of the suite, as text "
                        "(wall time, load, result); repeat per run")
    parser.add_argument("--note", action="append", default=[], help="a note to keep with the figures; repeatable")
    args = parser.parse_args(argv)
    outcomes = [json.loads(line) for line in args.record.read_text().splitlines() if line.strip()]
    text = json.dumps(summarize(outcomes, args.suite, args.note), indent=2) + "\n"
    if args.out:
        args.out.write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
