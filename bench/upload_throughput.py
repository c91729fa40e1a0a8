"""Checkpoint upload throughput: our S3Store.put_file (multipart, bounded concurrency, sha256 of every
byte, retries) against a plain hand-written aioboto3 multipart upload of the same file, with the same
part size and concurrency, to the same moto server (a separate process, so it does not share our GIL).

    python bench/upload_throughput.py                      # 256 MB, 8 MiB parts, 8 in flight, 5 rounds
    python bench/upload_throughput.py --mb 1024 --rounds 5

Goal: ours >= 0.9x raw (median of the per-round ratios; the order alternates each round). moto is
the bottleneck here, so on a busy machine the ratio is noisy; the client CPU seconds per upload are
also printed (ours adds a sha256 of every byte, ~0.17 s per 256 MB at 1.5 GB/s).
"""

import argparse
import asyncio
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aioboto3
import structlog
from aiobotocore.config import AioConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flightdeck.services.shell.objects.s3 import S3Store

MiB = 1 << 20
BUCKET = "fd-bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_moto() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise SystemExit("moto server did not start") from None
            time.sleep(0.1)


def make_file(path: Path, mb: int) -> None:
    with open(path, "wb") as f:
        for _ in range(mb):
            f.write(os.urandom(MiB))


async def raw_multipart(c: Any, path: Path, size: int, key: str, part_size: int, concurrency: int) -> None:
    """The baseline: what a careful hand-written aioboto3 multipart upload looks like (no hashing)."""
    upload_id = (await c.create_multipart_upload(Bucket=BUCKET, Key=key))["UploadId"]
    slots = asyncio.Semaphore(concurrency)
    fd = os.open(path, os.O_RDONLY)

    async def part(number: int, offset: int) -> dict[str, object]:
        async with slots:
            data = await asyncio.to_thread(os.pread, fd, min(part_size, size - offset), offset)
            resp = await c.upload_part(Bucket=BUCKET, Key=key, UploadId=upload_id, PartNumber=number, Body=data)
            return {"ETag": resp["ETag"], "PartNumber": number}

    try:
        parts = await asyncio.gather(*(part(n, off) for n, off in enumerate(range(0, size, part_size), start=1)))
    finally:
        os.close(fd)
    await c.complete_multipart_upload(Bucket=BUCKET, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts})


async def run(args: argparse.Namespace, endpoint: str, path: Path,
              size: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall seconds and client CPU seconds of each upload, per variant."""
    part_size = args.part_mb * MiB
    times: dict[str, list[float]] = {"ours": [], "raw": []}
    cpu: dict[str, list[float]] = {"ours": [], "raw": []}
    config = AioConfig(max_pool_connections=max(10, 2 * args.concurrency))
    async with aioboto3.Session().client("s3", endpoint_url=endpoint, config=config) as raw_client, \
            S3Store.open(BUCKET, endpoint_url=endpoint, part_size=part_size, max_concurrency=args.concurrency) as ours:
        await raw_client.create_bucket(Bucket=BUCKET)
        for r in range(args.rounds):
            order = ["ours", "raw"] if r % 2 == 0 else ["raw", "ours"]
            for name in order:
                key = f"bench/{name}-{r}"
                started, cpu_started = time.perf_counter(), time.process_time()
                if name == "ours":
                    got = await ours.put_file(key, path)
                    assert got[0] == size
                else:
                    await raw_multipart(raw_client, path, size, key, part_size, args.concurrency)
                times[name].append(time.perf_counter() - started)
                cpu[name].append(time.process_time() - cpu_started)
                head = await raw_client.head_object(Bucket=BUCKET, Key=key)
                assert head["ContentLength"] == size
                await raw_client.delete_object(Bucket=BUCKET, Key=key)  # moto keeps objects in memory
                print(f"round {r} {name:4s} {size / MiB / times[name][-1]:7.1f} MB/s  "
                      f"client cpu {cpu[name][-1]:.2f} s", flush=True)
    return times, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--part-mb", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    proc, endpoint = start_moto()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "shard.bin"
            make_file(path, args.mb)
            times, cpu = asyncio.run(run(args, endpoint, path, args.mb * MiB))
    finally:
        proc.terminate()
        proc.wait(10)
    mbs = {k: args.mb / statistics.median(v) for k, v in times.items()}
    # a round's two uploads run back to back, so their ratio is least disturbed by other load on the box
    paired = statistics.median(raw / ours for ours, raw in zip(times["ours"], times["raw"], strict=True))
    print(json.dumps({"mb": args.mb, "part_mb": args.part_mb, "concurrency": args.concurrency, "rounds": args.rounds,
                      "ours_mb_s": round(mbs["ours"], 1), "raw_mb_s": round(mbs["raw"], 1),
                      "ratio_of_medians": round(mbs["ours"] / mbs["raw"], 3),
                      "ratio_paired_median": round(paired, 3), "goal": ">= 0.9", "met": paired >= 0.9,
                      # the client's own cost, which load from other processes on the box does not change
                      "client_cpu_s_ours": round(statistics.median(cpu["ours"]), 3),
                      "client_cpu_s_raw": round(statistics.median(cpu["raw"]), 3)}))


if __name__ == "__main__":
    main()
