"""A snapshot's checksums, summed in a helper process over the slot's shared memory (trainer/snapshots.py).

Why a process: xxhash holds the GIL while it sums, and a snapshot of a small GPT's state is 10 MB (0.6 ms of
summing in 213 calls). The training thread lets the GIL go at every torch op and then waited to get it back:
snapshots every step slowed the steps by 3-5% on a 2-core box, where the same snapshots with their sums left out
cost under 1%. The helper maps the slot's file read-only and answers with the digests, so the rank's worker
thread only waits on a pipe. If the helper cannot start or answer, the rank sums in its own process (said once):
slower, never wrong.

    python -m flightdeck.trainer.digester       # the helper: requests on stdin, digests on stdout

No torch here: the helper starts in a few tens of milliseconds, once per rank."""

import contextlib
import mmap
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import msgspec
import structlog

import flightdeck
from flightdeck.events import snapshot as fmt

log = structlog.get_logger("trainer")
# A helper that has not answered in this long is stuck (a frozen process) and the rank sums by itself: the rank's
# next snapshot waits on this one, so a long wait would stall training into a false hang (hang_min_s is 30 s)
ANSWER_S = 5.0
STARTUP_S = 120.0  # an interpreter not started in this long will not be: meanwhile the rank sums by itself
SLOWEST_BYTES_PER_S = 100e6  # ... or longer for a large slot (xxh3 summed 10.5 MB in 0.53 ms here)
_ROOT = str(Path(flightdeck.__file__).parent.parent)  # where `flightdeck` imports from, for the helper's sys.path


class Request(msgspec.Struct, array_like=True, frozen=True):
    path: str
    ranges: list[tuple[int, int]]  # (offset, bytes) of each item in the file


class Answer(msgspec.Struct, array_like=True, frozen=True):
    digests: list[int] = []
    error: str = ""
    cpu_s: float = 0.0  # the helper's CPU for them: what snapshots take beside training (Cadence.spacing)


def sums(view: memoryview, ranges: list[tuple[int, int]]) -> list[int]:
    return [fmt.digest(view[at:at + n]) for at, n in ranges]


def _frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "little") + body


def _read_frame(stream: IO[bytes]) -> bytes | None:
    head = stream.read(4)
    if len(head) < 4:
        return None
    return stream.read(int.from_bytes(head, "little"))


def serve(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    """The helper's loop: one request, one answer (the digests, or the error as a string), until stdin closes
    (the rank is gone)."""
    decode = msgspec.msgpack.Decoder(Request).decode
    encode = msgspec.msgpack.encode
    stdout.write(_frame(encode(Answer())))  # ready: the rank sums by itself until it reads this
    stdout.flush()
    while (body := _read_frame(stdin)) is not None:
        started = time.process_time()
        try:
            request = decode(body)
            with open(request.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                view = memoryview(mapped)
                try:
                    answer = Answer(digests=sums(view, request.ranges))
                finally:
                    view.release()
        except (OSError, ValueError, msgspec.DecodeError) as exc:
            answer = Answer(error=f"{type(exc).__name__}: {exc}")
        answer = msgspec.structs.replace(answer, cpu_s=time.process_time() - started)
        stdout.write(_frame(encode(answer)))
        stdout.flush()


class Digester:
    """Sums a slot's items in the helper process (started on first use), else here."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._broken: str | None = None  # why the helper is not used: sums are taken here
        self._ready = False  # the helper said it is ready
        self._started = 0.0
        self._lock = threading.Lock()
        self._decode = msgspec.msgpack.Decoder(Answer).decode
        self.cpu_s = 0.0  # the last sums' CPU, in whichever process took them

    @property
    def helped(self) -> bool:
        """The helper takes the sums (once it has said it is ready)."""
        return self._broken is None and self._ready

    def digests(self, path: Path, ranges: list[tuple[int, int]], view: memoryview) -> list[int]:
        """The digest of each (offset, bytes) range of the file at `path`, whose bytes `view` maps here too."""
        with self._lock:
            if self._broken is None and self._up():
                try:
                    return self._ask(Request(str(path), ranges))
                except (OSError, ValueError, msgspec.DecodeError) as exc:
                    self._give_up(exc)
            self.cpu_s = 0.0  # counted in the calling thread's own CPU
            return sums(view, ranges)

    def _up(self) -> bool:
        """Whether the helper is ready; started (once) if not: meanwhile, the first snapshots are summed here, so
        none waits for an interpreter to start (a tenth of a second, held at the next snapshot's boundary)."""
        try:
            if self._proc is None:
                self._start()
                return False
            if self._ready:
                return True
            assert self._proc.stdout is not None
            if not select.select([self._proc.stdout], [], [], 0)[0]:
                if time.monotonic() - self._started > STARTUP_S:
                    raise OSError(f"the helper was not ready in {STARTUP_S:g} s")
                return False
            body = _read_frame(self._proc.stdout)
            if body is None or self._decode(body).error:
                raise OSError(f"the helper exited before it was ready ({self._proc.poll()})")
            self._ready = True
            return True
        except (OSError, ValueError, msgspec.DecodeError) as exc:
            self._give_up(exc)
            return False

    def _give_up(self, exc: Exception) -> None:
        self._broken = f"{type(exc).__name__}: {exc}"
        log.warning("snapshot sums taken in the rank: its helper process failed", error=self._broken)
        self._stop()

    def _ask(self, request: Request) -> list[int]:
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(_frame(msgspec.msgpack.encode(request)))
        proc.stdin.flush()
        wait = max(ANSWER_S, sum(n for _, n in request.ranges) / SLOWEST_BYTES_PER_S)
        ready, _, _ = select.select([proc.stdout], [], [], wait)
        if not ready:
            raise OSError(f"the helper did not answer in {wait:g} s")
        body = _read_frame(proc.stdout)
        if body is None:
            raise OSError(f"the helper exited ({proc.poll()})")
        answer = self._decode(body)
        if answer.error:
            raise ValueError(answer.error)
        if len(answer.digests) != len(request.ranges):
            raise ValueError(f"the helper gave {len(answer.digests)} sums for {len(request.ranges)} items")
        self.cpu_s = answer.cpu_s
        return answer.digests

    def _start(self) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH", "")) if p)
        self._started, self._ready = time.monotonic(), False
        self._proc = subprocess.Popen([sys.executable, "-m", "flightdeck.trainer.digester"], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      close_fds=True)
        return self._proc

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):  # a request it never read: the pipe is broken
                        stream.close()

    def close(self) -> None:
        with self._lock:
            self._stop()


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer)
