"""One write to the client's socket for what the server writes in one turn of the event loop.

uvicorn writes a response's head and its body with two ``transport.write`` calls, and a transport sends what it is
given at once when its buffer is empty: two ``send`` system calls, and two TCP segments that the client wakes up
for, where one would carry both. The app sends the head and a whole body (or a stream's first events) one after
the other without waiting in between, so ``CoalescingTransport`` keeps what is written during one turn of the loop
and hands it to the socket's transport as one write at the end of that turn (``loop.call_soon``). The bytes and
their order are unchanged; they leave at most one turn of the loop later, before anything that waits on the
network can run.

Everything else is the transport's own (reading, flow control, addresses), and whatever ends or hands over the
connection sees no bytes of its own held back: ``close`` and ``write_eof`` write what is held first, ``abort``
drops it with the rest of the unsent bytes, ``get_write_buffer_size`` counts it.
"""

from __future__ import annotations

import asyncio
from typing import Any


class CoalescingTransport:
    """``transport`` whose writes of one loop turn leave as one (module docstring)."""

    __slots__ = ("_held", "_loop", "_size", "transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        self._loop = loop
        self._held: list[bytes] | None = None
        self._size = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        held = self._held
        if held is None:
            self._held = [bytes(data)]
            self._loop.call_soon(self.flush)
        else:
            held.append(bytes(data))
        self._size += len(data)

    def writelines(self, chunks: Any) -> None:
        for data in chunks:
            self.write(data)

    def flush(self) -> None:
        """Hand what is held to the transport now (a closed one gets nothing)."""
        held, self._held, self._size = self._held, None, 0
        if held and not self.transport.is_closing():
            self.transport.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def write_eof(self) -> None:
        self.flush()
        self.transport.write_eof()

    def abort(self) -> None:
        self._held, self._size = None, 0
        self.transport.abort()

    def get_write_buffer_size(self) -> int:
        return self.transport.get_write_buffer_size() + self._size

    def __getattr__(self, name: str) -> Any:  # the rest is the transport's
        return getattr(self.transport, name)
