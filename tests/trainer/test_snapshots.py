"""Host snapshots in shared memory (trainer/snapshots.py, events/snapshot.py), in one process: two slots written
in turn, each complete only once its header is; a restore from a slot equals the state it took, a restore from
a set persisted from several ranks' slots too; a torn, edited or foreign slot is refused, never loaded."""

import math
import os
import zlib
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from flightdeck.events import codec, subjects
from flightdeck.events import snapshot as fmt
from flightdeck.events.checkpoint import CheckpointStaged, DataPosition
from flightdeck.events.plan import ParallelPlan
from flightdeck.events.store import MemoryStore
from flightdeck.events.training import RankStarted, RolledBack, StepCompleted
from flightdeck.services.agent import snapshots as agent_snaps
from flightdeck.services.shell.objects import manifest
from flightdeck.trainer import checkpointing, distributed, snapshots
from flightdeck.trainer.hostcopy import HostCopier
from flightdeck.trainer.snapshotting import Cadence
from flightdeck.trainer.state import TrainState

from .test_checkpointing import Counter, flat_tensors, parts, state, train


def _take(snaps: snapshots.Snapshots, st: TrainState, step: int, *, checkpointing_: bool = False) -> None:
    live = st.live()
    position = DataPosition(next_batch=step, skipped=[(1, 2)])
    live[checkpointing.META_KEY] = checkpointing.meta_item(step, position, 1)
    snaps.take(step, live, position, timeline=0, checkpointing=checkpointing_, replicated=True)
    snaps.wait()


@pytest.fixture
def dist() -> distributed.Dist:
    return distributed.init(0, 1, 0, "cpu")


def test_two_slots_are_written_in_turn_and_each_restores_exactly_what_it_took(
        tmp_path: Path, dist: distributed.Dist) -> None:
    m, opt, cursor = parts(seed=1)
    counter = Counter()
    snaps = snapshots.Snapshots(tmp_path, job_id="j", attempt=3, rank=0, world_size=1)
    taken: dict[int, dict[str, torch.Tensor]] = {}
    for step in (1, 2, 3):
        train(m, opt, cursor, 1)
        counter.n = step * 10
        st = state(m, opt, counter)
        taken[step] = flat_tensors(st)
        _take(snaps, st, step, checkpointing_=step == 3)
    slots = fmt.complete_slots(tmp_path, "j", 3, 0)
    assert [(h.step, h.checkpointing, folder.name) for h, folder in slots] == [(3, True, "a3-r0-s0"),
                                                                              (2, False, "a3-r0-s1")]
    for header, folder in slots:
        fmt.check_bytes(folder, header)  # what the agent checks, without torch
        m2, opt2, _ = parts(seed=9)
        counter2 = Counter()
        st2 = state(m2, opt2, counter2)
        step, position = checkpointing.load(folder, st2, dist)
        assert (step, position) == (header.step, DataPosition(next_batch=header.step, skipped=[(1, 2)]))
        assert counter2.n == header.step * 10
        got = flat_tensors(st2)
        assert got.keys() == taken[header.step].keys()
        assert all(torch.equal(got[k], taken[header.step][k]) for k in got)
    snaps.close()


def test_a_slot_being_written_has_no_header_and_a_torn_or_edited_one_is_refused(
        tmp_path: Path, dist: distributed.Dist) -> None:
    m, opt, _cursor = parts(seed=1)
    snaps = snapshots.Snapshots(tmp_path, job_id="j", attempt=0, rank=0, world_size=1)
    _take(snaps, state(m, opt), 1)
    _take(snaps, state(m, opt), 2)
    (h2, s1), (_h1, s0) = fmt.complete_slots(tmp_path, "j", 0, 0)
    # The next snapshot goes to step 1's slot: from its first byte until its header, that slot is incomplete.
    live = state(m, opt).live()
    live[checkpointing.META_KEY] = checkpointing.meta_item(3, DataPosition(next_batch=3), 1)
    snaps.wait()
    (s0 / fmt.header_name(0)).unlink()  # as `take` does first
    assert [h.step for h, _ in fmt.complete_slots(tmp_path, "j", 0, 0)] == [2]

    # One flipped byte in the tensors: the checksums say which item, for the agent and for the loading rank.
    data = bytearray((s1 / fmt.bin_name(0)).read_bytes())
    item = next(i for i in h2.items if i.nbytes)
    data[item.at] ^= 0xFF
    (s1 / fmt.bin_name(0)).write_bytes(bytes(data))
    with pytest.raises(fmt.BadSnapshot, match=f"{item.key}.*checksum"):
        fmt.check_bytes(s1, h2)
    with pytest.raises(checkpointing.CorruptCheckpoint, match="checksum"):
        checkpointing.load(s1, state(*parts(seed=2)[:2]), dist)
    snaps.close()


def test_a_set_persisted_by_an_earlier_version_with_crc32s_still_restores_and_is_still_checked(
        tmp_path: Path, dist: distributed.Dist) -> None:
    m, opt, _cursor = parts(seed=1)
    snaps = snapshots.Snapshots(tmp_path, job_id="j", attempt=0, rank=0, world_size=1)
    _take(snaps, state(m, opt), 5)
    snaps.close()
    ((header, folder),) = fmt.complete_slots(tmp_path, "j", 0, 0)
    data = (folder / fmt.bin_name(0)).read_bytes()
    items = [msgspec.structs.replace(i, digest=0, crc32=zlib.crc32(i.packed if i.packed or not i.nbytes
                                                                   else data[i.at:i.at + i.nbytes]))
             for i in header.items]
    old = msgspec.structs.replace(header, format=fmt.FORMAT_CRC32, items=items)
    (folder / fmt.header_name(0)).write_bytes(msgspec.json.encode(old))
    fmt.check_bytes(folder, fmt.read_header(folder / fmt.header_name(0)))
    m2, opt2, _ = parts(seed=2)
    assert checkpointing.load(folder, state(m2, opt2), dist)[0] == 5
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values(), strict=True))
    bad = msgspec.structs.replace(old, items=[msgspec.structs.replace(items[0], crc32=items[0].crc32 ^ 1),
                                              *items[1:]])
    (folder / fmt.header_name(0)).write_bytes(msgspec.json.encode(bad))
    with pytest.raises(fmt.BadSnapshot, match="checksum"):
        fmt.check_bytes(folder, bad)


def test_a_slot_of_another_job_attempt_or_rank_is_not_this_ranks(tmp_path: Path) -> None:
    m, opt, _ = parts(seed=1)
    snaps = snapshots.Snapshots(tmp_path, job_id="j", attempt=1, rank=0, world_size=1)
    _take(snaps, state(m, opt), 4)
    snaps.close()
    assert [h.step for h, _ in fmt.complete_slots(tmp_path, "j", 1, 0)] == [4]
    assert fmt.complete_slots(tmp_path, "j", 2, 0) == [] and fmt.complete_slots(tmp_path, "k", 1, 0) == []
    # a header copied into another rank's slot names its own rank: not taken for that rank's
    other = fmt.slot_dir(tmp_path, "j", 1, 1, 0)
    other.mkdir(parents=True)
    (other / fmt.header_name(1)).write_bytes((fmt.slot_dir(tmp_path, "j", 1, 0, 0) / fmt.header_name(0)).read_bytes())
    assert fmt.complete_slots(tmp_path, "j", 1, 1) == []


def test_a_set_persisted_from_two_ranks_restores_into_any_world_size(tmp_path: Path, dist: distributed.Dist) -> None:
    """Two data-parallel ranks' slots, uploaded side by side (r0.*, r1.*): one folder, one reader; the replicated
    model is read once, each rank's extras are its own, and a rank the set lacks takes rank 0's."""
    m, opt, cursor = parts(seed=1)
    train(m, opt, cursor, 2)
    persisted = tmp_path / "set"
    persisted.mkdir()
    for rank in (0, 1):
        counter = Counter()
        counter.n = 100 + rank
        st = TrainState(m, opt, {"counter": counter}, rank=rank, device=torch.device("cpu"))
        snaps = snapshots.Snapshots(tmp_path / "shm", job_id="j", attempt=0, rank=rank, world_size=2)
        live = st.live()
        live[checkpointing.META_KEY] = checkpointing.meta_item(2, DataPosition(next_batch=2), 2)
        snaps.take(2, live, DataPosition(next_batch=2), timeline=0, checkpointing=False, replicated=True)
        snaps.close()
        folder = fmt.slot_dir(tmp_path / "shm", "j", 0, rank, 0)
        for name in (fmt.bin_name(rank), fmt.header_name(rank)):
            os.link(folder / name, persisted / name)
    want = flat_tensors(state(m, opt))
    for rank in (0, 1, 2):
        m2, opt2, _ = parts(seed=5)
        counter2 = Counter()
        st2 = TrainState(m2, opt2, {"counter": counter2}, rank=rank, device=torch.device("cpu"))
        assert checkpointing.load(persisted, st2, dist)[0] == 2
        assert counter2.n == (100 + rank if rank < 2 else 100)
        got = flat_tensors(TrainState(m2, opt2, {}, rank=0, device=torch.device("cpu")))
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_node_short_of_memory_says_so_before_writing_anything(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fmt, "free_bytes", lambda root: 1000)
    m, opt, _ = parts(seed=1)
    snaps = snapshots.Snapshots(tmp_path, job_id="j", attempt=0, rank=0, world_size=1)
    live = state(m, opt).live()
    with pytest.raises(snapshots.SnapshotsOff, match="1000 bytes free"):
        snaps.take(0, live, DataPosition(next_batch=0), timeline=0, checkpointing=False, replicated=True)
    assert not list(tmp_path.glob("j/*"))


def test_the_agent_persists_the_newest_good_slot_newer_than_the_ranks_own_checkpoints(tmp_path: Path) -> None:
    """services/agent/snapshots.choose: nothing at or below what the rank staged itself (a step it began to
    checkpoint but never staged is persisted: a peer's death can stop that checkpoint), a torn slot passed over for
    the other, and every slot bad said as such."""

    m, opt, _ = parts(seed=1)
    snaps = snapshots.Snapshots(tmp_path, job_id="j", attempt=0, rank=0, world_size=1)
    _take(snaps, state(m, opt), 9)
    _take(snaps, state(m, opt), 10, checkpointing_=True)  # the rank began checkpoint step 10 itself
    chosen = agent_snaps.choose(tmp_path, "j", 0, 0, None)
    assert isinstance(chosen, list) and [h.step for h, _ in chosen] == [10, 9]
    assert agent_snaps.choose(tmp_path, "j", 0, 0, (0, 10)) is None  # it staged step 10 itself: nothing newer
    _take(snaps, state(m, opt), 11)  # into step 9's slot
    ((header, folder),) = agent_snaps.choose(tmp_path, "j", 0, 0, (0, 10))  # type: ignore[misc]
    assert header.step == 11
    event = agent_snaps.persist_event(header, folder, node="n", producer="agent-n", seconds=0.1)
    assert event.from_memory and (event.step, event.rank, event.attempt) == (11, 0, 0)
    assert sorted(s.path for s in event.shards) == ["r0.bin", "r0.json"] and event.staging_dir == str(folder)
    data = bytearray((folder / "r0.bin").read_bytes())
    data[0] ^= 1
    (folder / "r0.bin").write_bytes(bytes(data))
    chosen = agent_snaps.choose(tmp_path, "j", 0, 0, None)  # step 11's is torn: step 10's, the other slot
    assert isinstance(chosen, list) and [h.step for h, _ in chosen] == [10]
    why = agent_snaps.choose(tmp_path, "j", 0, 0, (0, 10))
    assert isinstance(why, str) and "checksum" in why
    snaps.close()


def test_the_agent_never_persists_a_snapshot_ahead_of_the_ranks_reported_steps(tmp_path: Path) -> None:
    """Step N's snapshot holds step N-1's update: kept only if the rank's record of step N-1 reached its agent
    (its last report can die with it), else the older slot, whose steps are all on record."""

    m, opt, _ = parts(seed=1)
    snaps = snapshots.Snapshots(tmp_path, job_id="j", attempt=0, rank=0, world_size=1)
    _take(snaps, state(m, opt), 26)
    _take(snaps, state(m, opt), 27)
    snaps.close()
    # both slots when both qualify, newest first: a peer whose last report died with it may only have the older
    for reported, want in [(26, [27, 26]), (27, [27, 26]), (25, [26]), (24, None), (None, [27, 26])]:
        chosen = agent_snaps.choose(tmp_path, "j", 0, 0, None, reported)
        assert ([h.step for h, _ in chosen] if isinstance(chosen, list) else chosen) == want, reported


def report(n: int, *, rank: int = 0, loss: float = 1.0) -> bytes:
    return codec.encode(StepCompleted(job_id="j", rank=rank, attempt=0, step=n, loss=loss, grad_norm=0.0, lr=0.0,
                                      tokens_per_s=0.0, step_time_s=0.1, event_id=f"r{rank}-s{n}-{loss}"))


async def test_a_snapshot_past_the_rank_s_record_is_persisted_with_the_reports_between_published_again(
        tmp_path: Path) -> None:
    """A node agent killed with its ranks (nemesis seed 2) took the rank's newest step reports with it, while its
    snapshots were two and three steps further on: before, the restarted agent persisted a slot past the record
    and the lineage lacked those steps. The header carries the rank's newest reports; the slot qualifies when they
    cover the steps between, which are published again first (under their own ids: a copy that did land is
    dropped by the broker), a NaN loss intact; without them, it does not."""

    m, opt, _ = parts(seed=1)
    sent = [report(n) for n in range(20, 26)] + [report(24, loss=float("nan"))]  # step 24 ran again (a rollback)
    snaps = snapshots.Snapshots(tmp_path, job_id="j", attempt=0, rank=0, world_size=1, recent=lambda: list(sent))
    _take(snaps, state(m, opt), 26)
    _take(snaps, state(m, opt), 27)
    snaps.close()
    chosen = agent_snaps.choose(tmp_path, "j", 0, 0, None, 22)  # steps 23..26 are in the headers, 26 is not
    assert isinstance(chosen, list) and [h.step for h, _ in chosen] == [26]
    steps = agent_snaps.missing(chosen[0][0], 22)
    assert steps is not None and [s.step for s in steps] == [23, 24, 25] and math.isnan(steps[1].loss)
    assert agent_snaps.choose(tmp_path, "j", 0, 0, None, 18) is None  # step 19 is nowhere: nothing qualifies

    store = MemoryStore()
    await store.append(subjects.telemetry("j", 0, "StepCompleted"), codec.decode(report(23)), msg_id="r0-s23-1.0")
    await agent_snaps.persist(tmp_path, store, "j", 0, 0, None, 22, node="n", producer="agent-n")
    rows = [s for batch in [x async for x in store.read(subjects.TELEMETRY, ["fd.tel.j.>"])] for s in batch]
    assert [(type(s.event).__name__, getattr(s.event, "step", None)) for s in rows] == [
        ("StepCompleted", 23), ("StepCompleted", 24), ("StepCompleted", 25), ("CheckpointStaged", 26)]


def test_snapshots_space_out_to_keep_within_their_share_of_the_training_time(tmp_path: Path) -> None:
    """train.snapshot_max_overhead: a snapshot holding the loop 20 ms beside 100 ms steps is spaced 10 steps apart
    at 2%, 1 at 1 (never capped). The CPU it takes beside training counts only where no core is spare for it (10 ms
    more here: 15 apart). The ranks agree on the largest spacing: every one snapshots the multiples of it."""

    def cadence(overhead: float, spare: bool = True, stall: float = 0.015, every: int = 1) -> Cadence:
        snaps = snapshots.Snapshots(tmp_path, job_id="j", attempt=0, rank=0, world_size=1)
        snaps.last_stall_s, snaps.last_background_s = stall, 0.010
        c = Cadence(snaps, every=every, max_overhead=overhead, off=lambda reason: None)
        c.gather_s, c.spare_cores = 0.005, lambda: spare
        return c

    assert cadence(0.02).spacing([0.1] * 5) == 10
    assert cadence(0.02, spare=False).spacing([0.1] * 5) == 15
    assert cadence(1.0).spacing([0.1] * 5) == 1
    assert cadence(0.02, every=5).spacing([0.1] * 5) == 2  # 5 steps of 0.1 s hold 10 ms at 2%: every 10th step
    held = cadence(0.02)
    held.holding_s = 0.001  # a boundary's hold for a snapshot after a failure (lastboundary.py) comes first
    assert held.spacing([0.1] * 5) == 20
    ranks = [cadence(0.02, stall=stall) for stall in (0.015, 0.025)]  # one rank's snapshot costs more
    agreed = max(c.spacing([0.1] * 5) for c in ranks)
    for c in ranks:
        c.agreed(agreed)
    assert agreed == 15 and [[s for s in range(1, 61) if c.due(s)] for c in ranks] == [[15, 30, 45, 60]] * 2


async def test_a_restarted_agent_reads_what_its_dead_ranks_had_on_record_from_the_history() -> None:
    """What the links knew before the agent died, rebuilt from the history: the rank's own staging (not one an
    agent persisted), the newest step the rank itself has on record (its own report of a newer step may have died
    with the agent, and the lineage would lack it; a peer's newer one says nothing of it), the step before the
    one it started from when it has none, and a rollback after that: nothing of the new timeline past its restore
    point is on record."""

    store = MemoryStore()

    async def put(event: Any) -> None:
        await store.append(subjects.telemetry(event.job_id, event.rank, type(event).__name__), event)

    def step(rank: int, n: int, attempt: int = 2) -> StepCompleted:
        return StepCompleted(job_id="j", rank=rank, attempt=attempt, step=n, loss=1.0, grad_norm=0.0, lr=0.0,
                             tokens_per_s=0.0, step_time_s=0.1)

    assert await agent_snaps.recorded(store, "j", 2, 1, [1, 2]) == (None, -1)
    await put(RankStarted(job_id="j", rank=1, attempt=2, world_size=3, from_step=12, device="cpu"))
    assert await agent_snaps.recorded(store, "j", 2, 1, [1, 2]) == (None, 11)
    staged = CheckpointStaged(job_id="j", rank=1, attempt=2, step=20, world_size=3, staging_dir="/s", shards=[],
                              data=DataPosition(next_batch=20), stall_s=0.0, write_s=0.0, timeline=1)
    for event in (step(1, 30), step(2, 33), step(0, 31), step(0, 90, attempt=1), staged):
        await put(event)
    assert await agent_snaps.recorded(store, "j", 2, 1, [1, 2]) == ((1, 20), 30)
    await put(msgspec.structs.replace(staged, step=34, from_memory=True))  # an agent's persist: not the rank's own
    await put(RolledBack(job_id="j", rank=2, attempt=2, checkpoint_id="c", to_step=20, skip_from=20, skip_to=24))
    assert await agent_snaps.recorded(store, "j", 2, 1, [1, 2]) == (None, 19)


def test_what_only_the_optimizer_writes_is_copied_beside_training_and_the_slot_holds_the_state_it_was_taken_at(
        tmp_path: Path, dist: distributed.Dist) -> None:
    """The parameters and the optimizer's state are copied on the copier's threads while the step's forward and
    backward run; the optimizer's step waits for that copy first (as the rank's pre-step hook does), so the slot
    holds exactly the state at the boundary it was taken at. Buffers, which the forward pass writes, are copied at
    the boundary itself."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    st = TrainState(model, opt, {}, rank=0, device=torch.device("cpu"))
    snaps = snapshots.Snapshots(tmp_path, job_id="j", attempt=0, rank=0, world_size=1)
    snaps._copier = HostCopier(threads=2)
    opt.register_step_pre_hook(lambda *_: snaps.copied())

    def backward() -> None:
        opt.zero_grad()
        model(torch.randn(2, 64)).square().mean().backward()  # BatchNorm's statistics move here

    backward()
    opt.step()
    for n in (1, 2, 3):
        backward()  # before the boundary here, so that the optimizer's step comes at once after the snapshot
        live = st.live()
        settled = st.settled(live)
        buffers = {"model.1.running_mean", "model.1.running_var", "model.1.num_batches_tracked"}  # BatchNorm's
        params = {k for k in live if k.startswith("model.")} - buffers
        assert settled == params | {k for k in live if k.startswith("optim.state.")} and not buffers & settled
        at_boundary = {k: v.clone() for k, v in live.items() if isinstance(v, torch.Tensor)}
        position = DataPosition(next_batch=n)
        live[checkpointing.META_KEY] = checkpointing.meta_item(n, position, 1)
        snaps.take(n, live, position, timeline=0, checkpointing=False, replicated=True, settled=settled)
        opt.step()  # the copy is still running: the pre-step hook waits for it
        snaps.wait()
        ((header, folder), *_) = fmt.complete_slots(tmp_path, "j", 0, 0)
        assert header.step == n
        fmt.check_bytes(folder, header)
        restored = TrainState(*_fresh(), {}, rank=0, device=torch.device("cpu"))
        assert checkpointing.load(folder, restored, dist)[0] == n
        again = {k: v for k, v in restored.live().items() if isinstance(v, torch.Tensor) and not k.startswith("rng.")}
        assert again.keys() == {k for k in at_boundary if not k.startswith("rng.")}
        assert all(torch.equal(again[k], at_boundary[k]) for k in again), [k for k in again
                                                                           if not torch.equal(again[k], at_boundary[k])]
    snaps.close()


def _mlp() -> torch.nn.Module:
    """12 MB of weights: their copy outlasts an optimizer's step that does not wait for it."""
    nn = torch.nn
    return nn.Sequential(nn.Linear(64, 1024), nn.BatchNorm1d(1024), nn.Linear(1024, 1024), nn.Linear(1024, 4))


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(5)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.zero_grad()
    model(torch.randn(2, 64)).square().mean().backward()
    opt.step()  # the optimizer's state exists, so the load has somewhere to go
    return model, opt


@pytest.mark.parametrize("replicated", [True, False])
def test_a_sharded_slot_restores_only_a_world_of_its_own_size(tmp_path: Path, replicated: bool) -> None:
    """A rank's slot of a sharded state (FSDP, TP, a pipeline stage) holds its own pieces only: a rank of a world of
    another size (a shrink), or of the same size laid out anew, must read the store's set, or it would find pieces
    missing (DCP leaves what no piece covers as it was); a full replica serves any."""
    m, opt, _ = parts(seed=1)
    snaps = snapshots.Snapshots(tmp_path, job_id="j", attempt=0, rank=0, world_size=2)
    live = state(m, opt).live()
    position = DataPosition(next_batch=9, skipped=[])
    live[checkpointing.META_KEY] = checkpointing.meta_item(9, position, 2)
    layout = (2, 1, 1) if replicated else (1, 2, 1)  # DP 2, or TP 2
    snaps.take(9, live, position, timeline=0, checkpointing=False, replicated=replicated, layout=layout)
    snaps.wait()
    ((header, folder),) = agent_snaps.choose(tmp_path, "j", 0, 0, None)  # type: ignore[misc]
    assert header.layout == list(layout)
    event = agent_snaps.persist_event(header, folder, node="n", producer="agent-n", seconds=0.1)
    mf = manifest.Manifest(job_id="j", checkpoint_id="c9", step=9, world_size=2, attempt=0, created_at=1.0,
                           shards=event.shards, data=position)
    assert agent_snaps.in_memory(tmp_path, "j", "c9", 9, 0, mf, world_size=2) == folder
    assert agent_snaps.in_memory(tmp_path, "j", "c9", 9, 0, mf, world_size=1) == (folder if replicated else None)
    # the same world laid out anew (TP 2 -> PP 2): a shard of the old layout is not the new rank 0's
    as_planned = ParallelPlan(world_size=2, dp=layout[0], tp=layout[1], pp=layout[2])
    pipeline = ParallelPlan(world_size=2, dp=1, tp=1, pp=2)
    assert agent_snaps.in_memory(tmp_path, "j", "c9", 9, 0, mf, world_size=2, plan=as_planned) == folder
    assert agent_snaps.in_memory(tmp_path, "j", "c9", 9, 0, mf, world_size=2, plan=pipeline) == (
        folder if replicated else None)
    snaps.close()


def test_a_snapshot_keeps_its_copy_plan_only_for_the_tensors_it_was_made_for(tmp_path: Path,
                                                                            dist: distributed.Dist) -> None:
    """A snapshot of the tensors the last one saw reuses its layout and each slot's copy plan (TrainState.generation):
    one taken after the state's tensors were swapped, into the slot whose plan predates the swap, copies the new
    ones. Plans kept per slot by "the same as the gather before" copied the swapped-out tensors there."""
    m, opt, cursor = parts(seed=1)
    train(m, opt, cursor, 1)
    st = state(m, opt)
    cad = Cadence(snapshots.Snapshots(tmp_path, job_id="j", attempt=0, rank=0, world_size=1), every=1,
                  max_overhead=1.0, off=lambda why: None)

    def take(step: int) -> None:
        cad.take(step, st.live, DataPosition(next_batch=step), 1, timeline=0, checkpointing_=False, layout=(1, 1, 1),
                 settled=st.settled, generation=lambda: st.generation)
        assert cad.snaps is not None
        cad.snaps.copied()
        cad.snaps.wait()

    take(1)  # slot 0, planned for these tensors
    with torch.no_grad():
        first = next(iter(m.parameters()))
        first.data = first.data.clone().add_(1.0)  # new memory under the same parameter
    take(2)  # slot 1, planned anew
    take(3)  # slot 0 again: its plan is of the tensors before the swap
    ((header, folder), _) = fmt.complete_slots(tmp_path, "j", 0, 0)
    assert header.step == 3
    restored = state(*parts(seed=2)[:2])
    checkpointing.load(folder, restored, dist)
    want, got = flat_tensors(st), flat_tensors(restored)
    assert all(torch.equal(want[k], got[k]) for k in want), [k for k in want if not torch.equal(want[k], got[k])]


@pytest.mark.parametrize("holds", [True, False], ids=["cpu", "no-boundary-hold"])
def test_a_rank_snapshots_only_the_steps_its_cadence_makes_due(tmp_path: Path, holds: bool) -> None:
    """Every 4th step of 12, whether or not the rank holds the boundaries between (it does not on a GPU, where a step
    not due once took a snapshot all the same: every step, whatever the spacing)."""
    from flightdeck.events.spec import parse_spec
    from flightdeck.trainer.config import RunConfig
    from flightdeck.trainer.link import Offline
    from flightdeck.trainer.loop import train as train_loop
    from flightdeck.trainer.reports import Emitter
    from flightdeck.trainer.session import Run

    from .ranks import write_spec

    spec = write_spec(tmp_path / "job.toml", train={"steps": 12, "checkpoint_every": 1000, "snapshot_every": 4,
                                                    "snapshot_max_overhead": 1.0})
    cfg = RunConfig(job_id="j", spec=parse_spec(spec.read_bytes()), attempt=0, node="n", agent=None,
                    staging=tmp_path / "staging", restore=None, manifest=None, rank=0, world_size=1, local_rank=0,
                    device="cpu", sync_every=1, events_log=None, snapshots=tmp_path / "shm")
    run = Run(cfg, distributed.init(0, 1, 0, "cpu"), Emitter(Offline(), {"job_id": "j", "rank": 0, "attempt": 0,
                                                                       "node": "n"}, None), Offline())
    assert run.last is not None and run.snapshots is not None and run.snapshots.snaps is not None
    if not holds:
        run.last = None
    snaps = run.snapshots.snaps
    try:
        assert train_loop(run) == 0
    finally:
        run.close()
    assert snaps.taken == 3
    assert sorted(h.step for h in map(fmt.read_header, (tmp_path / "shm" / "j").glob("*/r0.json"))) == [4, 8]
