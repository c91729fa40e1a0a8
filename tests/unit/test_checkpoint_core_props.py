"""Properties of the checkpoint core over generated histories: the all-ranks rule and retention."""

from hypothesis import given, settings
from hypothesis import strategies as st

from flightdeck.events.base import Event
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointDeleted, DataPosition
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.training import RolledBack
from flightdeck.services.checkpoints import core
from flightdeck.services.checkpoints.core import checkpoint_id
from flightdeck.services.core import Effect, Emit
from tests.unit.test_checkpoint_core import JOB, LIVE, staged, stored, submitted

WORLD = 2


@settings(max_examples=300, deadline=None)
@given(world=st.integers(1, 6), data=st.data())
def test_one_commit_exactly_when_every_rank_has_staged_and_its_agent_stored_it(world: int,
                                                                              data: st.DataObject) -> None:
    """Stagings and agents' reports in any order: one commit, when every rank has staged and a report for it came
    after its newest staging; never one before, never a second."""
    ops = data.draw(st.lists(st.tuples(st.sampled_from(["staged", "stored"]), st.integers(0, world - 1)),
                             max_size=4 * world))
    state = LIVE
    staged_ranks: set[int] = set()
    stored_ranks: set[int] = set()
    done = False
    for i, (kind, rank) in enumerate(ops):
        ev = staged(rank, 7, world, at=float(i))
        if kind == "staged":
            state, outs = core.transition(state, ev)
            staged_ranks.add(rank)
            stored_ranks.discard(rank)
        else:
            state, outs = core.transition(state, stored(ev))
            if rank in staged_ranks:
                stored_ranks.add(rank)
        completes = not done and len(staged_ranks) == world and len(stored_ranks) == world
        done = done or completes
        assert len(outs) == (1 if completes else 0), (ops[: i + 1], outs)
        if completes:
            [effect] = outs
            assert isinstance(effect, Effect) and [r.rank for r in effect.args.ranks] == list(range(world))


# one operation of a generated history
commit_op = st.just(("commit", 0))
rollback_op = st.tuples(st.just("rollback"), st.integers(0, 30))  # index into the committed so far
rolled_op = st.tuples(st.just("rolled"), st.integers(0, 30), st.integers(0, WORLD - 1))
echo_op = st.just(("echo", 0))  # the recorded CheckpointDeleted events come back as inputs
ops = st.lists(st.one_of(commit_op, commit_op, rollback_op, rolled_op, echo_op), max_size=40)


@settings(max_examples=300, deadline=None)
@given(keep=st.integers(1, 4), history=ops)
def test_retention_keeps_newest_k_and_every_held_checkpoint(keep: int, history: list[tuple]) -> None:
    """Retention keeps the newest K checkpoints no rollback threw away, every held one, and every one standing
    below a held one (a restore not yet confirmed may fall back past it): a rollback throws away the checkpoints
    above its step that ranks staged before they applied it (an older timeline)."""
    state = core.State()
    commits: list[tuple[str, int, int]] = []  # (id, step, timeline) in commit order
    deleted: list[str] = []
    echo_pending: list[str] = []
    holds: dict[str, set[int]] = {}  # the model: rollback target -> ranks that rolled back
    forks: list[tuple[int, int]] = []  # the model: (timeline started, at step) per rollback

    def standing() -> list[str]:
        """Checkpoints not deleted yet that no rollback threw away, oldest first."""
        return [cid for cid, step, tl in commits
                if cid not in deleted and not any(tl < t and step > s for t, s in forks)]

    def below_holds() -> set[str]:
        """Standing checkpoints at or below the step of a held one."""
        top = max((step for cid, step, _ in commits if cid in holds), default=-1)
        return {cid for cid in standing() if next(step for c, step, _ in commits if c == cid) <= top}

    def feed(ev: Event) -> None:
        nonlocal state
        protected = below_holds()
        state, outs = core.transition(state, ev)
        now = [out.event.checkpoint_id for out in outs if isinstance(out, Emit)
               and isinstance(out.event, CheckpointDeleted)]
        assert not set(now) & set(standing()[-keep:]), "one of the newest K a rollback left standing was deleted"
        if not isinstance(ev, RolledBack):
            assert not set(now) & protected, "a checkpoint below an unconfirmed restore was deleted"
        deleted.extend(now)
        echo_pending.extend(now)

    feed(submitted(keep))
    for op in history:
        if op[0] == "commit":
            step = len(commits) + 1
            cid = checkpoint_id(0, step, len(forks))
            commits.append((cid, step, len(forks)))
            feed(CheckpointCommitted(job_id=JOB, checkpoint_id=cid, step=step, world_size=WORLD, uri="u", bytes=1,
                                     data=DataPosition(next_batch=0), timeline=len(forks)))
        elif op[0] == "rollback" and commits:
            cid, step, _ = commits[op[1] % len(commits)]
            if cid not in deleted:
                holds[cid] = set()
                forks.append((len(forks) + 1, step))
                feed(RollbackRequested(job_id=JOB, checkpoint_id=cid, to_step=step, skip_from=0, skip_to=0,
                                       reason="t"))
        elif op[0] == "rolled" and holds:
            cid = sorted(holds)[op[1] % len(holds)]
            holds[cid].add(op[2])
            if len(holds[cid]) == WORLD:
                del holds[cid]
            feed(RolledBack(job_id=JOB, rank=op[2], checkpoint_id=cid, to_step=0, skip_from=0, skip_to=0))
        elif op[0] == "echo" and echo_pending:
            feed(CheckpointDeleted(job_id=JOB, checkpoint_id=echo_pending.pop(0)))
        live = [cid for cid, _, _ in commits if cid not in deleted]
        assert len(deleted) == len(set(deleted)), "a checkpoint was deleted twice"
        assert not set(deleted) & set(holds), "a held rollback target was deleted"
        assert set(live) <= set(standing()[-keep:]) | set(holds) | below_holds(), "an unneeded checkpoint was kept"
