"""Two-phase checkpoints in one process: staged shards with hashes, exact restore, corrupt files refused."""

from pathlib import Path

import pytest
import torch

from flightdeck.events.base import RankEvent
from flightdeck.events.checkpoint import CheckpointStaged, DataPosition
from flightdeck.events.spec import ModelSpec
from flightdeck.trainer import checkpointing, distributed, model
from flightdeck.trainer.cursor import BatchCursor
from flightdeck.trainer.data import TokenStream, load_tokens
from flightdeck.trainer.state import TrainState

SPEC = ModelSpec(n_layer=1, n_head=2, d_model=16, seq_len=16, vocab_size=64)


class Counter:
    """A user's extra: anything with state_dict() and load_state_dict()."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.n = sd["n"]


def parts(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, BatchCursor]:
    m = model.build(SPEC, seed, torch.device("cpu"))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    return m, opt, BatchCursor()


STREAM = TokenStream(load_tokens("synthetic", 64), seq_len=16, batch_size=2, seed=0, rank=0, world_size=1,
                     vocab_size=64)


def state(m: torch.nn.Module, opt: torch.optim.Optimizer, counter: Counter | None = None) -> TrainState:
    return TrainState(m, opt, {"counter": counter or Counter()}, rank=0, device=torch.device("cpu"))


def flat_tensors(st: TrainState) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in st.live().items() if isinstance(v, torch.Tensor) and not k.startswith("rng.")}


def train(m: torch.nn.Module, opt: torch.optim.Optimizer, s: BatchCursor, steps: int) -> None:
    for _ in range(steps):
        x, y = STREAM.batch(s.next_index())
        loss = torch.nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.fixture
def staged(tmp_path: Path) -> tuple[CheckpointStaged, dict[str, torch.Tensor]]:
    """A checkpoint at step 3 (stream skipped [5, 7)), and a copy of the state it holds."""
    m, opt, s = parts(seed=1)
    train(m, opt, s, 3)
    s.skip(5, 7)
    out: list[RankEvent] = []
    ckpt = checkpointing.Checkpointer(job_id="j", staging=tmp_path, dist=distributed.init(0, 1, 0, "cpu"),
                                      emit=out.append, envelope={"job_id": "j", "rank": 0, "attempt": 2, "node": "n"})
    counter = Counter()
    counter.n = 42
    st = state(m, opt, counter)
    saved = flat_tensors(st)
    ckpt.save(3, st.live(), s.position())
    first_buffers = {k: t.data_ptr() for k, t in ckpt.buffers.items()}
    train(m, opt, s, 1)  # the write goes on in the background while training continues
    counter.n = 43
    ckpt.wait()
    assert {k: t.data_ptr() for k, t in ckpt.buffers.items()} == first_buffers
    (event,) = out
    assert isinstance(event, CheckpointStaged)
    return event, saved


def test_a_staged_checkpoint_lists_hashed_shards_and_restores_exactly(
        staged: tuple[CheckpointStaged, dict[str, torch.Tensor]]) -> None:
    event, saved = staged
    assert (event.step, event.world_size, event.attempt) == (3, 1, 2)
    assert event.staging_dir.endswith("/j/step-3")
    assert sorted(s.path for s in event.shards) == [".metadata", "__0_0.distcp"]
    assert all(len(s.sha256) == 64 and s.size > 0 for s in event.shards)
    assert event.data == DataPosition(next_batch=3, skipped=[(5, 7)])
    assert event.stall_s >= 0 and event.write_s > 0

    m, opt, _ = parts(seed=99)  # different initial weights: everything must come from the checkpoint
    counter = Counter()
    st = state(m, opt, counter)
    step, position = checkpointing.load(Path(event.staging_dir), st, distributed.init(0, 1, 0, "cpu"), event.shards)
    assert step == 3
    assert position == event.data
    assert counter.n == 42  # the extra as it was at the snapshot, not as the background write found it
    restored = flat_tensors(st)
    assert sorted(restored) == sorted(saved) and any(k.endswith("exp_avg") for k in saved)
    for key, tensor in saved.items():
        assert torch.equal(restored[key], tensor), key


def test_a_changed_byte_is_refused_with_the_file_named(
        staged: tuple[CheckpointStaged, dict[str, torch.Tensor]]) -> None:
    event, _ = staged
    path = Path(event.staging_dir)
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    m, opt, _ = parts(seed=1)
    with pytest.raises(checkpointing.CorruptCheckpoint, match=r"__0_0\.distcp has sha256 .* damaged"):
        checkpointing.load(path, state(m, opt), distributed.init(0, 1, 0, "cpu"), event.shards)


def test_missing_and_truncated_files_are_refused(staged: tuple[CheckpointStaged, dict[str, torch.Tensor]]) -> None:
    event, _ = staged
    path = Path(event.staging_dir)
    m, opt, _ = parts(seed=1)
    live = state(m, opt)
    dist = distributed.init(0, 1, 0, "cpu")
    meta = path / ".metadata"
    meta.write_bytes(meta.read_bytes()[:100])
    with pytest.raises(checkpointing.CorruptCheckpoint, match="has 100 bytes"):
        checkpointing.load(path, live, dist, event.shards)
    with pytest.raises(checkpointing.CorruptCheckpoint, match=r"no readable \.metadata"):
        checkpointing.load(path, live, dist)  # without a manifest the damage still shows, less precisely
    (path / "__0_0.distcp").unlink()
    with pytest.raises(checkpointing.CorruptCheckpoint, match=r"missing __0_0\.distcp"):
        checkpointing.load(path, live, dist, [sh for sh in event.shards if sh.path != ".metadata"])


def test_a_shard_damaged_past_its_manifest_check_is_refused_not_raised_through(
        staged: tuple[CheckpointStaged, dict[str, torch.Tensor]]) -> None:
    """Without a manifest to check first, DCP itself finds the damage, and says so in its own exception type
    (a BaseException): it comes out as CorruptCheckpoint with the cause, as every other damage does."""
    event, _ = staged
    path = Path(event.staging_dir)
    shard = path / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:64])
    m, opt, _ = parts(seed=1)
    with pytest.raises(checkpointing.CorruptCheckpoint, match=r"cannot load checkpoint .*: \w+"):
        checkpointing.load(path, state(m, opt), distributed.init(0, 1, 0, "cpu"))


def test_a_manifest_file_is_read(tmp_path: Path) -> None:
    f = tmp_path / "manifest.json"
    f.write_text('{"checkpoint_id": "x", "shards": [{"path": "a", "size": 1, "sha256": "00"}]}')
    assert [s.path for s in checkpointing.read_manifest(f)] == ["a"]
    f.write_text("{not json")
    with pytest.raises(checkpointing.CorruptCheckpoint, match="cannot read checkpoint manifest"):
        checkpointing.read_manifest(f)


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    lambda ps: torch.optim.RMSprop(ps, lr=0.01),
], ids=["sgd-momentum", "adagrad", "rmsprop"])
def test_any_optimizers_state_round_trips_by_parameter_name(tmp_path: Path, make_opt) -> None:  # type: ignore[no-untyped-def]
    dist = distributed.init(0, 1, 0, "cpu")
    m, _, s = parts(seed=1)
    opt = make_opt(m.parameters())
    train(m, opt, s, 2)
    st = TrainState(m, opt, {}, rank=0, device=torch.device("cpu"))
    saved = flat_tensors(st)
    assert any(k.startswith("optim.state.") for k in saved)
    ckpt = checkpointing.Checkpointer(job_id="j", staging=tmp_path, dist=dist, emit=lambda e: None,
                                      envelope={"job_id": "j", "rank": 0, "attempt": 0, "node": "n"})
    ckpt.save(2, st.live(), s.position())
    ckpt.wait()
    m2, _, _ = parts(seed=7)
    opt2 = make_opt(m2.parameters())
    st2 = TrainState(m2, opt2, {}, rank=0, device=torch.device("cpu"))
    step, _ = checkpointing.load(ckpt.staged_dir(2, 0), st2, dist)
    assert step == 2
    restored = flat_tensors(st2)
    assert sorted(restored) == sorted(saved)
    for key, tensor in saved.items():
        assert torch.equal(restored[key], tensor), key


def test_a_checkpoint_of_another_model_is_refused_by_name(
        staged: tuple[CheckpointStaged, dict[str, torch.Tensor]]) -> None:
    event, _ = staged
    other = torch.nn.Linear(4, 4)  # registered state that does not match what was saved
    st = TrainState(other, torch.optim.SGD(other.parameters(), lr=0.1), {}, rank=0, device=torch.device("cpu"))
    with pytest.raises(checkpointing.CorruptCheckpoint, match=r"does not fit the registered state: it lacks "
                                                              r"\['model.bias', 'model.weight'"):
        checkpointing.load(Path(event.staging_dir), st, distributed.init(0, 1, 0, "cpu"), event.shards)


def test_registering_what_cannot_be_checkpointed_is_refused_by_name() -> None:
    m = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"register\(data=\.\.\.\) needs an object with state_dict"):
        TrainState(m, None, {"data": 3}, rank=0, device=torch.device("cpu"))  # type: ignore[dict-item]
    loader = torch.utils.data.DataLoader(list(range(4)))  # README's old example: a plain loader as an extra
    with pytest.raises(TypeError, match=r"got DataLoader; a data loader goes to run.batches\(loader\) instead"):
        TrainState(m, None, {"loader": loader}, rank=0, device=torch.device("cpu"))  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"register\(optimizer=\.\.\.\) takes a torch.optim.Optimizer"):
        TrainState(m, "adam", {}, rank=0, device=torch.device("cpu"))  # type: ignore[arg-type]
