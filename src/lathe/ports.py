"""A free TCP port for a rendezvous (a process group's or a weight-sync store's) that a process binds a moment later.

The usual trick, binding port 0 and closing, hands out a port from the kernel's ephemeral range: the very range from
which every socket that connects or listens meanwhile (gloo's pairs, NCCL's bootstrap, Ray's clients) draws its own
port, so the rendezvous can find its port taken (EADDRINUSE) by the time it binds. `free_port` picks at random from
the ports below that range, above Ray's worker ports (10002-19999 by default) and below Kubernetes' NodePorts
(30000-32767), checks that it binds now, and never hands the same port out twice in one process."""

from __future__ import annotations

import random
import socket

LOWEST = 20000                          # above Ray's worker ports (min/max_worker_port: 10002-19999)
HIGHEST = 30000                         # below Kubernetes' NodePorts (30000-32767), which kube-proxy redirects
TRIES = 64
_given: set[int] = set()
_random = random.SystemRandom()         # (not the seeded global generator: two seeded processes would pick alike)


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def binds(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def free_port(host: str = "") -> int:
    """A TCP port free on `host`'s interface now (all interfaces by default), in 20000-29999 below the ephemeral range
    where that leaves room; an ephemeral one otherwise."""
    high = min(HIGHEST, ephemeral_range()[0])
    for _ in range(TRIES if high - LOWEST >= 1024 else 0):
        port = _random.randrange(LOWEST, high)
        if port not in _given and binds(host, port):
            _given.add(port)
            return port
    while True:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _given:
            _given.add(port)
            return port
