"""Each step's random numbers as a function of the rank's own seed and the step, alike on and off the platform.

A rank's RNG state lives in its process: a rank killed outright takes it along, and a restore from a survivor's
replica (its parameters and optimizer state stand in for the dead rank's) had none to give back, so dropout after
the restore drew other masks than the uninterrupted run (issue 52, finding 2). So before each step the trainer API
seeds torch's generators (CPU and every CUDA device) from the seed the script gave this rank and the step's number:
whatever restores a step, from whichever copy, draws what the uninterrupted run drew. Ranks the script seeded alike
stay alike (tensor-parallel peers that must drop the same activations); ranks it seeded apart stay apart. It costs
one `torch.manual_seed` a step (about 0.1 ms on the CPU); generators the script makes itself are its own."""

import hashlib

import torch

_MASK = (1 << 63) - 1


def base() -> int:
    """The seed the script last gave torch's default generator (`torch.manual_seed`), or the one it was born with."""
    return torch.initial_seed()


def step_seed(seed: int, step: int) -> int:
    """The seed of step `step` for a rank whose script seeded `seed`: well mixed, so nearby steps share nothing."""
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8, person=b"flightdeck-step").digest()
    return int.from_bytes(digest, "little") & _MASK


def seed_step(seed: int, step: int) -> None:
    torch.manual_seed(step_seed(seed, step))
