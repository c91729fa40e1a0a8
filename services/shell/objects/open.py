"""Open an object store from a URL: a local folder (the embedded default) or an S3 bucket.

    .flightdeck/objects          a local folder (also file:///abs/path)
    s3://bucket                  an S3 bucket; s3://bucket/some/root for a root prefix inside it

For S3 the endpoint comes from `endpoint_url`, else botocore's own `AWS_ENDPOINT_URL_S3` /
`AWS_ENDPOINT_URL`; credentials only from the standard AWS chain.
"""

import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import unquote, urlparse

from flightdeck.services.shell.objects.local import DEFAULT_ROOT, LocalStore
from flightdeck.services.shell.objects.s3 import DEFAULT_PART_SIZE, S3Store
from flightdeck.services.shell.objects.store import ObjectStore

OBJECTS_ENV = "FLIGHTDECK_OBJECTS"  # where committed checkpoints live (a folder, file:// or s3:// URL)
DATA_DIR_ENV = "FLIGHTDECK_DATA_DIR"  # a platform's data dir; its objects/ is the default store


def objects_url(env: Mapping[str, str] | None = None) -> str:
    """Where the platform's object store is: $FLIGHTDECK_OBJECTS, else the data dir's objects/ folder."""
    env = os.environ if env is None else env
    return env.get(OBJECTS_ENV) or str(Path(env.get(DATA_DIR_ENV) or ".flightdeck") / "objects")


@asynccontextmanager
async def open_store(url: str = str(DEFAULT_ROOT), *, endpoint_url: str | None = None,
                     part_size: int = DEFAULT_PART_SIZE, max_concurrency: int = 8) -> AsyncIterator[ObjectStore]:
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"{url!r} names no bucket: write s3://BUCKET or s3://BUCKET/ROOT")
        root = parsed.path.strip("/")
        async with S3Store.open(parsed.netloc, root=f"{root}/" if root else "", endpoint_url=endpoint_url,
                                part_size=part_size, max_concurrency=max_concurrency) as s3:
            yield s3
    elif parsed.scheme == "file":
        yield LocalStore(Path(unquote(parsed.path)))
    elif parsed.scheme == "":
        yield LocalStore(Path(url))
    else:
        raise ValueError(f"unsupported object store {url!r}: use a folder, file:///path or s3://bucket[/root]")
