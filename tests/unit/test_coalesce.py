"""CoalescingTransport: a response head reaches the transport together with the write after it, in order."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from gateway.proxy.coalesce import CoalescingTransport

HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n"


class FakeTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.events: list[str] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def writelines(self, chunks: Any) -> None:
        self.writes.append(b"".join(bytes(c) for c in chunks))

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


async def test_a_head_leaves_with_the_next_write_at_once_and_other_writes_go_straight_through() -> None:
    fake, t = _wrap()
    t.write(HEAD)
    assert fake.writes == []
    assert t.get_write_buffer_size() == 5 + len(HEAD)
    t.write(memoryview(b"body"))
    assert fake.writes == [HEAD + b"body"]  # no turn of the loop waited for
    t.write(bytearray(b"more"))
    t.writelines([b"a", b"b"])
    assert fake.writes == [HEAD + b"body", b"more", b"a", b"b"]
    await asyncio.sleep(0)  # the head's own flush finds nothing held
    assert fake.writes == [HEAD + b"body", b"more", b"a", b"b"]
    assert t.get_write_buffer_size() == 5


async def test_a_head_that_nothing_follows_leaves_at_the_end_of_the_turn() -> None:
    fake, t = _wrap()
    t.write(HEAD)
    t.write(b"")
    assert fake.writes == [HEAD]  # an empty write still releases it
    t.write(HEAD)
    await asyncio.sleep(0)
    assert fake.writes == [HEAD, HEAD]


async def test_close_and_eof_write_what_is_held_first_and_abort_drops_it() -> None:
    fake, t = _wrap()
    t.write(HEAD)
    t.write_eof()
    assert fake.writes == [HEAD]
    assert fake.events == ["eof"]
    t.write(HEAD)
    t.close()
    assert fake.writes == [HEAD, HEAD]
    assert fake.events == ["eof", "close"]
    await asyncio.sleep(0)
    assert fake.writes == [HEAD, HEAD]

    fake, t = _wrap()
    t.write(HEAD)
    t.abort()
    await asyncio.sleep(0)
    assert fake.writes == []
    assert fake.events == ["abort"]


async def test_a_transport_closed_meanwhile_gets_nothing_and_the_rest_is_the_transports() -> None:
    fake, t = _wrap()
    t.write(HEAD)
    fake.closing = True
    await asyncio.sleep(0)
    assert fake.writes == []
    assert t.is_closing()
    assert t.get_extra_info("peername") == ("127.0.0.1", 1)
