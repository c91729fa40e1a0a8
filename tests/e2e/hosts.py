"""Hosts that share nothing but the network: one Linux network namespace per "host", each joined by a veth pair to
a bridge in the test machine's namespace. The broker and the S3 endpoint listen on the bridge's address; an agent
started in a host's namespace reaches them, and the other hosts' ranks, only over that network (no loopback
shortcut, no abstract unix socket of another host's agent). Needs root and `ip netns` (this machine and CI run as
root); `unavailable()` says why not, for a skip."""

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Host:
    node: str
    netns: str
    ip: str
    ifname: str  # the host's interface (GLOO_SOCKET_IFNAME: its ranks' collectives go over it)

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]


@dataclass(frozen=True)
class Hosts:
    gateway: str  # the bridge's address, in the test machine's namespace: broker and S3 listen here
    hosts: dict[str, Host]


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")


def unavailable() -> str | None:
    """Why isolated hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI and this machine run as root)"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    probe = f"fdprobe{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", probe)
    except OSError as exc:
        return f"cannot create a network namespace: {exc}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


@contextmanager
def isolated_hosts(nodes: Sequence[str]) -> Iterator[Hosts]:
    """A namespace per node on a fresh /24 (random, so parallel tests do not clash); all removed on exit."""
    tag = uuid.uuid4().hex[:6]
    net = f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:4], 16)}"
    bridge = f"fdb{tag}"
    made_ns: list[str] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{net}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        hosts: dict[str, Host] = {}
        for i, node in enumerate(nodes, start=2):
            ns, outer, inner = f"fd{tag}-{node}", f"fd{tag}{i}", f"fd{tag}{i}p"
            _ip("netns", "add", ns)
            made_ns.append(ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", outer, "master", bridge)
            _ip("link", "set", outer, "up")
            _ip("link", "set", inner, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{net}.{i}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            hosts[node] = Host(node=node, netns=ns, ip=f"{net}.{i}", ifname=inner)
        yield Hosts(gateway=f"{net}.1", hosts=hosts)
    finally:
        for ns in made_ns:  # deleting a namespace deletes its veth end, and with it the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True, timeout=30)
