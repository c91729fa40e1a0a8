"""`flightdeck verify` picks up where the last clean verify of the job ended, so a verify of a month-long job
re-derives only what came since, not everything from the first event.

A clean verify (every decision reproduced, nothing missing) of a job read from the broker leaves a mark in the data
dir (`<data dir>/verified/<job>.mark`): the horizon it checked up to, the FD_CONTROL stream it read (its creation
time: another broker's stream holding the same job id is another history), and per core the state its refold
reached there (pickled, with its positions and the fingerprint of the code that folded it:
services/shell/snapshots.py), and the counts it checked. The next verify reads only what came after the mark
(control past the horizon, the job's telemetry past the lowest position a core had folded), folds each core on
from its state, checks the decisions of the inputs after the mark and adds the counts. `verify --full` re-derives
everything; a mark of other code, of another stream, or that does not decode is passed over.

What it trusts: FD_CONTROL is never changed (deny_delete, deny_purge), so the inputs up to the mark are the ones
that verify checked; the mark is the user's own file.
"""

import hashlib
import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import structlog

from flightdeck.events import subjects
from flightdeck.services.core import Service
from flightdeck.services.shell import snapshots
from flightdeck.services.shell.fold import Folder

log = structlog.get_logger("flightdeck.verify.resume")

FORMAT = 1
FOLDER = "verified"


class CoreMark(msgspec.Struct, frozen=True, kw_only=True):
    service: str
    fingerprint: str
    control_seq: int
    telemetry_seq: int
    versions: dict[str, int]
    state: bytes  # pickled
    state_sha256: str
    control_inputs: int
    telemetry_inputs: int
    decisions: int
    effects: int


class Mark(msgspec.Struct, frozen=True, kw_only=True):
    format: int
    job_id: str
    stream: str  # the FD_CONTROL stream's creation time, as the broker reports it
    horizon: int
    fleet: bool  # whether fleet decisions were in scope then (no other job in the history)
    cores: list[CoreMark]
    taken_at: float


@dataclass(frozen=True)
class Resume:
    """A mark made usable: each core's folder at it, and where the reading starts."""

    mark: Mark
    folders: dict[str, Folder[Any]]

    @property
    def control_from(self) -> int:
        return self.mark.horizon + 1

    @property
    def telemetry_from(self) -> int:
        """Past the lowest position a core that reads telemetry had folded it to."""
        return min((f.telemetry_seq for f in self.folders.values() if f.service.telemetry_subjects), default=0) + 1


def path(data_dir: Path, job_id: str) -> Path:
    return data_dir / FOLDER / f"{subjects.token(job_id)}.mark"


def load(data_dir: Path, job_id: str, stream: str, services: Sequence[Service[Any]]) -> Resume | None:
    """The job's mark as folders of `services` (by name), or None: no mark, another stream's, or one whose every
    core cannot be restored (other code, a corrupt file: logged)."""
    where = path(data_dir, job_id)
    if not where.exists():
        return None
    try:
        mark = msgspec.msgpack.decode(where.read_bytes(), type=Mark)
        if mark.format != FORMAT or mark.job_id != job_id or mark.stream != stream:
            return None
        by_name = {s.name: s for s in services}
        folders: dict[str, Folder[Any]] = {}
        for core in mark.cores:
            service = by_name.get(core.service)
            if service is None or core.fingerprint != snapshots.fingerprint(service):
                log.info("verify mark of other code: verifying from the start", service=core.service)
                return None
            if hashlib.sha256(core.state).hexdigest() != core.state_sha256:
                raise ValueError(f"the state of {core.service} does not match its sha256")
            folder: Folder[Any] = Folder(service)
            folder.restore(pickle.loads(core.state), core.control_seq, core.telemetry_seq, core.versions)
            folders[core.service] = folder
    except Exception as exc:  # a mark only shortens the verify
        log.warning("verify mark unusable: verifying from the start", path=str(where), error=repr(exc))
        return None
    return Resume(mark, folders)


def save(data_dir: Path, job_id: str, stream: str, horizon: int, fleet: bool,
         folders: dict[str, Folder[Any]], counts: dict[str, tuple[int, int, int, int]]) -> Path:
    """The mark of a clean verify; `counts`: per core (control inputs, telemetry inputs, decisions, effects)."""
    cores = []
    for name, folder in folders.items():
        state = pickle.dumps(folder.state, protocol=pickle.HIGHEST_PROTOCOL)
        control_inputs, telemetry_inputs, decisions, effects = counts[name]
        cores.append(CoreMark(service=name, fingerprint=snapshots.fingerprint(folder.service),
                              control_seq=folder.control_seq, telemetry_seq=folder.telemetry_seq,
                              versions=dict(folder.admission.versions), state=state,
                              state_sha256=hashlib.sha256(state).hexdigest(), control_inputs=control_inputs,
                              telemetry_inputs=telemetry_inputs, decisions=decisions, effects=effects))
    mark = Mark(format=FORMAT, job_id=job_id, stream=stream, horizon=horizon, fleet=fleet, cores=cores,
                taken_at=time.time())
    where = path(data_dir, job_id)
    where.parent.mkdir(parents=True, exist_ok=True)
    tmp = where.with_suffix(".tmp")
    tmp.write_bytes(msgspec.msgpack.encode(mark))
    tmp.replace(where)  # whole or not at all
    return where
