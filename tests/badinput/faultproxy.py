"""A fault-injecting HTTP proxy for an S3 endpoint: real TCP, asyncio, one request per connection.

Each request is forwarded (with `Connection: close`) unless a fault rule matches it first:

    "500"     HTTP 500 InternalError            (a server failing)
    "503"     HTTP 503 SlowDown                 (throttling)
    "reset"   the connection reset (RST) before any response
    "stall"   the request read, then no response at all until the client gives up
    "lost"    the request forwarded and carried out, then the connection reset: the answer never arrives

Rules match on method and path, apply to the next `times` matching requests (or forever), and count what
they did, so a test can say which faults were met and that the client retried past them.
"""

import asyncio
import contextlib
import socket
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

Match = Callable[[str, str], bool]
ERRORS = {"500": ("InternalError", "We encountered an internal error.", "500 Internal Server Error"),
          "503": ("SlowDown", "Please reduce your request rate.", "503 Slow Down")}


@dataclass
class Rule:
    kind: str
    match: Match
    times: int | None  # None: forever


@dataclass
class FaultProxy:
    upstream_host: str
    upstream_port: int
    rules: list[Rule] = field(default_factory=list)
    seen: Counter[str] = field(default_factory=Counter)  # "PUT" etc., and "fault:<kind>"
    port: int = 0
    _server: asyncio.Server | None = None
    _stalled: set[asyncio.StreamWriter] = field(default_factory=set)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fail(self, kind: str, *, times: int | None = 1, match: Match = lambda method, path: True) -> None:
        assert kind in ("500", "503", "reset", "stall", "lost"), kind
        self.rules.append(Rule(kind, match, times))

    def clear(self) -> None:
        self.rules.clear()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        for w in list(self._stalled):
            w.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def _fault_for(self, method: str, path: str) -> str:
        for rule in self.rules:
            if rule.match(method, path) and (rule.times is None or rule.times > 0):
                if rule.times is not None:
                    rule.times -= 1
                return rule.kind
        return ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        self.seen[method] += 1
        kind = self._fault_for(method, path)
        if kind:
            self.seen[f"fault:{kind}"] += 1
        try:
            if kind == "reset":
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST
                writer.close()
            elif kind == "stall":
                self._stalled.add(writer)
                await reader.read()  # until the client hangs up on us
                self._stalled.discard(writer)
                writer.close()
            elif kind in ("500", "503"):
                await self._drain_body(reader, headers)
                code, reason, status = ERRORS[kind]
                body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{reason}'
                        f"</Message><RequestId>fault</RequestId></Error>").encode()
                writer.write(f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
                             f"Connection: close\r\n\r\n".encode() + body)
                await writer.drain()
                writer.close()
            else:
                await self._forward(head, reader, writer, deliver=kind != "lost")
        except (ConnectionError, asyncio.IncompleteReadError):
            writer.close()

    @staticmethod
    async def _drain_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> None:
        if headers.get("expect", "").lower() == "100-continue":
            return  # the client waits for us before sending it; a final status instead is allowed
        length = int(headers.get("content-length", "0") or 0)
        if length:
            await reader.readexactly(length)

    async def _forward(self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       deliver: bool = True) -> None:
        up_reader, up_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        first, _, rest = head.partition(b"\r\n")
        kept = [ln for ln in rest.split(b"\r\n") if ln and not ln.lower().startswith(b"connection:")]
        up_writer.write(b"\r\n".join([first, *kept, b"Connection: close", b"", b""]))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while chunk := await src.read(1 << 16):
                    dst.write(chunk)
                    await dst.drain()
            with contextlib.suppress(Exception):
                if dst.can_write_eof():
                    dst.write_eof()

        upstream = asyncio.create_task(pipe(reader, up_writer))
        try:
            if deliver:
                await pipe(up_reader, writer)  # the response, until the server closes (we asked it to)
            else:
                await up_reader.read()  # the server did the work; its answer goes nowhere
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        finally:
            upstream.cancel()
            with contextlib.suppress(BaseException):
                await upstream
            up_writer.close()
            writer.close()
