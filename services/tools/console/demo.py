"""`make demo`: a fault drill on this machine, start to finish, with the commands a person would type.

`flightdeck up --detach` on a fresh data dir (under .flightdeck-demo/) and a free port, `flightdeck submit
examples/demo.toml` (2 CPU ranks; a loss spike, then a crash, then a hang in the next attempt), a live
timeline of the job's events (phases, faults, findings, exits, checkpoints, rollbacks, restarts), a summary
of each incident (drill_summary.py), then `flightdeck status` and `flightdeck checkpoints`, and always
`flightdeck down`. Exit code 0 only if the job completed.

    python -m flightdeck.services.tools.console.demo [--spec FILE] [--data-dir DIR] [--timeout-s 300]
"""

import argparse
import asyncio
import heapq
import math
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from flightdeck.events import subjects
from flightdeck.events.base import Event
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointDeleted
from flightdeck.events.commands import RollbackRequested, StopRequested
from flightdeck.events.findings import Finding
from flightdeck.events.job import JobCompleted, JobPhaseChanged, JobResumed, JobSubmitted, WorkersExited
from flightdeck.events.spec import JobSpec, parse_spec
from flightdeck.events.store import Stored
from flightdeck.events.training import FaultInjected, Heartbeat, RankFault, RolledBack, StepCompleted
from flightdeck.services.shell import broker
from flightdeck.services.tools.cli import UserError
from flightdeck.services.tools.connect import open_store
from flightdeck.services.tools.console import drill_summary, metrics_peek, ui_cmd, up, upstate
from flightdeck.services.tools.console.checkpoints_cmd import size
from flightdeck.services.tools.console.following import follow
from flightdeck.services.tools.console.status import duration
from flightdeck.services.tools.history import jobview
from flightdeck.services.tools.history.jobview import JobView
from flightdeck.services.tools.history.read import job_rows
from flightdeck.services.tools.history.reasons import headline

REPO = Path(__file__).resolve().parents[3]
DEMO_ROOT = REPO / ".flightdeck-demo"
CLI = (sys.executable, "-m", "flightdeck.services.tools.console")
LABEL = 11
HOLD_S = 1.0  # a line waits until both streams are this far past it: a late, earlier line still goes first
WALL_HOLD_S = 5.0  # ... or has waited this long, when one stream is quiet
SLACK_S = 180
RETENTION = CheckpointDeleted(job_id="", checkpoint_id="").reason  # routine deletions: not worth a line
SOURCE_PREFIX = re.compile(r"^\[[^]]*\]\s*")  # gloo's "[/path/pair.cc:553] ": no help in a timeline
METRICS_WAIT_S = 60.0  # for the web server to fold the job's end and its analysis, on a busy box
PROGRESS_LINES = 8  # progress lines a pass over the whole run prints, about


def flightdeck(*args: str, timeout_s: float = 120.0, show: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one `flightdeck` command as a user would, echoing it and what it printed."""
    if show:
        print(f"$ flightdeck {' '.join(args)}", flush=True)
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    if show:
        for text in (done.stdout, done.stderr):
            if text.strip():
                print("  " + text.rstrip().replace("\n", "\n  "), flush=True)
    return done


class Timeline:
    """Prints one compact line per event worth seeing, folding the control history into a JobView as it goes."""

    def __init__(self, job_id: str, every: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.view = JobView(job_id=job_id)
        self.every = every  # print a progress line every this many steps
        self.base = 0.0
        self.shown = 0  # events taken (heartbeats left out): orders held lines of the same time by arrival
        self.spec: JobSpec | None = None
        # The control and telemetry streams arrive on their own, and a decision bears its input's time: a line waits
        # until both streams have passed its time by HOLD_S, or until it has waited WALL_HOLD_S since it arrived
        # (not since its own time: a follower running behind on a busy box would then print in arrival order).
        self.held: list[tuple[float, int, str, float]] = []  # time, arrival order, line, arrived on `clock`
        self.newest: dict[str, float] = {}
        self.clock = clock
        # Telemetry read before the job's JobSubmitted (the control follower ran behind): its times are only
        # known once the submission's is, so it waits for it (CI saw such lines print as seconds since 1970).
        self.early: list[Stored] = []

    def show(self, stored: Stored) -> None:
        ev = stored.event
        if ev is None:
            return
        if self.spec is None and not isinstance(ev, JobSubmitted):
            self.early.append(stored)
            return
        if isinstance(ev, JobSubmitted):
            self.base, self.spec = ev.occurred_at, ev.spec
        if not isinstance(ev, Heartbeat):
            self.shown += 1
        line = self._control(ev) if stored.stream == subjects.CONTROL else self._telemetry(ev)
        if line:
            label, text = line
            at = ev.occurred_at - self.base
            heapq.heappush(self.held, (at, self.shown, f"  {at:>6.1f}s  {label:<{LABEL}} {text}".rstrip(),
                                       self.clock()))
        self.newest[stored.stream] = max(self.newest.get(stored.stream, 0.0), ev.occurred_at - self.base)
        both = min(self.newest.get(stream, 0.0) for stream in (subjects.CONTROL, subjects.TELEMETRY))
        waited = self.clock() - WALL_HOLD_S
        self.flush(max([both - HOLD_S, *(at for at, _, _, arrived in self.held if arrived <= waited)]))
        early, self.early = self.early, []
        for held in early:  # the submission is known now: what came before it takes its place
            self.show(held)

    def flush(self, upto: float = math.inf) -> None:
        while self.held and self.held[0][0] <= upto:
            print(heapq.heappop(self.held)[2], flush=True)

    def _control(self, ev: Event) -> tuple[str, str] | None:
        before, self.view = self.view, jobview.evolve(self.view, ev)
        v = self.view
        match ev:
            case JobSubmitted(spec=spec):
                return "submitted", f"{spec.slots} slots, {spec.train.steps} steps, {len(spec.faults)} fault(s) planned"
            case JobPhaseChanged(phase="running") if before.phase != "running":
                where = {node: [str(r.rank) for r in v.placement if r.node == node] for node in
                         sorted({r.node for r in v.placement})}
                return "running", f"attempt {v.attempt}: " + "; ".join(f"ranks {', '.join(ranks)} on {node}"
                                                                        for node, ranks in where.items())
            case WorkersExited(rank=rank, exit_code=code) if code != 0:
                return "exited", f"rank {rank} exited with code {code}"
            case JobResumed(from_step=step, checkpoint_id=cid, world_size=world):
                return "resumed", f"from {cid or 'scratch'} at step {step}, world size {world}"
            case CheckpointCommitted(step=step, bytes=n):
                return "checkpoint", f"step {step} committed ({size(n)})"
            case CheckpointDeleted(checkpoint_id=cid, reason=reason) if reason != RETENTION:
                return "deleted", f"{cid} ({reason})"
            case StopRequested(checkpoint=checkpoint):
                return "stop", f"ranks told to stop ({'after a' if checkpoint else 'no'} checkpoint)"
            case JobCompleted(steps=steps):
                return "completed", f"{steps} steps, {v.restarts} restart(s)"
            case RollbackRequested(to_step=step, reason=reason):
                return "rollback", f"to step {step}: {reason}"
            case Finding(rank=rank):
                return "finding", f"{type(ev).__name__} on rank {rank}"
        if v.phase != before.phase and v.phase not in ("running", "completed"):  # those two said above
            return v.phase, headline(v.reason) or (f"attempt {v.attempt}" if v.phase == "placing" else "")
        return None

    def _telemetry(self, ev: Event) -> tuple[str, str] | None:
        match ev:
            case FaultInjected(kind="slow", rank=rank, step=step):
                fault = self.spec.faults[ev.fault] if self.spec and 0 <= ev.fault < len(self.spec.faults) else None
                pace = f"{fault.seconds:g} s" if fault else "a while"
                return "pacing", (f"rank {rank} sleeps {pace} a step from step {step} (the drill's pacing, not a "
                                  "fault: checkpoints commit before each fault)")
            case FaultInjected(kind=kind, rank=rank, step=step):
                return "fault", f"{kind} injected on rank {rank} at step {step} (drill)"
            case RankFault(rank=rank, error_type=error, message=message):
                return "rank fault", f"rank {rank}: {error}: {SOURCE_PREFIX.sub('', message)}"[:100]
            case RolledBack(rank=0, to_step=step, timeline=timeline):
                return "rolled back", f"to step {step}, in place (timeline {timeline} of attempt {ev.attempt})"
            case StepCompleted(rank=0, step=step, loss=loss) if step % self.every == 0:
                return "step", f"{step}/{self.view.steps} loss {loss:.3f} (attempt {ev.attempt})"
        return None


def ui_port() -> int:
    """/metrics on the usual port, or on a free one while another platform holds it."""
    try:
        up.check_ui_port(ui_cmd.DEFAULT_PORT)
        return ui_cmd.DEFAULT_PORT
    except UserError:
        return broker.free_port()


def drill(spec: Path, data_dir: Path, timeout_s: float) -> JobView | None:
    """Everything between `up` and `down`; None when the job could not even be submitted."""
    port, web = broker.free_port(), ui_port()
    url = f"nats://127.0.0.1:{port}"
    if flightdeck("up", "--detach", "--data-dir", str(data_dir), "--port", str(port),
                  "--ui-port", str(web)).returncode != 0:
        return None
    submitted = flightdeck("submit", str(spec), "--nats", url)
    if submitted.returncode != 0:
        return None
    job_id = submitted.stdout.strip()
    train = parse_spec(spec.read_bytes()).train  # submit accepted it: it parses
    every = max(1, train.steps // PROGRESS_LINES // train.checkpoint_every) * train.checkpoint_every
    print(f"\nthe dashboard shows it live: {up.ui_url(web)}/?job={job_id}", flush=True)
    print(f"\njob {job_id}, live (times from submission):", flush=True)
    timeline = Timeline(job_id, every)
    ended = False
    try:
        view = asyncio.run(follow(url, job_id, timeline, timeout_s))
        ended = True
    except TimeoutError:
        view = timeline.view
    finally:
        timeline.flush()  # what was held for ordering prints on every path, an interrupt's too
    if not ended:
        print(f"  the job did not end within {timeout_s:.0f}s (phase {view.phase}); logs: {data_dir / 'logs'}")
    print()
    print("\n".join(summary(url, job_id)), end="\n\n", flush=True)
    flightdeck("status", job_id, "--nats", url)
    flightdeck("checkpoints", job_id, "--nats", url)
    show_metrics(f"{up.ui_url(web)}/metrics", job_id, len(view.checkpoints))
    return view


def summary(url: str, job_id: str) -> list[str]:
    """The incidents as `flightdeck postmortem` finds them, from the history it reads (the demo's own lines above
    are what it saw live)."""
    from flightdeck.services.tools.postmortem import analyse  # numpy loads here, once the job is over

    async def rows() -> list[Stored]:
        async with open_store(url) as store:
            return await job_rows(store, job_id)
    return drill_summary.render(analyse(asyncio.run(rows()), job_id))


def show_metrics(url: str, job_id: str, commits: int) -> None:
    """What Prometheus would scrape of this job, from the same event log as the lines above (as far as they
    read it: `commits` checkpoints committed)."""
    print(f"$ curl -s {url} | grep 'job_id=\"{job_id}\"'   # a few of them", flush=True)
    lines, why = metrics_peek.scrape(url, job_id, METRICS_WAIT_S, commits)
    print("  " + "\n  ".join(lines or [f"none yet: {why or 'the web server has not folded this job'}"]), flush=True)


class PastDeadline(Exception):
    """The demo as a whole ran far past --timeout-s: something is stuck; stop what it started anyway."""


def _interrupted(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _past_deadline(signum: int, frame: FrameType | None) -> None:
    raise PastDeadline


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flightdeck.services.tools.console.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", type=Path, default=REPO / "examples" / "demo.toml")
    p.add_argument("--data-dir", metavar="DIR", type=Path, default=None,
                   help="default: a fresh folder under .flightdeck-demo/")
    p.add_argument("--timeout-s", type=float, default=300.0, help="give up on the job after this long")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupted)  # a terminated demo still runs its `finally`: down
    signal.signal(signal.SIGALRM, _past_deadline)
    signal.alarm(int(args.timeout_s + SLACK_S))  # the job's own timeout plus startup, status and checkpoints
    data_dir = (args.data_dir or DEMO_ROOT / time.strftime("%Y%m%d-%H%M%S")).resolve()
    started = time.monotonic()
    print(f"Flightdeck demo: a fault drill from {args.spec.name}, data in {data_dir}\n", flush=True)
    view, interrupted = None, False
    try:
        view = drill(args.spec.resolve(), data_dir, args.timeout_s)
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: stopping what the demo started", flush=True)
    except PastDeadline:
        print(f"\nthe demo is still running {args.timeout_s + SLACK_S:.0f}s after it started, so something is "
              "stuck: stopping what it started", flush=True)
    finally:
        signal.alarm(0)
        print()
        flightdeck("down", "--data-dir", str(data_dir), timeout_s=60.0)
    took = duration(time.monotonic() - started)
    if upstate.lock_held(data_dir):
        state = upstate.read_state(data_dir)
        print(f"\ndemo FAILED: `flightdeck down` left flightdeck up running (supervisor pid "
              f"{state.pid if state else '?'}); stop it with `flightdeck down --data-dir {data_dir}`")
        return 1
    if interrupted:
        return 130
    if view is None or view.phase != "completed":
        print(f"\ndemo FAILED after {took}: the job {'was not submitted' if view is None else f'ended {view.phase}'}"
              f"; logs in {data_dir / 'logs'}")
        return 1
    print(f"\ndemo done in {took}: {view.job_id} completed {view.steps} steps after {view.restarts} restart(s), "
          f"{len(view.checkpoints)} checkpoints committed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
