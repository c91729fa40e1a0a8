"""Each step's random numbers as a function of the rank's own seed and the step, alike on and off the platform.

A rank's RNG state lives in its process: a rank killed outright takes it along, and a restore from a survivor's
replica (its parameters and optimizer state stand in for the dead rank's) had none to give back, so dropout after
the restore drew other masks than the uninterrupted run (issue 52, finding 2). So before each step the trainer API
seeds torch's generators (CPU and every CUDA device) from the seed the script gave this rank and the step's number:
whatever restores a step, from whichever copy, draws what the uninterrupted run drew. Ranks the script seeded alike
stay alike (tensor-parallel peers that must drop the same activations); ranks it seeded apart stay apart. It costs
one `torch.manual_seed` a step (about 0.1 ms on the CPU); generators the script makes itself are its own."""

import contextlib
import hashlib
from collections.abc import Iterator

import torch

_MASK = (1 << 63) - 1


def base() -> int:
    """The seed the script last gave torch's default generator (`torch.manual_seed`), or the one it was born with."""
    return torch.initial_seed()


def step_seed(seed: int, step: int, purpose: str = "step") -> int:
    """The seed of step `step` for a rank whose script seeded `seed`: well mixed, so nearby steps share nothing.
    `purpose` keeps apart the seeds of other draws keyed by a number (a data loader's epoch, its batches)."""
    key = f"{seed}:{step}" if purpose == "step" else f"{purpose}:{seed}:{step}"
    digest = hashlib.blake2b(key.encode(), digest_size=8, person=b"flightdeck-step").digest()
    return int.from_bytes(digest, "little") & _MASK


def seed_step(seed: int, step: int) -> None:
    torch.manual_seed(step_seed(seed, step))


@contextlib.contextmanager
def apart(seed: int, number: int, purpose: str) -> Iterator[None]:
    """Run the block on the CPU generator seeded for (`purpose`, `number`), and give the script's stream back after:
    what a data loader draws (its sampler's shuffle, its workers' base seed, a dataset's augmentation) is then a
    function of the epoch or batch it reads, whenever it reads it (from the start, or after a restore), and never
    shifts the step's own draws."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(step_seed(seed, number, purpose))
        yield
