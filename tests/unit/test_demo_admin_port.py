"""The demo's admin port: the gateway's port + 1 when free, else another free port (never a failed start)."""

from __future__ import annotations

import socket

from gateway.cli.demo import admin_port_for
from gateway.sim.launch import free_port


def test_the_next_port_when_it_is_free() -> None:
    with socket.socket() as s:  # a port whose next one was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1] - 1
    assert admin_port_for(port) == port + 1


def test_another_free_port_when_the_next_one_is_held() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        chosen = admin_port_for(busy - 1)
        assert chosen != busy
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", chosen))  # free indeed


def test_a_port_a_simulated_server_was_given_is_never_chosen() -> None:
    port = free_port()
    assert admin_port_for(port, taken={port + 1}) != port + 1
