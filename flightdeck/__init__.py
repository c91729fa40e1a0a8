"""`import flightdeck`: the trainer API a training script uses (implemented in trainer/api.py, documented there
and in README's "Bring your own training code")."""

from trainer.api import CorruptCheckpoint, Run, Stateful, Step, init

__all__ = ["CorruptCheckpoint", "Run", "Stateful", "Step", "init"]
