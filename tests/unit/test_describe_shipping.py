"""How a timeline (postmortem, history) says what a node agent did with its ranks' staged shards."""

from flightdeck.events.checkpoint import ShardsUploaded
from flightdeck.services.tools.postmortem.describe import describe


def report(ranks: list[int], failed: str = "") -> ShardsUploaded:
    return ShardsUploaded(job_id="j", rank=min(ranks), attempt=0, node="n2", step=30, world_size=16, ranks=ranks,
                          bytes=4096, seconds=0.25, failed=failed)


def test_a_nodes_report_names_its_ranks_as_runs() -> None:
    assert describe(report([8, 9, 10, 11, 15])) == \
        "n2 stored step 30 of ranks 8-11, 15 in the object store: 4096 bytes in 0.25 s"


def test_a_failed_report_says_why() -> None:
    assert describe(report([3], failed="shard '__3_0.distcp' of rank 3 is corrupt")) == \
        "n2 could not store step 30 of ranks 3: shard '__3_0.distcp' of rank 3 is corrupt"
