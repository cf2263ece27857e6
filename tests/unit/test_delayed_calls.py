"""Calls made a while after they were added, many by one timer (gateway.periodic.DelayedCalls): made no sooner than
the delay and no later than half as long again, never once discarded, in the order they came, and one call that
raises does not lose the others."""

from __future__ import annotations

import asyncio

from gateway.periodic import DelayedCalls

DELAY = 0.05


async def test_calls_come_after_the_delay_in_order_and_discarded_ones_never() -> None:
    loop = asyncio.get_running_loop()
    calls = DelayedCalls(loop, DELAY)
    made: list[tuple[str, float]] = []
    start = loop.time()
    for name in ("a", "b", "c"):
        calls.add(name, lambda n: made.append((n, loop.time())), name)
    calls.discard("b")
    await asyncio.sleep(DELAY * 0.5)
    calls.add("d", lambda n: made.append((n, loop.time())), "d")
    await asyncio.sleep(DELAY * 2.5)
    assert [n for n, _ in made] == ["a", "c", "d"]
    for name, at in made:
        added = start + (DELAY * 0.5 if name == "d" else 0.0)
        assert at - added >= DELAY * 0.97  # (a millisecond's leeway for a timer firing a little early)
    calls.close()


async def test_one_timer_for_many_calls() -> None:
    loop = asyncio.get_running_loop()
    calls = DelayedCalls(loop, DELAY)
    made: list[int] = []
    for i in range(1000):
        calls.add(i, made.append, i)
    assert calls._handle is not None
    first = calls._handle
    for i in range(1000, 1100):
        calls.add(i, made.append, i)
    assert calls._handle is first  # no timer of its own per call
    await asyncio.sleep(DELAY * 2)
    assert made == list(range(1100))
    assert calls._handle is None  # nothing waits: no timer either


async def test_a_call_that_raises_leaves_the_rest_to_the_next_tick() -> None:
    loop = asyncio.get_running_loop()
    calls = DelayedCalls(loop, DELAY)
    made: list[str] = []

    def boom(_: object) -> None:
        raise RuntimeError("a bug")

    errors: list[BaseException] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx.get("exception")))
    calls.add("bad", boom, None)
    calls.add("good", made.append, "good")
    await asyncio.sleep(DELAY * 3)
    assert made == ["good"]
    assert any(isinstance(e, RuntimeError) for e in errors)
    loop.set_exception_handler(None)


async def test_closed_it_makes_no_call() -> None:
    loop = asyncio.get_running_loop()
    calls = DelayedCalls(loop, DELAY)
    made: list[int] = []
    calls.add(1, made.append, 1)
    calls.close()
    calls.discard(1)  # after close: nothing to do, no error
    await asyncio.sleep(DELAY * 2)
    assert made == []
