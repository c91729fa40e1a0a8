"""What a node agent does with its ranks' host snapshots (events/snapshot.py): the node's snapshot root, the
persist of a rank's newest complete snapshot once the rank is gone without finishing, the choice of restoring a
rank from memory rather than from the store, and the clean-up when a job ends.

A persist is a staging like a rank's own (CheckpointStaged, here with `from_memory`): the node's shipper uploads
the slot's two files, and the checkpoint service commits the set once every rank's is stored, manifest last.
Why it works this way: docs/internals.md, "5. Checkpoints".
"""

import asyncio
import contextlib
import hashlib
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import structlog

from flightdeck.events import codec, subjects
from flightdeck.events import snapshot as fmt
from flightdeck.events.checkpoint import CheckpointStaged, ShardInfo
from flightdeck.events.job import Persisted
from flightdeck.events.plan import ParallelPlan
from flightdeck.events.store import EventStore
from flightdeck.events.training import RankStarted, RolledBack, StepCompleted
from flightdeck.services.agent import shmroots
from flightdeck.services.agent.core import SpawnArgs
from flightdeck.services.agent.rankproc import retrying
from flightdeck.services.shell.objects import manifest
from flightdeck.services.shell.objects.store import ObjectStore

log = structlog.get_logger("flightdeck.agent.snapshots")

SHM = shmroots.SHM


def default_root(agent_root: Path, node: str) -> Path:
    """Shared memory (tmpfs) where the machine has it, else the agent's data dir; one folder per agent data dir,
    so that agents side by side (tests, drills) never share one."""
    tag = hashlib.sha256(str(agent_root.resolve()).encode()).hexdigest()[:10]
    return SHM / f"flightdeck-{node}-{tag}" if SHM.is_dir() else agent_root / "snapshots"


def capacity(root: Path | None, cap: int | None = None) -> int:
    """What the node's snapshot root can hold, as the agent registers it (the resource manager accounts its ranks'
    snapshots against it at grant time): its file system's free bytes and what it holds already, at most `cap`
    (`--snapshot-memory`); 0 when off."""
    if root is None:
        return 0
    root.mkdir(parents=True, exist_ok=True)
    held = sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())
    room = fmt.free_bytes(root) + held
    return room if cap is None else min(room, cap)


UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(raw: str) -> int:
    """"64G", "512M", "1.5T" or a number of bytes (binary units, an optional trailing "B" or "iB")."""
    text = raw.strip().upper().removesuffix("IB").removesuffix("B")
    unit = text[-1:] if text[-1:] in UNITS and text[-1:] else ""
    try:
        value = float(text[:-1] if unit else text)
    except ValueError:
        raise ValueError(f"{raw!r} is not a size: give bytes or a number with K, M, G or T, e.g. 64G") from None
    if value < 0:
        raise ValueError(f"{raw!r}: a size cannot be negative")
    return int(value * UNITS[unit])


def _sha256(path: Path) -> ShardInfo:
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return ShardInfo(path=path.name, size=path.stat().st_size, sha256=digest)


def choose(root: Path, job_id: str, attempt: int, rank: int, staged: tuple[int, int] | None,
           reported: int | None = None) -> list[tuple[fmt.Header, Path]] | str | None:
    """The slots to persist for a rank gone without finishing, newest first: its complete ones whose bytes check,
    that are newer than anything it staged itself (`staged`: its newest
    (timeline, step)), and whose steps are all on record: they follow the newest step the rank's record holds
    (`reported`; None: not known), or the slot's header carries the reports of the steps between (`missing`
    gives them, to publish again). Both slots when both qualify: its peers' newest may be one step apart, and a
    set commits only at a step every rank staged. None: nothing newer to persist. A string: why nothing can be."""
    problems, found = [], []
    slots = fmt.complete_slots(root, job_id, attempt, rank)
    newest = max((h.timeline for h, _ in slots), default=0)
    for header, folder in slots:
        # a slot from before the attempt's newest rollback holds steps that rollback threw away, or ones its
        # checkpoint covers
        if header.timeline < newest:
            continue
        # (a step it began to checkpoint itself counts only once staged: a peer's death can stop that checkpoint)
        if staged is not None and (header.timeline, header.step) <= staged:
            continue
        if reported is not None and header.step > reported + 1 and missing(header, reported) is None:
            continue
        try:
            fmt.check_bytes(folder, header)
        except fmt.BadSnapshot as exc:
            problems.append(str(exc))
            log.warning("snapshot slot refused", job_id=job_id, rank=rank, error=str(exc))
            continue
        found.append((header, folder))
    return found or ("; ".join(problems) if problems else None)


def missing(header: fmt.Header, reported: int) -> list[StepCompleted] | None:
    """The rank's reports of the steps after `reported` up to the slot's, from its header (the newest of each
    step: a rollback ran some again); None unless the header holds every one of them."""
    newest: dict[int, StepCompleted] = {}
    for raw in header.steps:
        with contextlib.suppress(Exception):  # a report that does not decode is one the header does not hold
            ev = codec.decode(raw)
            if isinstance(ev, StepCompleted) and (ev.job_id, ev.attempt, ev.rank) == (
                    header.job_id, header.attempt, header.rank) and reported < ev.step < header.step:
                newest[ev.step] = ev
    wanted = range(reported + 1, header.step)
    return [newest[s] for s in wanted] if all(s in newest for s in wanted) else None


def persist_event(header: fmt.Header, folder: Path, *, node: str, producer: str, seconds: float,
                  again: str = "") -> CheckpointStaged:
    """The staging that hands the slot to the shipper, as its rank would have announced a set (`again`: by an
    agent restarted after the one that may have announced it, so under an id of its own)."""
    shards = [_sha256(folder / fmt.bin_name(header.rank)), _sha256(folder / fmt.header_name(header.rank))]
    return CheckpointStaged(
        job_id=header.job_id, rank=header.rank, attempt=header.attempt, node=node, step=header.step,
        world_size=header.world_size, staging_dir=str(folder.resolve()), shards=shards, data=header.data,
        stall_s=0.0, write_s=seconds, timeline=header.timeline, from_memory=True, replicated=header.replicated,
        event_id=f"{producer}:persist:{header.job_id}:{header.attempt}:{header.rank}:{header.timeline}:{header.step}"
                 + (f":{again}" if again else ""),
        occurred_at=time.time(), producer=producer)


async def persisting(root: Path, job_id: str, attempt: int, rank: int, staged: tuple[int, int] | None,
                     reported: int | None = None, *, node: str, producer: str,
                     again: str = "") -> tuple[list[StepCompleted], list[CheckpointStaged]]:
    """The rank's step reports to publish again (those its record lacks below the newest slot chosen), then the
    stagings of its snapshots, newest first; none when nothing is newer than its own checkpoints, or every slot is
    bad (logged)."""
    started = time.perf_counter()
    chosen = await asyncio.to_thread(choose, root, job_id, attempt, rank, staged, reported)
    if chosen is None or isinstance(chosen, str):
        if chosen:
            log.error("no snapshot of the rank can be persisted", job_id=job_id, attempt=attempt, rank=rank,
                      problems=chosen)
        return [], []
    again_steps = (missing(chosen[0][0], reported) or []) if reported is not None else []
    return again_steps, [await asyncio.to_thread(persist_event, header, folder, node=node, producer=producer,
                                                 seconds=round(time.perf_counter() - started, 4), again=again)
                         for header, folder in chosen]


def in_memory(root: Path, job_id: str, checkpoint_id: str, step: int, rank: int,
              mf: manifest.Manifest, world_size: int, plan: ParallelPlan | None = None) -> Path | None:
    """This node's slot holding exactly rank `rank`'s shard of committed checkpoint `mf` (its header file has the
    manifest's sha256; its tensors are checked by the rank as it loads), else one of another rank of the set that
    holds a full replica (a set the survivors' replicas settled without this rank), or None: restore from the store.
    A slot of a sharded state (FSDP, TP, a pipeline stage) serves only the layout it was taken in (the world's size,
    and the DP x TP x PP of `plan` when it is this world's): a rank of another layout needs pieces other ranks held,
    which the store has and this slot does not, and DCP would leave what no piece covers as it was."""
    layout = [plan.dp, plan.tp, plan.pp] if plan is not None and plan.world_size == world_size else []
    held = sorted(int(s.path[1:-5]) for s in mf.shards if s.path[:1] == "r" and s.path.endswith(".json")
                  and s.path[1:-5].isdigit())
    passed: list[str] = []  # why each slot is not the one: said when none is
    for r in [rank] if rank in held else [r for r in held if r != rank]:
        want = next(s for s in mf.shards if s.path == fmt.header_name(r))
        for attempt_dir in sorted((root / job_id).glob(f"a*-r{r}-s*")) if (root / job_id).is_dir() else []:
            header_path = attempt_dir / fmt.header_name(r)
            try:
                if header_path.stat().st_size != want.size or _sha256(header_path).sha256 != want.sha256:
                    passed.append(f"{attempt_dir.name}: another set")
                    continue
                header = fmt.read_header(header_path)
            except (OSError, fmt.BadSnapshot) as exc:
                passed.append(f"{attempt_dir.name}: {exc}")
                continue
            if (header.job_id, header.step, header.rank) != (job_id, step, r):
                passed.append(f"{attempt_dir.name}: step {header.step}")
            elif r != rank and not header.replicated:
                passed.append(f"{attempt_dir.name}: rank {r}'s shard, not a replica")
            elif not header.replicated and header.world_size != world_size:
                passed.append(f"{attempt_dir.name}: a shard of a {header.world_size}-rank world")
            elif not header.replicated and header.layout and layout and header.layout != layout:
                passed.append(f"{attempt_dir.name}: a shard of DP x TP x PP {header.layout}, not {layout}")
            else:
                log.info("restoring from memory", job_id=job_id, checkpoint_id=checkpoint_id, rank=rank,
                         slot=str(attempt_dir), **({"replica_of": r} if r != rank else {}))
                return attempt_dir
    log.info("restoring from the store: no slot in memory holds the rank's shard", job_id=job_id,
             checkpoint_id=checkpoint_id, rank=rank, passed=passed)
    return None


def forget_job(root: Path, job_id: str) -> None:
    shutil.rmtree(root / job_id, ignore_errors=True)


def forget_attempts_before(root: Path, job_id: str, attempt: int, keep: set[Path]) -> None:
    """Slots of the job's older attempts, except `keep` (what this attempt restores from)."""
    folder = root / job_id
    for slot in folder.glob("a*-r*-s*") if folder.is_dir() else []:
        try:
            older = int(slot.name.split("-")[0][1:]) < attempt
        except ValueError:
            continue
        if older and slot not in keep:
            shutil.rmtree(slot, ignore_errors=True)


async def persist(root: Path, store: EventStore, job_id: str, attempt: int, rank: int, staged: tuple[int, int] | None,
                  reported: int | None, *, node: str, producer: str,
                  again: str = "") -> tuple[Persisted, tuple[int, int] | None]:
    """Stage a gone rank's snapshot for the node's shipper (`persisting`), on the rank's own subject, after the
    rank's reports of the steps before it that its record lacks (under their own ids: the broker drops any copy
    that did land). Whether it staged one, and the newest (timeline, step) it staged, for the rank's exit record:
    "none" says no set of it can come, the newest that none newer can."""
    try:
        steps, events = await persisting(root, job_id, attempt, rank, staged, reported, node=node,
                                         producer=producer, again=again)
    except Exception as exc:  # the store's checkpoints still stand: the restart restores the newest
        log.error("persisting the rank's snapshot failed", job_id=job_id, rank=rank, error=repr(exc))
        return "none", None
    for ev in steps:
        await retrying("recording the rank's step again", lambda ev=ev: store.append(  # type: ignore[misc]
            subjects.telemetry(job_id, rank, "StepCompleted"), ev, msg_id=ev.event_id))
    if steps:
        log.info("rank's step reports recorded again from its snapshot", job_id=job_id, rank=rank,
                 steps=[ev.step for ev in steps])
    subject = subjects.telemetry(job_id, rank, "CheckpointStaged")
    for event in events:
        await retrying("staging the rank's snapshot",
                       lambda event=event: store.append(subject, event, msg_id=event.event_id))  # type: ignore[misc]
        log.info("rank's snapshot staged for the store", job_id=job_id, rank=rank, step=event.step,
                 timeline=event.timeline, bytes=sum(s.size for s in event.shards), seconds=event.write_s)
    return ("staged", max((e.timeline, e.step) for e in events)) if events else ("none", None)


async def recorded(store: EventStore, job_id: str, attempt: int, rank: int,
                   peers: Sequence[int]) -> tuple[tuple[int, int] | None, int]:
    """For a rank an earlier agent on this node ran (it died with that agent): what the rank staged itself, as
    (timeline, step), and the newest step of its attempt its record holds, read from the history (the step before
    the one it started from when it holds none). Its last reports may have died in that agent's custody: a
    snapshot past them is persisted only with the reports between, from its header (`missing`). A rollback of the
    rank or of a peer after its last step starts the record again below it."""
    staged: tuple[int, int] | None = None
    last = await store.last(subjects.TELEMETRY, subjects.telemetry(job_id, rank, "CheckpointStaged"))
    ev = last.event if last is not None else None
    if isinstance(ev, CheckpointStaged) and ev.attempt == attempt and not ev.from_memory:
        staged = (ev.timeline, ev.step)
    own, restarted = -1, []
    for r in dict.fromkeys((rank, *peers, 0)):
        step = await store.last(subjects.TELEMETRY, subjects.telemetry(job_id, r, "StepCompleted"))
        back = await store.last(subjects.TELEMETRY, subjects.telemetry(job_id, r, "RolledBack"))
        done = step.event if step is not None else None
        if r == rank and isinstance(done, StepCompleted) and done.attempt == attempt:
            own = done.step
        rolled = back.event if back is not None else None
        if isinstance(rolled, RolledBack) and rolled.attempt == attempt and back is not None \
                and (step is None or back.seq > step.seq):
            restarted.append(rolled.to_step - 1)  # nothing of the new timeline on record past this
    if restarted:
        return staged, min(restarted)
    if own < 0:
        began = await store.last(subjects.TELEMETRY, subjects.telemetry(job_id, rank, "RankStarted"))
        if began is not None and isinstance(began.event, RankStarted) and began.event.attempt == attempt:
            own = began.event.from_step - 1
    return staged, own


async def restores_in_memory(root: Path, objects: ObjectStore, args: SpawnArgs) -> dict[int, Path]:
    """The ranks of `args` this node can restore from its own memory (their slots hold the restore checkpoint,
    persisted from them), by rank. Slots of attempts older than the restore's are let go here (the job's end lets
    go of the rest): a set of a newer failed attempt may still be on its way to commit (a lost node's survivors)."""
    found: dict[int, Path] = {}
    restore = args.restore
    if restore is not None and restore.from_memory:
        mf: manifest.Manifest | None = None
        try:
            mf, _ = await manifest.read_manifest(objects, args.job_id, restore.checkpoint_id,
                                                 expected_sha256=restore.manifest_sha256)
        except Exception as exc:  # the store's copy decides then, with its own errors
            log.warning("cannot read the restore's manifest to match memory", job_id=args.job_id,
                        checkpoint_id=restore.checkpoint_id, error=repr(exc))
        for ref in args.ranks if mf is not None else ():
            assert mf is not None
            slot = await asyncio.to_thread(in_memory, root, args.job_id, restore.checkpoint_id, restore.step, ref.rank,
                                           mf, args.world_size, args.plan)
            if slot is not None:
                found[ref.rank] = slot
    if restore is not None:  # older than what this attempt restores: never needed again
        await asyncio.to_thread(forget_attempts_before, root, args.job_id, restore.attempt, set(found.values()))
    return found
