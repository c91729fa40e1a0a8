"""How fast the checkpoint service's scrubber reads a checkpoint back (services/checkpoints/scrubber.py), unbounded
and at each `FLIGHTDECK_SCRUB_MB_S` bound, against a local store holding one synthetic checkpoint of 4 shards.
The unbounded read is the baseline measured in the same run; each bounded run should land at its bound (ratio
achieved / bound <= 1.0), never above it.

    python bench/scrub_rate.py [--mb 256] [--bounds 16,64]
"""

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flightdeck.events.checkpoint import DataPosition, ShardInfo
from flightdeck.services.checkpoints.scrubber import scrub
from flightdeck.services.checkpoints.state import ScrubArgs
from flightdeck.services.shell.objects import manifest as mf
from flightdeck.services.shell.objects.open import open_store
from flightdeck.services.shell.objects.store import hash_file

JOB, CID = "bench-000001", "step000000100-a0"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256, help="checkpoint size in MB (default 256)")
    parser.add_argument("--bounds", default="16,64", help="MB/s bounds to run at, comma-separated")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shards = []
        for i in range(4):
            f = root / "src" / f"__{i}_0.distcp"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(os.urandom(args.mb * 1_000_000 // 4))
            size, digest = hash_file(f)
            shards.append((f, ShardInfo(path=f.name, size=size, sha256=digest)))
        async with open_store(str(root / "objects")) as store:
            for f, info in shards:
                await store.put_file(mf.shard_key(JOB, CID, info.path), f)
            raw = mf.encode(mf.Manifest(job_id=JOB, checkpoint_id=CID, step=100, world_size=4, attempt=0,
                                        created_at=time.time(), shards=[s for _, s in shards],
                                        data=DataPosition(next_batch=100)))
            await store.put_bytes(mf.manifest_key(JOB, CID), raw)
            rows = []
            for bound in [0.0, *(float(b) for b in args.bounds.split(","))]:
                out = await scrub(store, ScrubArgs(job_id=JOB, checkpoint_id=CID, step=100,
                                                   manifest_sha256=mf.sha256(raw), bytes_per_s=bound * 1e6))
                ev = out[0].event
                assert not ev.cause, ev.cause
                rate = ev.bytes / ev.seconds / 1e6
                rows.append({"bound_mb_s": bound or None, "mb": round(ev.bytes / 1e6, 1),
                             "seconds": round(ev.seconds, 2), "mb_s": round(rate, 1),
                             "of_bound": round(rate / bound, 3) if bound else None})
    base = rows[0]["mb_s"]
    for r in rows:
        r["of_unbounded"] = round(r["mb_s"] / base, 3)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
