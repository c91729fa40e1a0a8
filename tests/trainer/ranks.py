"""Helpers for trainer tests: write a tiny job spec, start real `python -m flightdeck.trainer` ranks as processes
(torchrun's variables, a free MASTER_PORT), and read the JSON-lines events they log."""

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from flightdeck.events.base import Event
from flightdeck.events.spec import parse_spec
from flightdeck.services.shell.broker import free_port
from flightdeck.trainer import distributed
from flightdeck.trainer.config import RunConfig
from flightdeck.trainer.link import Offline
from flightdeck.trainer.loop import train
from flightdeck.trainer.reports import Emitter
from flightdeck.trainer.session import Run

JOB = "job-c"
REPO = Path(__file__).resolve().parents[2]

TINY = {
    "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 32, "vocab_size": 64},
    "train": {"steps": 30, "batch_size": 8, "lr": 0.01, "checkpoint_every": 1000, "data": "synthetic"},
}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    return repr(v)


def write_spec(path: Path, *, slots: int = 1, faults: list[dict[str, Any]] | None = None,
               **sections: dict[str, Any]) -> Path:
    lines = ['name = "t"', f"slots = {slots}"]
    for section in {**TINY, **sections}:
        lines.append(f"[{section}]")
        merged = {**TINY.get(section, {}), **sections.get(section, {})}
        lines += [f"{k} = {_toml_value(v)}" for k, v in merged.items()]
    for fault in faults or []:
        lines.append("[[faults]]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in fault.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def start(tmp: Path, spec: Path, *, world: int, job_id: str = "job-1", args: tuple[str, ...] = (),
          log_name: str = "events.jsonl") -> list[subprocess.Popen[bytes]]:
    """Start `world` ranks; each writes its output to tmp/rank-<r>.log and its events to tmp/<log_name>."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "flightdeck.trainer", "--job-id", job_id, "--spec", str(spec), "--device", "cpu",
               "--staging", str(tmp / "staging"), "--events-log", str(tmp / log_name), *args]
        out = (tmp / f"rank-{rank}.log").open("ab")
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT))
    return procs


@contextlib.contextmanager
def started(tmp: Path, spec: Path, *, world: int, **kw: Any) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`start`, and kill whatever is still running when the block ends (a failed assert included)."""
    procs = start(tmp, spec, world=world, **kw)
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def wait(procs: list[subprocess.Popen[bytes]], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(max(deadline - time.monotonic(), 0.1)))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes


# A hang guard, not a speed check: on CI's loaded 2-core box one rank's interpreter and torch import alone took 16 s.
RUN_TIMEOUT_S = 180.0


def run(tmp: Path, spec: Path, *, world: int, timeout: float = RUN_TIMEOUT_S, **kw: Any) -> list[int]:
    return wait(start(tmp, spec, world=world, **kw), timeout)


def events(path: Path, type_name: str | None = None, rank: int | None = None) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in out if (type_name is None or e["type"] == type_name) and (rank is None or e["rank"] == rank)]


def losses(path: Path, rank: int) -> list[tuple[int, float]]:
    """(step, loss) in the order the rank reported them; NaN arrives as the string 'nan'."""
    return [(e["step"], float(e["loss"])) for e in events(path, "StepCompleted", rank)]


def wait_for(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def log_tail(tmp: Path, world: int) -> str:
    logs = [tmp / f"rank-{r}.log" for r in range(world)]
    return "\n".join(f.read_text()[-3000:] for f in logs if f.exists())


class ScriptedInbox(Offline):
    """Hands over the commands scripted for (step, n): the n-th poll at that step (a paused loop polls again)."""

    def __init__(self, script: dict[tuple[int, int], list[Event]], gone_at: int | None = None) -> None:
        self.script = script
        self.gone_at = gone_at  # the agent vanishes once the run reaches this step
        self.step_of: Callable[[], int] = lambda: 0
        self.polls_at: dict[int, int] = {}

    def poll(self) -> list[Event]:
        step = self.step_of()
        self.polls_at[step] = self.polls_at.get(step, 0) + 1
        return self.script.pop((step, self.polls_at[step]), [])

    @property  # type: ignore[override]
    def gone(self) -> bool:
        return self.gone_at is not None and self.step_of() >= self.gone_at


def offline_run(tmp: Path, script: dict[tuple[int, int], list[Event]], steps: int = 30, every: int = 10,
                faults: list[dict[str, Any]] | None = None, checkpoints: Path | None = None,
                gone_at: int | None = None) -> tuple[Run, ScriptedInbox]:
    """One rank's Run in this process (telemetry off: its events go to tmp/events.jsonl), commands from `script`."""
    tmp.mkdir(parents=True, exist_ok=True)
    spec_path = write_spec(tmp / "job.toml", train={"steps": steps, "checkpoint_every": every}, faults=faults)
    cfg = RunConfig(job_id=JOB, spec=parse_spec(spec_path.read_bytes()), attempt=0, node="n", agent=None,
                    staging=tmp / "staging", restore=None, manifest=None, rank=0, world_size=1, local_rank=0,
                    device="cpu", sync_every=1, events_log=tmp / "events.jsonl", checkpoints=checkpoints)
    envelope = {"job_id": JOB, "rank": 0, "attempt": 0, "node": "n"}
    emitter = Emitter(Offline(), envelope, cfg.events_log)
    inbox = ScriptedInbox(script, gone_at)
    run = Run(cfg, distributed.init(0, 1, 0, "cpu"), emitter, inbox)
    inbox.step_of = lambda: run.step
    return run, inbox


def run_loop(tmp: Path, script: dict[tuple[int, int], list[Event]], steps: int = 30, every: int = 10,
             faults: list[dict[str, Any]] | None = None,
             checkpoints: Path | None = None, gone_at: int | None = None) -> tuple[int, Path, ScriptedInbox, Run]:
    """One rank of the built-in trainer in this process (telemetry off), commands from `script`; returns its
    exit code (a stop's SystemExit included), its events log and the Run."""
    run, inbox = offline_run(tmp, script, steps, every, faults, checkpoints, gone_at)
    try:
        code = train(run)
    except SystemExit as exc:
        code = int(exc.code or 0)
    finally:
        run.close()
    return code, tmp / "events.jsonl", inbox, run
