"""A script's own data loader under Flightdeck (`for step, batch in run.batches(loader)`): the loader's batches
follow the run's global batch index, so a restore, a resume and a rollback's skip window land on the right data.

The loader is read in order and its position kept beside the run's: a batch index the run skips (a rollback's
window) is read and dropped, and a loader that runs out starts its next epoch. Each epoch's order is made a function
of the epoch, as an uninterrupted run would see it: a sampler with `set_epoch` (DistributedSampler) is told it, and
a loader shuffled by its own `generator` has it seeded with its initial seed plus the epoch (a resumed loader would
otherwise shuffle the epochs after its restore differently). A loader with `state_dict()` and `load_state_dict()`
(torchdata's StatefulDataLoader) is checkpointed with the run and restored to where it was; any other is read again
from its start up to the restore point (so its order must be seeded too).
"""

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import structlog
import torch

from flightdeck.trainer import seeding
from flightdeck.trainer.cursor import Step
from flightdeck.trainer.state import Stateful
from flightdeck.trainer.usage import refused

if TYPE_CHECKING:
    from flightdeck.trainer.session import Run

log = structlog.get_logger("trainer")

T = TypeVar("T")
EXTRA = "flightdeck_loader"  # the name the loader's position is checkpointed under, beside the script's extras


class Feed:
    """The loader and how many of its batches the run has read (across epochs): a checkpointed extra."""

    def __init__(self, loader: Iterable[Any], seed: int) -> None:
        self.loader, self.seed = loader, seed  # the script's seed of this rank (trainer/seeding.py)
        self.stateful = isinstance(loader, Stateful)
        self.at = 0  # batches read from the loader since the run's first: the next one is global batch `at`
        self.epoch = 0  # iterations of the loader begun before the current one
        generator = getattr(loader, "generator", None)
        self._seed = generator.initial_seed() if isinstance(generator, torch.Generator) else None
        self._it: Iterator[Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        # Not the loader's own before its first batch: asked then, torchdata's StatefulDataLoader makes its iterator
        # (drawing its seed from the script's RNG) at the snapshot instead of at the first step, and the dropout of a
        # job on the platform parted from the script alone. Nothing is read yet: a restore starts it afresh.
        begun = self._it is not None or self.at > 0
        return {"at": self.at, "epoch": self.epoch,
                "loader": self.loader.state_dict() if self.stateful and begun else None}  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.at, self.epoch = int(state["at"]), int(state["epoch"])
        if self.stateful and state.get("loader") is not None:
            self.loader.load_state_dict(state["loader"])  # type: ignore[attr-defined]
        self._it = None

    def take(self, index: int) -> Any:
        """Global batch `index`: the batches before it that the run skips are read and dropped."""
        if self._it is None:
            if self.stateful:
                self._begin(restored=True)
            else:  # no state to restore: read it again from its start up to where the run was
                target, self.at, self.epoch = self.at, 0, 0
                self._begin()
                if target:
                    log.info("replaying the loader to the restore point", batches=target)
                while self.at < target:  # each batch read as it was first read (_next)
                    self._next()
                    self.at += 1
        if index < self.at:
            raise RuntimeError(f"the run asks for global batch {index}, but the loader is at {self.at}: "
                               "it cannot go back")
        while self.at < index:  # a rollback's skip window
            self._next()
            self.at += 1
        batch = self._next()
        self.at += 1
        return batch

    def _begin(self, restored: bool = False) -> None:
        """A new iteration of the loader, for epoch `self.epoch` (a restored stateful loader: the epoch it was
        in, which its own state resumes; its generator then holds that epoch's start already)."""
        set_epoch = getattr(getattr(self.loader, "sampler", None), "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)
        elif self._seed is not None and not restored:
            self.loader.generator.manual_seed(self._seed + self.epoch)  # type: ignore[attr-defined]
        with seeding.apart(self.seed, self.epoch, "epoch"):  # its workers' base seed, drawn here
            self._it = iter(self.loader)

    def _next(self) -> Any:
        """The loader's next batch (global batch `at`), read on an RNG of its own: a restore that reads it again,
        or first, draws what the uninterrupted run drew (a sampler's shuffle, which runs at an epoch's first batch,
        an augmentation), and the step's dropout never sees the loader's draws."""
        assert self._it is not None
        with seeding.apart(self.seed, self.at, "batch"):
            try:
                return next(self._it)
            except StopIteration:  # the next epoch
                self.epoch += 1
                self._begin()
                try:
                    return next(self._it)
                except StopIteration:
                    raise RuntimeError("the loader yields no batches") from None


def batches(run: "Run", loader: Iterable[T], total: int | None = None) -> Iterator[tuple[Step, T]]:
    """`run.steps(total)`, each step with the loader's batch for its global batch index."""
    if run.restored:
        raise refused(RuntimeError("batches(loader) comes before restore(): the loader's position is restored "
                                   "with the run"))
    feed = Feed(loader, run.seed)
    run.state.extras[EXTRA] = feed
    for step in run.steps(total):
        yield step, feed.take(step.batch)
