"""The upstream HTTP/1.1 client (gateway.fleet.h1client) against raw asyncio servers that write exact bytes."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.fleet.h1client import HostPool
from gateway.fleet.h1response import ConnectFailed, ConnectionBroken

Handler = Callable[["Seen", asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class Seen:
    """What the server saw: one entry per request, and how many connections it accepted."""

    requests: list[tuple[bytes, bytes]] = field(default_factory=list)  # (head, body)
    connections: int = 0


async def read_request(seen: Seen, reader: asyncio.StreamReader) -> bool:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return False
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    body = await reader.readexactly(length)
    seen.requests.append((head, body))
    return True


@asynccontextmanager
async def server(script: Handler) -> AsyncIterator[tuple[str, Seen]]:
    seen = Seen()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.connections += 1
        try:
            await script(seen, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # a cancelled handler ends quietly (asyncio's stream callback would log its CancelledError)
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        srv.close()


def pool(url: str, **kw: float) -> HostPool:
    opts: dict[str, float] = {"limit": 4, "connect_s": 1.0, "acquire_s": 1.0, "total_s": 5.0, "keepalive_s": 4.0}
    opts.update(kw)
    return HostPool(
        url,
        limit=int(opts["limit"]),
        connect_s=opts["connect_s"],
        acquire_s=opts["acquire_s"],
        total_s=opts["total_s"],
        keepalive_s=opts["keepalive_s"],
    )


def fixed(body: bytes, extra: bytes = b"") -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + extra
    return head + b"content-length: %d\r\n\r\n" % len(body) + body


async def serve_forever(response: bytes) -> Handler:
    async def script(seen: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(seen, reader):
            writer.write(response)
            await writer.drain()

    return script


async def test_a_fixed_length_response_and_the_connection_is_reused() -> None:
    async with server(await serve_forever(fixed(b'{"ok":1}', b"x-extra: a\r\n"))) as (url, seen):
        p = pool(url + "/base")
        for _ in range(3):
            r = await p.request("/v1/chat/completions", b'{"q":1}', {"x-request-id": "abc"})
            assert r.status == 200
            assert r.headers["content-type"] == "application/json"
            assert (b"x-extra", b"a") in r.raw_headers
            assert await r.read() == b'{"ok":1}'
            r.release()
        assert seen.connections == 1
        head, body = seen.requests[0]
        assert head.startswith(b"POST /base/v1/chat/completions HTTP/1.1\r\n")
        assert b"\r\ncontent-length: 7\r\n" in head
        assert b"\r\nx-request-id: abc\r\n" in head
        assert b"\r\nhost: 127.0.0.1:" in head
        assert body == b'{"q":1}'
        p.close()


def chunked(parts: list[bytes]) -> bytes:
    out = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    for part in parts:
        out += b"%x\r\n%s\r\n" % (len(part), part)
    return out + b"0\r\n\r\n"


async def test_a_chunked_stream_arrives_as_it_is_sent_and_reading_is_stateful() -> None:
    gate = asyncio.Event()

    async def script(seen: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(seen, reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(b"6\r\nfirst\n\r\n")
        await writer.drain()
        await gate.wait()
        writer.write(b"7\r\nsecond\n\r\n0\r\n\r\n")
        await writer.drain()
        await read_request(seen, reader)  # keep the connection open

    async with server(script) as (url, _seen):
        p = pool(url)
        r = await p.request("/x", b"{}", {})
        async for chunk in r.iter_any():
            assert chunk == b"first\n"
            break
        assert not r.complete
        gate.set()
        assert [c async for c in r.iter_any()] == [b"second\n"]
        assert r.complete
        r.release()
        assert p.connections == 1  # kept for reuse
        p.close()


async def test_a_body_delimited_by_close_completes_at_eof_and_is_not_reused() -> None:
    async def script(seen: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(seen, reader)
        writer.write(b'HTTP/1.0 200 OK\r\ncontent-type: application/json\r\n\r\n{"a":')
        await writer.drain()
        writer.write(b"1}")

    async with server(script) as (url, seen):
        p = pool(url)
        r = await p.request("/x", b"{}", {})
        assert await r.read() == b'{"a":1}'
        r.release()
        r2 = await p.request("/x", b"{}", {})
        assert await r2.read() == b'{"a":1}'
        r2.release()
        assert seen.connections == 2
        p.close()


async def test_a_connection_that_breaks_mid_body_raises() -> None:
    async def script(seen: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(seen, reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await writer.drain()

    async with server(script) as (url, _seen):
        p = pool(url)
        r = await p.request("/x", b"{}", {})
        got: list[bytes] = []

        async def drain() -> None:
            async for chunk in r.iter_any():
                got.append(chunk)

        with pytest.raises(ConnectionBroken):
            await drain()
        assert got == [b"partial"]  # what arrived is delivered before the error
        r.release()
        assert p.connections == 0
        p.close()


async def test_a_connection_closed_before_the_headers_raises() -> None:
    async def script(seen: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(seen, reader)

    async with server(script) as (url, _seen):
        p = pool(url)
        with pytest.raises(ConnectionBroken):
            await p.request("/x", b"{}", {})
        p.close()


async def test_a_malformed_response_raises() -> None:
    async def script(seen: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(seen, reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async with server(script) as (url, _seen):
        p = pool(url)
        with pytest.raises(ConnectionBroken):
            await p.request("/x", b"{}", {})
        p.close()


async def test_the_total_timeout_covers_headers_and_body() -> None:
    async def silent(seen: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(seen, reader)
        await asyncio.sleep(5)

    async def slow_body(seen: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(seen, reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    async with server(silent) as (url, _seen):
        p = pool(url, total_s=0.2, acquire_s=0.2, connect_s=0.2)
        with pytest.raises(TimeoutError):
            await p.request("/x", b"{}", {})
        p.close()
    async with server(slow_body) as (url, _seen):
        p = pool(url, total_s=0.3, acquire_s=0.3, connect_s=0.3)
        r = await p.request("/x", b"{}", {})
        with pytest.raises(TimeoutError):
            await r.read()
        r.close()
        p.close()


async def test_connect_failures() -> None:
    async with server(await serve_forever(fixed(b"{}"))) as (url, _seen):
        pass  # closed: nothing listens on that port any more
    p = pool(url)
    with pytest.raises(ConnectFailed):
        await p.request("/x", b"{}", {})
    p.close()


async def test_the_connection_limit_waits_then_gives_up() -> None:
    async with server(await serve_forever(fixed(b"{}"))) as (url, seen):
        p = pool(url, limit=1, acquire_s=1.5)  # long enough for a starved machine to hand the connection over
        r = await p.request("/x", b"{}", {})  # holds the only connection (not released)
        with pytest.raises(ConnectFailed, match="no free connection"):
            await p.request("/x", b"{}", {})
        waiting = asyncio.create_task(p.request("/x", b"{}", {}))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        assert await r.read() == b"{}"
        r.release()
        r2 = await waiting
        assert await r2.read() == b"{}"
        r2.release()
        assert seen.connections == 1
        p.close()


async def test_a_cancelled_request_closes_its_connection_and_frees_its_slot() -> None:
    async def script(seen: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not await read_request(seen, reader):
            return
        if len(seen.requests) == 1:
            await asyncio.sleep(5)  # the first request never gets an answer
        writer.write(fixed(b"{}"))
        await writer.drain()
        await read_request(seen, reader)

    async with server(script) as (url, seen):
        p = pool(url, limit=1)
        task = asyncio.create_task(p.request("/x", b"{}", {}))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        r = await p.request("/x", b"{}", {})  # the slot is free again, on a new connection
        assert await r.read() == b"{}"
        r.release()
        assert seen.connections == 2
        p.close()


async def test_a_response_released_before_its_end_is_not_reused() -> None:
    async with server(await serve_forever(chunked([b"a" * 10, b"b" * 10]))) as (url, seen):
        p = pool(url)
        r = await p.request("/x", b"{}", {})
        r.close()
        r = await p.request("/x", b"{}", {})
        assert await r.read() == b"a" * 10 + b"b" * 10
        r.release()
        assert seen.connections == 2
        p.close()


async def test_idle_connections_expire_after_keepalive() -> None:
    async with server(await serve_forever(fixed(b"{}"))) as (url, seen):
        p = pool(url, keepalive_s=0.05)
        for _ in range(2):
            r = await p.request("/x", b"{}", {})
            await r.read()
            r.release()
            await asyncio.sleep(0.1)
        assert seen.connections == 2
        p.close()


async def test_gzip_bodies_are_decoded_and_unknown_encodings_refused() -> None:
    payload = b'{"text": "' + b"compressible " * 200 + b'"}'
    packed = gzip.compress(payload)
    async with server(await serve_forever(fixed(packed, b"content-encoding: gzip\r\n"))) as (url, _seen):
        p = pool(url)
        r = await p.request("/x", b"{}", {})
        assert await r.read() == payload
        r.release()
        p.close()
    async with server(await serve_forever(fixed(b"xx", b"content-encoding: br\r\n"))) as (url, _seen):
        p = pool(url)
        with pytest.raises(ConnectionBroken, match="content-encoding"):
            await p.request("/x", b"{}", {})
        p.close()


async def test_a_slow_reader_gets_a_large_body_intact() -> None:
    parts = [bytes([65 + i % 26]) * 65536 for i in range(40)]  # 2.5 MiB, above the read high-water mark
    async with server(await serve_forever(chunked(parts))) as (url, _seen):
        p = pool(url)
        r = await p.request("/x", b"{}", {})
        got = []
        async for chunk in r.iter_any():
            got.append(chunk)
            await asyncio.sleep(0.001)
        assert b"".join(got) == b"".join(parts)
        r.release()
        assert p.connections == 1
        p.close()


async def test_bytes_after_the_response_make_the_connection_unusable() -> None:
    two = fixed(b"{}") + b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"  # two answers to one request
    async with server(await serve_forever(two)) as (url, seen):
        p = pool(url)
        r = await p.request("/x", b"{}", {})
        assert await r.read() == b"{}"
        r.release()
        r = await p.request("/x", b"{}", {})
        assert await r.read() == b"{}"
        r.release()
        assert seen.connections == 2
        p.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    parts=st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=8),
    cuts=st.lists(st.integers(min_value=1, max_value=2000), max_size=12),
)
def test_any_split_of_a_chunked_response_reads_the_same_body(parts: list[bytes], cuts: list[int]) -> None:
    wire = chunked(parts)
    points = sorted({c % len(wire) for c in cuts} - {0})
    pieces = [wire[a:b] for a, b in zip([0, *points], [*points, len(wire)], strict=True)]

    async def script(seen: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(seen, reader):
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0)

    async def run() -> None:
        async with server(script) as (url, _seen):
            p = pool(url)
            for _ in range(2):  # twice: the parser is reset between responses on one connection
                r = await p.request("/x", b"{}", {})
                assert b"".join([c async for c in r.iter_any()]) == b"".join(parts)
                r.release()
            p.close()

    asyncio.run(run())


async def test_interim_responses_are_skipped_and_trailers_are_not_headers() -> None:
    wire = (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
        b"2\r\nok\r\n0\r\nset-cookie: evil=1\r\n\r\n"
    )
    async with server(await serve_forever(wire)) as (url, seen):
        p = pool(url)
        for _ in range(2):
            r = await p.request("/x", b"{}", {})
            assert r.status == 200
            assert await r.read() == b"ok"
            assert [k for k, _ in r.raw_headers] == [b"content-type", b"transfer-encoding"]
            r.release()
        assert seen.connections == 1
        p.close()


async def test_a_truncated_gzip_body_is_an_error() -> None:
    packed = gzip.compress(b"x" * 5000)[:-10]
    async with server(await serve_forever(fixed(packed, b"content-encoding: gzip\r\n"))) as (url, _seen):
        p = pool(url)
        r = await p.request("/x", b"{}", {})
        with pytest.raises(ConnectionBroken, match="truncated"):
            await r.read()
        r.release()
        p.close()


async def test_closing_the_pool_fails_a_busy_request_at_once() -> None:
    async def script(seen: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(seen, reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{")  # unframed: ends at close
        await writer.drain()
        await asyncio.sleep(5)

    async with server(script) as (url, _seen):
        p = pool(url)
        r = await p.request("/x", b"{}", {})
        reading = asyncio.create_task(r.read())
        await asyncio.sleep(0.05)
        p.close()  # a reload retires the client: the body is not "complete" because we closed it
        with pytest.raises(ConnectionBroken, match="closed"):
            await asyncio.wait_for(reading, 2)
        r.release()


async def test_host_header_and_head_encoding() -> None:
    p = pool("http://127.0.0.1:1")
    assert pool("http://[::1]/v").host_header == "[::1]"
    assert pool("http://[::1]:8000").host_header == "[::1]:8000"
    assert pool("https://example.com:443/a/").host_header == "example.com"
    head = p._head("/x", 2, {"x-latin": "caf\xe9", "authorization": "Bearer k\udcff\u20ac"})
    assert b"\r\nx-latin: caf\xe9\r\n" in head  # client bytes go back as they came
    assert b"\r\nauthorization: Bearer k?\xe2\x82\xac\r\n" in head  # our value: UTF-8, the surrogate replaced
