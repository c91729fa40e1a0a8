"""A deterministic, seekable token stream over a byte-level corpus (or a synthetic one for tests).

Global batch `b` is a pure function of (tokens, seed, b): `batch_size` windows at offsets drawn from a
generator seeded with (seed, b). Each rank takes its contiguous slice of that global batch, so the same
batch index means the same data at any world size and a resharded job continues the same stream.

The corpus, trainer/data/kjv-genesis-ruth.txt, is Genesis through Ruth of the King James Version
(1611, public domain), as printed by Debian's bible-kjv package (80 columns, chapter headings).
"""

from pathlib import Path

import torch

CORPUS = Path(__file__).resolve().parent / "data" / "kjv-genesis-ruth.txt"
SYNTHETIC_TOKENS = 1 << 17
SYNTHETIC_BRANCHING = 4  # successors per token: the synthetic stream's loss floor is ln(4) nats


def load_tokens(kind: str, vocab_size: int) -> torch.Tensor:
    """The whole token sequence as int64: corpus bytes, or a seeded Markov chain for tests."""
    if kind == "corpus":
        if vocab_size < 256:
            raise ValueError(f"model.vocab_size ({vocab_size}) must be at least 256 for the byte-level corpus; "
                             "use train.data = \"synthetic\" for a smaller vocabulary")
        return torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8).long()
    if kind == "synthetic":
        g = torch.Generator().manual_seed(0x5EED)
        successors = torch.randint(0, vocab_size, (vocab_size, SYNTHETIC_BRANCHING), generator=g)
        choice = torch.randint(0, SYNTHETIC_BRANCHING, (SYNTHETIC_TOKENS,), generator=g).tolist()
        table = successors.tolist()
        out = [0] * SYNTHETIC_TOKENS
        for i in range(1, SYNTHETIC_TOKENS):
            out[i] = table[out[i - 1]][choice[i]]
        return torch.tensor(out, dtype=torch.long)
    raise ValueError(f"unknown train.data {kind!r}: use \"corpus\" or \"synthetic\"")


def _batch_seed(seed: int, index: int) -> int:
    # A bijective mix of (seed, index) into 63 bits, so neighbouring batches draw unrelated offsets.
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


class TokenStream:
    """One rank's slice of any global batch, by index (which index a step reads: trainer/cursor.py)."""

    def __init__(self, tokens: torch.Tensor, *, seq_len: int, batch_size: int, seed: int, rank: int,
                 world_size: int, vocab_size: int) -> None:
        if tokens.numel() < seq_len + 2:
            raise ValueError(f"the token stream has {tokens.numel()} tokens, fewer than seq_len + 2 ({seq_len + 2})")
        if batch_size < world_size:
            raise ValueError(f"batch_size ({batch_size}) must be at least the world size ({world_size})")
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.vocab_size = vocab_size
        rows = torch.tensor_split(torch.arange(batch_size), world_size)[rank]
        self.rows = slice(int(rows[0]), int(rows[-1]) + 1)

    @property
    def local_batch(self) -> int:
        return self.rows.stop - self.rows.start

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (local batch, seq_len), for global batch `index`."""
        g = torch.Generator().manual_seed(_batch_seed(self.seed, index))
        offsets = torch.randint(0, self.tokens.numel() - self.seq_len, (self.batch_size,), generator=g)
        window = self.tokens[offsets[self.rows, None] + torch.arange(self.seq_len + 1)]
        return window[:, :-1], window[:, 1:]
