"""The token stream: deterministic, the same global batch at any world size; the batch cursor: skip windows, seek."""

import torch

from flightdeck.events.checkpoint import DataPosition
from flightdeck.trainer.cursor import BatchCursor
from flightdeck.trainer.data import CORPUS, TokenStream, load_tokens


def stream(tokens: torch.Tensor, rank: int, world: int, batch: int = 6) -> TokenStream:
    return TokenStream(tokens, seq_len=16, batch_size=batch, seed=7, rank=rank, world_size=world, vocab_size=256)


def test_the_corpus_is_real_text_under_two_megabytes() -> None:
    raw = CORPUS.read_bytes()
    assert 500_000 < len(raw) < 2_000_000
    assert raw.lstrip().startswith(b"Genesis 1") and b"In the beginning God created the heaven and the earth." in raw
    tokens = load_tokens("corpus", 256)
    assert tokens.dtype == torch.long and int(tokens.max()) < 128  # ASCII text, byte-level ids


def test_a_global_batch_is_the_same_at_every_world_size() -> None:
    tokens = load_tokens("corpus", 256)
    for index in (0, 1, 57):
        x1, y1 = stream(tokens, 0, 1).batch(index)
        for world in (2, 3, 4):
            parts = [stream(tokens, r, world).batch(index) for r in range(world)]
            assert torch.equal(torch.cat([x for x, _ in parts]), x1)
            assert torch.equal(torch.cat([y for _, y in parts]), y1)
    x, y = stream(tokens, 0, 1).batch(3)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert not torch.equal(stream(tokens, 0, 1).batch(3)[0], stream(tokens, 0, 1).batch(4)[0])


def test_uneven_slices_cover_the_batch() -> None:
    tokens = load_tokens("synthetic", 64)
    sizes = [stream(tokens, r, 4, batch=6).local_batch for r in range(4)]
    assert sizes == [2, 2, 1, 1]


def test_skip_windows_and_seek() -> None:
    s = BatchCursor()
    assert [s.next_index() for _ in range(3)] == [0, 1, 2]
    s.skip(4, 6)
    s.skip(6, 8)  # windows that touch chain
    assert [s.next_index() for _ in range(3)] == [3, 8, 9]
    pos = s.position()
    assert pos == DataPosition(next_batch=10, skipped=[(4, 6), (6, 8)])
    t = BatchCursor()
    t.seek(DataPosition(next_batch=5, skipped=[(4, 6), (6, 8)]))
    assert t.next_index() == 8


