"""The snapshot a rank takes after a failure, of the boundary before it (trainer/lastboundary.py), in one process: it
holds exactly that boundary's state (parameters, optimizer state, the buffers and RNG the step moved since, a user's
extra), never a state the optimizer's step has written, and an optimizer step that resumes during its copy waits for
it. On SIGTERM a rank stuck in its step takes it; one still moving leaves it to its boundary."""

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from flightdeck.events import snapshot as fmt
from flightdeck.events.checkpoint import DataPosition
from flightdeck.trainer import checkpointing, distributed, snapshots
from flightdeck.trainer.lastboundary import LastBoundary
from flightdeck.trainer.snapshotting import Cadence
from flightdeck.trainer.state import TrainState

from .test_checkpointing import Counter

EVERY = 1000  # the cadence's snapshots: none at the steps these tests fail in


class Rank:
    """A rank's state, cadence and last boundary, wired as Run wires them."""

    def __init__(self, root: Path, every: int = EVERY) -> None:
        torch.manual_seed(0)
        nn = torch.nn
        self.model = nn.Sequential(nn.Linear(16, 256), nn.BatchNorm1d(256), nn.Linear(256, 4))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.counter = Counter()
        self.st = TrainState(self.model, self.opt, {"counter": self.counter}, rank=0, device=torch.device("cpu"))
        snaps = snapshots.Snapshots(root, job_id="j", attempt=0, rank=0, world_size=1)
        self.cadence = Cadence(snaps, every=every, max_overhead=1.0, off=lambda reason: None)
        self.last = LastBoundary(self.cadence, lambda: [0.01])
        self.opt.register_step_pre_hook(lambda *_: self.last.drop())
        self.step = 0

    def forward_backward(self) -> None:
        self.opt.zero_grad()
        self.model(torch.randn(8, 16)).square().mean().backward()  # BatchNorm's statistics and the RNG move here

    def boundary(self) -> dict[str, Any]:
        """The loop's boundary: drop, then snapshot or hold; returns a copy of the state there."""
        self.last.drop()
        position = DataPosition(next_batch=self.step)
        args: dict[str, Any] = {"timeline": 0, "checkpointing_": False, "layout": (1, 1, 1),
                                "settled": self.st.settled}
        if self.cadence.due(self.step):
            self.cadence.take(self.step, self.st.live, position, 1, **args)
        else:
            self.last.hold(self.step, self.st.live, position, 1, **args)
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.st.live().items()}

    def run_steps(self, n: int) -> None:
        for _ in range(n):
            self.boundary()
            self.counter.n += 1
            self.forward_backward()
            self.opt.step()
            self.step += 1


def restored(folder: Path) -> dict[str, Any]:
    r = Rank(folder.parent.parent.parent / "other")  # fresh objects, other values
    r.forward_backward()
    r.opt.step()  # the optimizer's state exists, so the load has somewhere to go
    step, _ = checkpointing.load(folder, r.st, distributed.init(0, 1, 0, "cpu"))
    return {"step": step, "counter": r.counter.n, **{k: v for k, v in r.st.live().items()
                                                     if isinstance(v, torch.Tensor)}}


def assert_holds(folder: Path, at_boundary: dict[str, Any], step: int) -> None:
    got = restored(folder)
    assert got.pop("step") == step
    assert got.pop("counter") == at_boundary["extras.0.counter"]
    tensors = {k: v for k, v in at_boundary.items() if isinstance(v, torch.Tensor)}
    assert got.keys() == tensors.keys()
    assert [k for k in got if not torch.equal(got[k], tensors[k])] == []


def newest(root: Path) -> tuple[fmt.Header, Path]:
    return fmt.complete_slots(root, "j", 0, 0)[0]


def test_a_failure_before_the_optimizer_step_snapshots_the_boundary_it_followed(tmp_path: Path) -> None:
    r = Rank(tmp_path / "snaps")
    r.run_steps(3)
    at_boundary = r.boundary()
    at_boundary["extras.0.counter"] = r.counter.n
    r.counter.n += 1  # the step moves the extra, the buffers and the RNG, then fails before its optimizer step
    r.forward_backward()
    assert r.last.take("a test's failure") == 3
    header, folder = newest(tmp_path / "snaps")
    assert (header.step, header.data) == (3, DataPosition(next_batch=3))
    fmt.check_bytes(folder, header)
    assert_holds(folder, at_boundary, 3)
    assert r.last.take("again") is None  # taken once


def test_nothing_is_taken_once_the_optimizer_stepped_nor_for_a_step_the_cadence_snapshotted(tmp_path: Path) -> None:
    r = Rank(tmp_path / "snaps")
    r.run_steps(2)
    r.boundary()
    r.forward_backward()
    r.opt.step()  # the state is no longer the boundary's
    assert r.last.take("too late") is None
    r.cadence.written()  # the cadence's header is written beside training: under load it may not be yet
    assert [h.step for h, _ in fmt.complete_slots(tmp_path / "snaps", "j", 0, 0)] == [0]  # the cadence's own

    every = Rank(tmp_path / "every", every=1)
    every.run_steps(2)
    every.boundary()
    every.cadence.written()
    assert every.last.take("already snapshotted") is None
    assert [h.step for h, _ in fmt.complete_slots(tmp_path / "every", "j", 0, 0)] == [2, 1]


def test_an_optimizer_step_resumed_during_the_copy_waits_for_it(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy is slowed down; the optimizer's step, started once it runs, must not land in it."""
    r = Rank(tmp_path / "snaps")
    r.run_steps(2)
    at_boundary = r.boundary()
    at_boundary["extras.0.counter"] = r.counter.n
    r.forward_backward()
    copying = threading.Event()
    take = snapshots.Snapshots.take

    def slow_take(self: snapshots.Snapshots, *args: Any, **kwargs: Any) -> float:
        copying.set()
        time.sleep(0.3)
        return take(self, *args, **kwargs)

    monkeypatch.setattr(snapshots.Snapshots, "take", slow_take)
    taker = threading.Thread(target=r.last.take, args=("a peer failed",))
    taker.start()
    assert copying.wait(10)
    before = r.model[0].weight.detach().clone()
    r.opt.step()  # waits in its pre-step hook until the snapshot is written
    taker.join()
    assert not torch.equal(r.model[0].weight, before)
    assert_holds(newest(tmp_path / "snaps")[1], at_boundary, 2)


@pytest.fixture
def watched() -> Iterator[list[LastBoundary]]:
    """SIGTERM handled as Run handles it (a flag), each LastBoundary's watcher stopped after the test."""
    flags: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: flags.append(signum))
    lasts: list[LastBoundary] = []
    try:
        yield lasts
    finally:
        for last in lasts:
            last.unwatch()
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_while_stuck_in_a_step_snapshots_its_last_boundary(tmp_path: Path,
                                                                   watched: list[LastBoundary]) -> None:
    r = Rank(tmp_path / "snaps")
    r.run_steps(2)
    at_boundary = r.boundary()
    at_boundary["extras.0.counter"] = r.counter.n
    r.forward_backward()
    r.last.watch_sigterm()
    watched.append(r.last)
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 30
    while r.last.taken is None and time.monotonic() < deadline:  # stuck: no boundary, no optimizer step
        time.sleep(0.05)
    assert r.last.taken == 2
    assert_holds(newest(tmp_path / "snaps")[1], at_boundary, 2)


def test_a_loop_of_the_ranks_own_that_sets_the_wakeup_fd_still_gets_sigterm_and_so_does_the_watcher(
        tmp_path: Path, watched: list[LastBoundary]) -> None:
    """Python keeps one signal wakeup fd: an asyncio loop's signal handler set after the watcher's replaced it, and a
    rank stuck at SIGTERM took no snapshot. The next step takes it back and relays to the loop what arrives."""
    r = Rank(tmp_path / "snaps")
    r.last.watch_sigterm()
    watched.append(r.last)
    loop = asyncio.new_event_loop()
    heard = threading.Event()
    loop.add_signal_handler(signal.SIGTERM, heard.set)  # the rank's code: its loop's self-pipe is the wakeup fd now
    try:
        r.run_steps(2)  # its steps take the wakeup fd back
        at_boundary = r.boundary()
        at_boundary["extras.0.counter"] = r.counter.n
        r.forward_backward()
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 30
        while r.last.taken is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.last.taken == 2  # the watcher heard it
        assert_holds(newest(tmp_path / "snaps")[1], at_boundary, 2)
        loop.run_until_complete(asyncio.wait_for(loop.run_in_executor(None, heard.wait, 30), 30))
        assert heard.is_set()  # ... and so did the rank's own loop, relayed
        r.last.unwatch()
        assert signal.set_wakeup_fd(-1) == loop._csock.fileno()  # type: ignore[attr-defined]  # its own fd back
        signal.set_wakeup_fd(loop._csock.fileno())  # type: ignore[attr-defined]
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        loop.close()


@pytest.mark.parametrize("moves_again", [False, True])
def test_a_rank_still_stuck_after_its_snapshot_leaves_and_one_whose_loop_moves_again_does_not(
        tmp_path: Path, moves_again: bool) -> None:
    """Its agent persists the snapshot once it exits, and SIGKILLs it only after its grace (30 s by default): a
    hang's restart waited that long for the stuck peers' snapshots. Still stuck a while after the snapshot, it
    leaves (Run: exit 75, flushed); a loop that moves again goes on to its boundary's checkpoint instead. The
    watcher's decision runs here in the test's thread, as it runs in its own on a SIGTERM."""
    r = Rank(tmp_path / "snaps")
    left: list[int | None] = []
    r.last.leave = lambda: left.append(r.last.taken)
    if moves_again:  # the collective it waited in comes back as soon as the snapshot is written
        r.last.told = lambda: setattr(r.last, "moves", r.last.moves + 1)
    r.run_steps(2)
    r.boundary()
    r.forward_backward()
    r.last._stuck_or_not()
    assert r.last.taken == 2
    assert left == ([] if moves_again else [2])  # it leaves after its snapshot, never before


def test_sigterm_while_the_loop_moves_leaves_the_checkpoint_to_its_boundary(tmp_path: Path,
                                                                            watched: list[LastBoundary]) -> None:
    r = Rank(tmp_path / "snaps")
    # steps of 1.5 s: stuck after 3 s without one (it waits twice a step); 0.5 s let a loaded CI box's one-second
    # pause between two of the loop's steps look stuck
    r.last.step_times = lambda: [1.5]
    r.run_steps(2)
    r.last.watch_sigterm()
    watched.append(r.last)
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(120):  # steps keep coming, ~20 a second for 6 s: more than the watcher waits
        r.run_steps(1)
        time.sleep(0.05)
    assert r.last.taken is None
    r.cadence.written()
    assert [h.step for h, _ in fmt.complete_slots(tmp_path / "snaps", "j", 0, 0)] == [0]  # the cadence's own


def test_run_leaves_a_stuck_step_only_from_its_loop_and_never_while_a_checkpoint_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint's write may take longer than the watcher waits, and after the last step the process ends as done
    once its last write is: neither is left as stopped."""
    from flightdeck.events.nodelocal import STOPPED_EXIT
    from tests.trainer.ranks import offline_run

    run, _ = offline_run(tmp_path, {}, steps=4, every=2)
    died: list[int] = []
    monkeypatch.setattr(run, "_die", died.append)
    model = torch.nn.Linear(2, 2)
    run.register(model, torch.optim.SGD(model.parameters(), lr=0.1))
    run._leave_stuck()
    assert died == []  # before the loop
    steps = run.steps()
    next(steps)
    run._leave_stuck()
    assert died == [STOPPED_EXIT]  # in a step
    release = threading.Event()
    run.ckpt._thread = threading.Thread(target=release.wait, daemon=True)
    run.ckpt._thread.start()
    run._leave_stuck()
    assert died == [STOPPED_EXIT]  # a write under way
    release.set()
    run.ckpt.wait()
    for _ in steps:
        pass
    run._leave_stuck()
    assert died == [STOPPED_EXIT]  # every step ran
    run.close()
