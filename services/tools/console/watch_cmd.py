"""`flightdeck watch JOB` (and `submit --wait`): a job live until it ends. On a terminal, a progress bar (phase,
steps, loss, ETA) with incidents printed above it as they happen (rich); otherwise plain lines, one per tenth of
the run and one per incident, so a log file or CI reads it too. Exit code: 0 completed, 1 failed or cancelled."""

import argparse
import asyncio
import sys
from typing import Protocol, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from flightdeck.events import subjects
from flightdeck.events.base import Event
from flightdeck.events.checkpoint import CheckpointRefused, CheckpointRejected
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.findings import Finding
from flightdeck.events.job import JobCompleted, JobFailed, JobResumed, WorkersExited
from flightdeck.events.store import Stored
from flightdeck.events.training import FaultInjected, RolledBack, StepCompleted
from flightdeck.services.shell.broker import nats_url
from flightdeck.services.tools.cli import EXIT_ERROR, Command, add_nats_argument
from flightdeck.services.tools.client import check_job_id
from flightdeck.services.tools.console.following import follow
from flightdeck.services.tools.console.status import duration
from flightdeck.services.tools.history import jobview
from flightdeck.services.tools.history.jobview import JobView
from flightdeck.services.tools.history.reasons import headline
from flightdeck.services.tools.postmortem.describe import describe

SHORT = 160  # characters of a reason on one line
PLAIN_LINES = 10  # progress lines a whole run prints without a terminal, about
STEP_TIME_WEIGHT = 0.1  # of the newest step in the step-time average the ETA uses


class Display(Protocol):
    def progress(self, view: JobView, step: int, loss: float | None, eta_s: float | None) -> None: ...

    def note(self, at: float, text: str) -> None: ...

    def close(self) -> None: ...


class Plain:
    """Lines for a pipe or a file: a progress line every tenth of the run, and every incident."""

    def __init__(self, out: TextIO) -> None:
        self.out, self.shown = out, -1

    def progress(self, view: JobView, step: int, loss: float | None, eta_s: float | None) -> None:
        every = max(1, view.steps // PLAIN_LINES)
        if step // every != self.shown // every or self.shown < 0:
            self.shown = step
            self.out.write(f"{view.job_id} {view.phase}: step {step}/{view.steps}{_loss(loss)}{_eta(eta_s)}\n")
            self.out.flush()

    def note(self, at: float, text: str) -> None:
        self.out.write(f"{at:>7.1f}s  {text}\n")
        self.out.flush()

    def close(self) -> None:
        pass


class Bar:
    """A rich progress bar on a terminal; incidents are printed above it and stay."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[detail]}"), console=console, transient=False)
        self.task = self.bar.add_task("", total=None, detail="")
        self.bar.start()

    def progress(self, view: JobView, step: int, loss: float | None, eta_s: float | None) -> None:
        self.bar.update(self.task, description=f"{view.job_id} [bold]{view.phase}[/]", completed=step,
                        total=view.steps or None, detail=f"{_loss(loss)}{_eta(eta_s)}".strip())

    def note(self, at: float, text: str) -> None:
        self.console.print(f"{at:>7.1f}s  {text}", markup=False, highlight=False)

    def close(self) -> None:
        self.bar.stop()


def short(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= SHORT else line[:SHORT - 3] + "..."


def _loss(loss: float | None) -> str:
    return f", loss {loss:.4g}" if loss is not None else ""


def _eta(eta_s: float | None) -> str:
    return f", ETA {duration(eta_s)}" if eta_s is not None else ""


class Watch:
    """Folds the job's events into a JobView and the newest step, and tells the display."""

    def __init__(self, job_id: str, display: Display) -> None:
        self.view, self.display = JobView(job_id=job_id), display
        self.base, self.step = 0.0, 0
        self.loss: float | None = None
        self.step_s: float | None = None

    def show(self, stored: Stored) -> None:
        ev = stored.event
        if ev is None:
            return
        if not self.base:
            self.base = ev.occurred_at
        if stored.stream == subjects.CONTROL:
            before, self.view = self.view, jobview.evolve(self.view, ev)
            line = incident(ev)
            if line is None and self.view.phase != before.phase and not self.view.ended:
                line = self.view.phase + (f": {short(headline(self.view.reason))}" if self.view.reason else "")
            if line:
                self.display.note(ev.occurred_at - self.base, line)
        elif isinstance(ev, StepCompleted) and ev.rank == 0:
            self.step, self.loss = ev.step + 1, ev.loss
            self.step_s = ev.step_time_s if self.step_s is None else \
                (1 - STEP_TIME_WEIGHT) * self.step_s + STEP_TIME_WEIGHT * ev.step_time_s
        elif (line := incident(ev)) is not None:
            self.display.note(ev.occurred_at - self.base, line)
        eta = (self.view.steps - self.step) * self.step_s if self.step_s is not None and self.view.steps else None
        self.display.progress(self.view, self.step, self.loss, None if self.view.ended else eta)


def incident(ev: object) -> str | None:
    """A line for what a person watching wants to see happen (faults, findings, decisions, restarts), worded as the
    postmortem and the dashboard word each event (postmortem/describe.py)."""
    notable = ((isinstance(ev, FaultInjected) and ev.kind != "slow")
               or (isinstance(ev, WorkersExited) and ev.is_fault()) or (isinstance(ev, RolledBack) and ev.rank == 0)
               or isinstance(ev, Finding | RollbackRequested | JobResumed | CheckpointRejected | CheckpointRefused
                             | JobCompleted | JobFailed))
    return f"{type(ev).__name__}: {short(describe(ev))}" if notable and isinstance(ev, Event) else None


def watch(url: str, job_id: str, *, out: TextIO | None = None) -> int:
    """Follow the job until it ends; 0 if it completed."""
    out = out or sys.stdout
    display: Display = Bar(Console(file=out)) if out.isatty() else Plain(out)
    sink = Watch(job_id, display)
    try:
        view = asyncio.run(follow(url, job_id, sink, None))
    finally:
        display.close()
    return 0 if view.phase == "completed" else EXIT_ERROR


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="the job id (as `flightdeck submit` printed it)")
    add_nats_argument(parser)


def run(args: argparse.Namespace) -> int:
    check_job_id(args.job)
    return watch(nats_url(args.nats), args.job)


COMMAND = Command("watch", "follow a job live until it ends: progress, loss, ETA, incidents", add_arguments, run)
