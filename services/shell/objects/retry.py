"""Retries for object-store calls: exponential backoff with full jitter on throttling, 5xx and
dropped connections. botocore's own retries are switched off in S3Store so this is the only layer
and its counts are the real ones."""

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import aiohttp
import botocore.exceptions
import structlog

T = TypeVar("T")
log = structlog.get_logger(__name__)

THROTTLING_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "RequestThrottledException", "TooManyRequests", "TooManyRequestsException",
    "ProvisionedThroughputExceededException", "RequestLimitExceeded", "BandwidthLimitExceeded",
})
TRANSIENT_CODES = frozenset({
    "RequestTimeout", "RequestTimeoutException", "InternalError", "ServiceUnavailable", "PriorRequestNotComplete",
    "ConditionalRequestConflict",  # 409: a concurrent conditional write on the same key is still in progress
})
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    botocore.exceptions.ConnectionError,  # endpoint unreachable, connect timeout
    botocore.exceptions.HTTPClientError,  # connection closed, read timeout, broken stream
    botocore.exceptions.IncompleteReadError,
    aiohttp.ClientConnectionError,
    asyncio.TimeoutError,
    ConnectionError,
)


def error_code(exc: BaseException) -> tuple[str, int]:
    """(S3 error code, HTTP status) of a botocore ClientError; ("", 0) for anything else."""
    if isinstance(exc, botocore.exceptions.ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return code, status
    return "", 0


class RetriesExhausted(Exception):
    """A retryable failure that outlasted the policy's deadline."""


def describe(exc: BaseException) -> str:
    """An error as a person reads it: the S3 code and status, else the exception (timeouts have no text)."""
    code, status = error_code(exc)
    if code or status:
        return f"{code or 'HTTP'} ({status})"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def is_retryable(exc: BaseException) -> bool:
    code, status = error_code(exc)
    if code or status:
        return code in THROTTLING_CODES or code in TRANSIENT_CODES or status == 429 or status >= 500
    return isinstance(exc, CONNECTION_ERRORS)


@dataclass
class RetryPolicy:
    """Up to `attempts` tries; before try n+1 sleep uniform(0, min(cap_s, base_s * 2**n)) ("full jitter").
    No retry starts after `deadline_s` from the first try: a call never holds its caller (the checkpoint
    service has one input in flight) much past that, however the endpoint fails."""

    attempts: int = 8
    base_s: float = 0.1
    cap_s: float = 10.0
    deadline_s: float = 300.0
    rng: random.Random = field(default_factory=random.Random)
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    clock: Callable[[], float] = time.monotonic

    def delay(self, retry: int) -> float:
        return self.rng.uniform(0.0, min(self.cap_s, self.base_s * (2**retry)))

    async def call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        """Run `fn` until it succeeds, fails with a non-retryable error, or runs out of attempts."""
        assert self.attempts >= 1
        began = self.clock()
        for retry in range(self.attempts):
            try:
                return await fn()
            except Exception as exc:
                if not is_retryable(exc) or retry == self.attempts - 1:
                    raise
                pause = self.delay(retry)
                if self.clock() + pause - began > self.deadline_s:
                    raise RetriesExhausted(f"{what}: gave up after {retry + 1} tries in {self.clock() - began:.1f}s "
                                           f"(deadline {self.deadline_s:g}s); last error: {describe(exc)}") from exc
                code, status = error_code(exc)
                log.warning("object store call failed, retrying", op=what, attempt=retry + 1,
                            error=code or type(exc).__name__, status=status, retry_in_s=round(pause, 3))
                await self.sleep(pause)
        raise AssertionError("unreachable: the last attempt returns or raises")
