"""Caps on open client connections: in total and per client address, for each listening port of one process.

``ConnectionGate`` is the count; ``LimitedHttpToolsProtocol`` (``gateway.proxy.limits``) enters it in
``connection_made`` and leaves it in ``connection_lost``. One gate belongs to the protocol factory of a uvicorn
server (``http_protocol``); with ``--workers N`` each worker process unpickles its own, so the caps are per process.
Counts are kept per local port, so the admin listener, where it shares a server with the client listener, has
counts of its own: a flood on the client port cannot lock the operators out.

A client address is the socket peer's: behind a load balancer every connection comes from the balancer, so the
per-client cap must then be off (0) or above what the balancer opens. IPv6 clients are counted per /64, the
smallest network one subscriber usually gets (one host can pick any address in it); an IPv4-mapped address counts
as its IPv4 address.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Literal

Refusal = Literal["connections_total", "connections_per_client"]


@dataclass(frozen=True, slots=True)
class Held:
    """One connection counted by a gate (``ConnectionGate.leave`` takes it back)."""

    port: int
    client: str | None


def client_key(host: str) -> str:
    """The address a client's connections are counted under: IPv4 as is, IPv6 by its /64."""
    if ":" not in host:
        return host
    try:
        addr = ipaddress.IPv6Address(host)
    except ValueError:
        return host
    if addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(ipaddress.IPv6Network((int(addr) >> 64 << 64, 64)))


class ConnectionGate:
    """Open connections per local port, in total (``total``) and per client address (``per_client``); 0: no cap.
    Single-threaded: used from the event loop of one server only."""

    def __init__(self, *, total: int, per_client: int) -> None:
        self.total = total
        self.per_client = per_client
        self._open: dict[int, int] = {}
        self._by_client: dict[tuple[int, str], int] = {}

    def enter(self, port: int, host: str | None) -> Held | Refusal:
        """Count a new connection, or say which cap it is over (then nothing is counted)."""
        open_now = self._open.get(port, 0)
        if self.total and open_now >= self.total:
            return "connections_total"
        key = client_key(host) if host is not None and self.per_client else None
        if key is not None:
            mine = self._by_client.get((port, key), 0)
            if mine >= self.per_client:
                return "connections_per_client"
            self._by_client[(port, key)] = mine + 1
        self._open[port] = open_now + 1
        return Held(port, key)

    def leave(self, held: Held) -> None:
        left = self._open[held.port] - 1
        if left:
            self._open[held.port] = left
        else:
            del self._open[held.port]
        if held.client is not None:
            k = (held.port, held.client)
            mine = self._by_client[k] - 1
            if mine:
                self._by_client[k] = mine
            else:
                del self._by_client[k]

    def open(self, port: int) -> int:
        """Connections counted on ``port`` now."""
        return self._open.get(port, 0)

    def clients(self) -> int:
        """Client addresses with a connection counted now (on any port)."""
        return len(self._by_client)
