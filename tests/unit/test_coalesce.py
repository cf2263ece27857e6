"""CoalescingTransport: what is written in one turn of the loop reaches the transport as one write, in order."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from gateway.proxy.coalesce import CoalescingTransport


class FakeTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.events: list[str] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.events.append("close")
        self.closing = True

    def abort(self) -> None:
        self.events.append("abort")
        self.closing = True

    def write_eof(self) -> None:
        self.events.append("eof")

    def get_write_buffer_size(self) -> int:
        return 5

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else None


def _wrap() -> tuple[FakeTransport, CoalescingTransport]:
    fake = FakeTransport()
    return fake, CoalescingTransport(cast(asyncio.Transport, fake), asyncio.get_running_loop())


async def test_writes_of_one_turn_leave_as_one_write_in_order() -> None:
    fake, t = _wrap()
    t.write(b"head ")
    t.write(bytearray(b"body"))
    t.write(b"")
    assert fake.writes == []
    assert t.get_write_buffer_size() == 5 + 9
    await asyncio.sleep(0)
    assert fake.writes == [b"head body"]
    t.writelines([b"a", memoryview(b"b")])
    await asyncio.sleep(0)
    assert fake.writes == [b"head body", b"ab"]
    assert t.get_write_buffer_size() == 5


async def test_close_and_eof_write_what_is_held_first_and_abort_drops_it() -> None:
    fake, t = _wrap()
    t.write(b"x")
    t.write_eof()
    assert fake.writes == [b"x"]
    assert fake.events == ["eof"]
    t.write(b"y")
    t.close()
    assert fake.writes == [b"x", b"y"]
    assert fake.events == ["eof", "close"]
    await asyncio.sleep(0)  # the turn's flush finds nothing more
    assert fake.writes == [b"x", b"y"]

    fake, t = _wrap()
    t.write(b"lost")
    t.abort()
    await asyncio.sleep(0)
    assert fake.writes == []
    assert fake.events == ["abort"]


async def test_a_transport_closed_meanwhile_gets_nothing_and_the_rest_is_the_transports() -> None:
    fake, t = _wrap()
    t.write(b"late")
    fake.closing = True
    await asyncio.sleep(0)
    assert fake.writes == []
    assert t.is_closing()
    assert t.get_extra_info("peername") == ("127.0.0.1", 1)
