"""Two-phase checkpoints in one process: staged shards with hashes, exact restore, corrupt files refused."""

from pathlib import Path

import pytest
import torch

from events.base import RankEvent
from events.checkpoint import CheckpointStaged, DataPosition
from events.spec import ModelSpec
from trainer import checkpointing, distributed, model
from trainer.data import TokenStream, load_tokens

SPEC = ModelSpec(n_layer=1, n_head=2, d_model=16, seq_len=16, vocab_size=64)


def parts(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, TokenStream]:
    m = model.build(SPEC, seed, torch.device("cpu"))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    s = TokenStream(load_tokens("synthetic", 64), seq_len=16, batch_size=2, seed=0, rank=0, world_size=1,
                    vocab_size=64)
    return m, opt, s


def train(m: torch.nn.Module, opt: torch.optim.Optimizer, s: TokenStream, steps: int) -> None:
    for _ in range(steps):
        x, y = s.batch(s.next_index())
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
    live = checkpointing.train_state(m, opt)
    ckpt.save(3, live, s)
    first_buffers = {k: t.data_ptr() for k, t in ckpt.buffers.items()}
    train(m, opt, s, 1)  # the write goes on in the background while training continues
    ckpt.wait()
    assert {k: t.data_ptr() for k, t in ckpt.buffers.items()} == first_buffers
    (event,) = out
    assert isinstance(event, CheckpointStaged)
    return event, {k: v.clone() for k, v in ckpt.buffers.items()}


def test_a_staged_checkpoint_lists_hashed_shards_and_restores_exactly(
        staged: tuple[CheckpointStaged, dict[str, torch.Tensor]]) -> None:
    event, saved = staged
    assert (event.step, event.world_size, event.attempt) == (3, 1, 2)
    assert event.staging_dir.endswith("/j/step-3")
    assert sorted(s.path for s in event.shards) == [".metadata", "__0_0.distcp"]
    assert all(len(s.sha256) == 64 and s.size > 0 for s in event.shards)
    assert event.data == DataPosition(next_batch=3, skipped=[(5, 7)])
    assert event.stall_s >= 0 and event.write_s > 0

    m, opt, s = parts(seed=99)  # different initial weights: everything must come from the checkpoint
    live = checkpointing.train_state(m, opt)
    step = checkpointing.load(Path(event.staging_dir), live, s, distributed.init(0, 1, 0, "cpu"), event.shards)
    assert step == 3
    assert s.position() == event.data
    for key, tensor in saved.items():
        assert torch.equal(live[key], tensor), key


def test_a_changed_byte_is_refused_with_the_file_named(
        staged: tuple[CheckpointStaged, dict[str, torch.Tensor]]) -> None:
    event, _ = staged
    path = Path(event.staging_dir)
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    m, opt, s = parts(seed=1)
    with pytest.raises(checkpointing.CorruptCheckpoint, match=r"__0_0\.distcp has sha256 .* damaged"):
        checkpointing.load(path, checkpointing.train_state(m, opt), s, distributed.init(0, 1, 0, "cpu"),
                           event.shards)


def test_missing_and_truncated_files_are_refused(staged: tuple[CheckpointStaged, dict[str, torch.Tensor]]) -> None:
    event, _ = staged
    path = Path(event.staging_dir)
    m, opt, s = parts(seed=1)
    live = checkpointing.train_state(m, opt)
    dist = distributed.init(0, 1, 0, "cpu")
    meta = path / ".metadata"
    meta.write_bytes(meta.read_bytes()[:100])
    with pytest.raises(checkpointing.CorruptCheckpoint, match="has 100 bytes"):
        checkpointing.load(path, live, s, dist, event.shards)
    with pytest.raises(checkpointing.CorruptCheckpoint, match=r"no readable \.metadata"):
        checkpointing.load(path, live, s, dist)  # without a manifest the damage still shows, less precisely
    (path / "__0_0.distcp").unlink()
    with pytest.raises(checkpointing.CorruptCheckpoint, match=r"missing __0_0\.distcp"):
        checkpointing.load(path, live, s, dist, [sh for sh in event.shards if sh.path != ".metadata"])


def test_a_manifest_file_is_read(tmp_path: Path) -> None:
    f = tmp_path / "manifest.json"
    f.write_text('{"checkpoint_id": "x", "shards": [{"path": "a", "size": 1, "sha256": "00"}]}')
    assert [s.path for s in checkpointing.read_manifest(f)] == ["a"]
    f.write_text("{not json")
    with pytest.raises(checkpointing.CorruptCheckpoint, match="cannot read checkpoint manifest"):
        checkpointing.read_manifest(f)
