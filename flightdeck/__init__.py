"""`import flightdeck`: the trainer API a training script uses (implemented in trainer/api.py, documented there
and in docs/user-code.md); `flightdeck.client` is the platform's Python client for
automation (services/tools/client.py). The trainer API loads on first use, so a client never imports torch."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flightdeck.trainer.api import CorruptCheckpoint, Run, Stateful, Step, init

__all__ = ["CorruptCheckpoint", "Run", "Stateful", "Step", "init"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from flightdeck.trainer import api

        return getattr(api, name)
    raise AttributeError(f"module 'flightdeck' has no attribute {name!r}")
