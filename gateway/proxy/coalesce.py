"""A response's head and the first bytes of its body leave the server in one write to the client's socket.

uvicorn writes a response's head and its body with two ``transport.write`` calls, and a transport sends what it is
given at once when its buffer is empty: two ``send`` system calls, and two TCP segments that the client wakes up
for, where one would carry both. The app sends the head and a whole body (or a stream's first events) one after
the other without waiting in between, so ``CoalescingTransport`` holds a response head (a write that starts with
``HTTP/1.``) and writes it together with the next write, at once; a head that nothing follows in the same turn of
the event loop leaves alone at the end of that turn (``loop.call_soon``). Every other write goes straight through,
so nothing after the head waits. The bytes and their order are unchanged.

Everything else is the transport's own (reading, flow control, addresses), and whatever ends or hands over the
connection sees no bytes of its own held back: ``close`` and ``write_eof`` write what is held first, ``abort``
drops it with the rest of the unsent bytes, ``get_write_buffer_size`` counts it.
"""

from __future__ import annotations

import asyncio
from typing import Any


class CoalescingTransport:
    """``transport`` whose response heads leave with the write after them (module docstring)."""

    __slots__ = ("_held", "_loop", "transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self.transport.writelines((held, data) if data else (held,))  # one writev on uvloop: no copy
        elif data[:7] == b"HTTP/1.":  # a response head: it waits for its body (this turn at most)
            self._held = bytes(data)
            self._loop.call_soon(self.flush)
        elif data:
            self.transport.write(data)

    def writelines(self, chunks: Any) -> None:
        for data in chunks:
            self.write(data)

    def flush(self) -> None:
        """Hand what is held to the transport now (a closed one gets nothing)."""
        held, self._held = self._held, None
        if held and not self.transport.is_closing():
            self.transport.write(held)

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def write_eof(self) -> None:
        self.flush()
        self.transport.write_eof()

    def abort(self) -> None:
        self._held = None
        self.transport.abort()

    def get_write_buffer_size(self) -> int:
        return self.transport.get_write_buffer_size() + (len(self._held) if self._held else 0)

    def __getattr__(self, name: str) -> Any:  # the rest is the transport's
        return getattr(self.transport, name)
