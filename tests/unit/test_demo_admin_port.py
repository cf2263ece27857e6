"""The demo's ports: a taken gateway or admin port stops the demo before it prints or starts anything, naming the
port and how to choose others; the admin port never moves silently."""

from __future__ import annotations

import socket

import pytest

from gateway.cli.demo import check_ports
from gateway.sim.launch import free_port


def test_free_ports_pass() -> None:
    check_ports(free_port(), free_port())


@pytest.mark.parametrize("which", ["the gateway", "the admin API"])
def test_a_taken_port_is_named_with_how_to_choose_others(which: str) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy, other = held.getsockname()[1], free_port()
        ports = (busy, other) if which == "the gateway" else (other, busy)
        with pytest.raises(RuntimeError) as err:
            check_ports(*ports)
    message = str(err.value)
    assert f"port {busy} ({which}) is already in use" in message
    assert "--port 9080 --admin-port 9081" in message
    assert str(other) not in message


def test_both_taken_are_both_named() -> None:
    with socket.socket() as a, socket.socket() as b:
        for s in (a, b):
            s.bind(("127.0.0.1", 0))
            s.listen()
        pa, pb = a.getsockname()[1], b.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"port {pa} \\(the gateway\\) and {pb} \\(the admin API\\) are"):
            check_ports(pa, pb)


def test_the_same_port_twice_is_refused() -> None:
    port = free_port()
    with pytest.raises(RuntimeError, match="both"):
        check_ports(port, port)
