"""Which global batch each step reads: a counter that steps over skipped windows, and the position a
checkpoint records. A rollback's skip window lands here, so it works for any data pipeline that reads
batch `step.batch` (trainer API) as a function of that index."""

from flightdeck.events.checkpoint import DataPosition, batch_at


class BatchCursor:
    def __init__(self) -> None:
        self.next_batch = 0
        self.skipped: list[tuple[int, int]] = []

    def next_index(self) -> int:
        """The batch index the next step reads, after skips; advances the cursor."""
        index = batch_at(self.next_batch, self.skipped)
        self.next_batch = index + 1
        return index

    def skip(self, start: int, end: int) -> None:
        if end > start and (start, end) not in self.skipped:  # a window decided twice is skipped once
            self.skipped.append((start, end))

    def position(self) -> DataPosition:
        return DataPosition(next_batch=self.next_batch, skipped=list(self.skipped))

    def seek(self, position: DataPosition) -> None:
        self.next_batch = position.next_batch
        self.skipped = [(int(a), int(b)) for a, b in position.skipped]


class Step(int):
    """A step number (use it as an int) that also says which global batch this step reads: `step.batch`.
    After a rollback that skipped a window, batch and step differ: read by `step.batch`."""

    batch: int

    def __new__(cls, step: int, batch: int) -> "Step":
        obj = super().__new__(cls, step)
        obj.batch = batch
        return obj
