"""`lathe.ports.free_port`: a port that binds, outside the kernel's ephemeral range (where the sockets opened between
choosing and binding draw theirs), never the same one twice, and an ephemeral one where no room is left below."""

from __future__ import annotations

import itertools
import socket

from lathe import ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    low = ports.ephemeral_range()[0]
    got = [ports.free_port("127.0.0.1") for _ in range(50)]
    assert len(set(got)) == len(got)
    high = min(ports.HIGHEST, low)
    if high - ports.LOWEST >= 1024:
        assert all(ports.LOWEST <= p < high for p in got)         # (not ephemeral, nor a Kubernetes NodePort)
    assert all(ports.binds("127.0.0.1", p) for p in got)


def test_a_port_in_use_is_passed_over(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picks = itertools.chain([busy, busy], itertools.count(busy + 1))      # (then the next ports up)
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (busy + 1024 + ports.LOWEST, 60999))
        monkeypatch.setattr(ports._random, "randrange", lambda a, b: next(picks))
        assert ports.free_port("127.0.0.1") != busy


def test_no_room_below_the_ephemeral_range_falls_back_to_the_kernels_choice(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LOWEST + 10, 60999))
    monkeypatch.setattr(ports._random, "randrange", lambda a, b: 1 / 0)       # (never asked)
    port = ports.free_port("127.0.0.1")
    assert port > 0 and port in ports._given
