"""Whether a restore leaves the run bitwise the uninterrupted one, and if not, why: what a rank says in its
RankStarted (`exactness`), and the health service records for the job (InexactRestore) for status and the
postmortem. Never silent: a run that parts from what the script alone would compute says so where users look.

Every other path restores exactly (tests/e2e/test_healed_exact.py): the state is the saved one, each step's random
numbers are a function of the script's seed and the step (trainer/seeding.py), and the data position is the run's.
What is left: another layout (its gradients' sums run in another order: within 1e-6 of the loss over 15 steps for
the TP x PP example, docs/user-code.md), and extras a rank could only take from another rank's copy."""

from collections.abc import Mapping, Sequence
from typing import Any


def why_inexact(meta: Mapping[str, Any], world_size: int, layout: Sequence[int], borrowed: Mapping[str, int]) -> str:
    """"" when the restore is exact; else the reasons, in words. `meta`: the checkpoint's own record
    (checkpointing.meta_item); `layout`: this run's DP x TP x PP; `borrowed`: extras from another rank's copy."""
    reasons = []
    saved_world, saved_layout = int(meta.get("world_size", world_size)), list(meta.get("layout", []))
    if saved_world != world_size:
        reasons.append(f"saved by {saved_world} ranks, restored into {world_size}: the gradients' sums run in another "
                       "order")
    elif saved_layout and list(layout) and saved_layout != list(layout):
        dims = " x ".join(str(n) for n in saved_layout), " x ".join(str(n) for n in layout)
        reasons.append(f"saved as DP x TP x PP {dims[0]}, restored as {dims[1]}: the sums run in another order")
    if borrowed:
        names = ", ".join(f"{name} (rank {rank}'s)" for name, rank in sorted(borrowed.items()))
        reasons.append(f"the checkpoint holds no copy of this rank's own extras; restored from another rank's: {names}")
    return "; ".join(reasons)
