"""What it costs to commit a checkpoint with no shared disk (services/agent/shipping.py, then
services/checkpoints/uploader.py): the node agent uploads its ranks' staged shards, hashing what it sends, and the
checkpoint service reads every shard back from the store and checks it before it writes the manifest. The
baseline, measured in the same run on the same files, is a plain copy of the bytes into the store's folder
(shutil.copyfile, no hashing): the least any path that puts the bytes there pays.

    python bench/shard_shipping.py [--mb 256] [--ranks 4] [--rounds 3]

Local store (a folder); the figures are medians over rounds, each round on freshly written files.
"""

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flightdeck.events.checkpoint import CheckpointStaged, DataPosition, ShardInfo, ShardsUploaded, checkpoint_id
from flightdeck.services.agent.shipping import store_rank
from flightdeck.services.checkpoints import core
from flightdeck.services.checkpoints.state import CommitArgs, Settings
from flightdeck.services.checkpoints.uploader import commit
from flightdeck.services.shell.objects.local import LocalStore
from flightdeck.services.shell.objects.store import hash_file

JOB = "bench-000001"


def stage(root: Path, step: int, ranks: int, mb: int) -> list[CheckpointStaged]:
    folder = root / JOB / f"step-{step}"
    folder.mkdir(parents=True)
    out = []
    for rank in range(ranks):
        f = folder / f"__{rank}_0.distcp"
        f.write_bytes(os.urandom(mb * 1_000_000 // ranks))
        size, digest = hash_file(f)
        out.append(CheckpointStaged(job_id=JOB, rank=rank, attempt=0, node="n0", step=step, world_size=ranks,
                                    staging_dir=str(folder), shards=[ShardInfo(path=f.name, size=size, sha256=digest)],
                                    data=DataPosition(next_batch=step), stall_s=0.0, write_s=0.0, occurred_at=1.0))
    return out


def commit_args(stagings: list[CheckpointStaged]) -> CommitArgs:
    state = core.State(settings=Settings(shards_from="agents"))
    asked = None
    for ev in stagings:
        for e in (ev, ShardsUploaded(job_id=JOB, rank=ev.rank, attempt=0, node="n0", step=ev.step,
                                     world_size=ev.world_size, ranks=[ev.rank], bytes=0, seconds=0.0)):
            state, outs = core.transition(state, e)
            asked = next((o.args for o in outs if isinstance(o, core.Effect) and o.kind == core.COMMIT), asked)
    assert isinstance(asked, CommitArgs)
    return asked


async def one_round(root: Path, step: int, ranks: int, mb: int) -> dict[str, float]:
    stagings = stage(root / "staging", step, ranks, mb)
    copy_dir = root / "copy" / str(step)
    copy_dir.mkdir(parents=True)
    started = time.perf_counter()
    for ev in stagings:
        for s in ev.shards:
            await asyncio.to_thread(shutil.copyfile, Path(ev.staging_dir) / s.path, copy_dir / s.path)
    copy_s = time.perf_counter() - started
    store = LocalStore(root / "objects")
    started = time.perf_counter()
    await asyncio.gather(*(store_rank(store, ev, [root / "staging"]) for ev in stagings))
    upload_s = time.perf_counter() - started
    started = time.perf_counter()
    [out] = await commit(store, commit_args(stagings))
    verify_s = time.perf_counter() - started
    assert out.event.checkpoint_id == checkpoint_id(0, step), out.event  # type: ignore[union-attr]
    return {"copy_s": copy_s, "upload_s": upload_s, "verify_s": verify_s}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256, help="checkpoint size in MB (default 256)")
    parser.add_argument("--ranks", type=int, default=4, help="ranks on the node, one shard each (default 4)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            rows.append(await one_round(Path(tmp), 10 * (r + 1), args.ranks, args.mb))
    med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    print(json.dumps({
        "mb": args.mb, "ranks": args.ranks, "rounds": args.rounds,
        "copy_s": round(med["copy_s"], 3), "agent_upload_s": round(med["upload_s"], 3),
        "service_verify_s": round(med["verify_s"], 3),
        "upload_vs_copy": round(med["upload_s"] / med["copy_s"], 2),
        "staged_to_committed_vs_copy": round((med["upload_s"] + med["verify_s"]) / med["copy_s"], 2),
    }, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
