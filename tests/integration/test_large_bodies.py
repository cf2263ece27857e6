"""Large request bodies against a real uvicorn gateway: read in a parsing process, decided as on the event loop.

A body over 1 MiB goes to the gateway's parsing process (``--parse-workers``, default 1); with ``--parse-workers
0`` it is parsed on the event loop. Both gateways must route, rewrite and forward it alike. The number of arrays
and objects in a body is capped (``--max-json-containers``) before it is parsed, on both paths.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson

from gateway.testing.fake_upstream import FakeUpstreamServer
from tests.conftest import MODEL, ServerThread, rules_for
from tests.integration.test_limits_client import posts

Fake = Callable[..., FakeUpstreamServer]
Gateway = Callable[..., ServerThread]
ROUTE_HEADERS = ("x-specgate-class", "x-specgate-task-type", "x-specgate-route")


def big_chat(messages: int, **extra: Any) -> bytes:
    system = {"role": "system", "content": "You write python. " + "context " * 2000}
    tiny = [{"role": "user", "content": "hello"}] * messages
    return orjson.dumps({"model": MODEL, "messages": [system, *tiny], **extra})


def forwarded(server: FakeUpstreamServer) -> dict[str, Any]:
    body = posts(server)[-1]["body"]
    return body if isinstance(body, dict) else orjson.loads(body)


def test_a_large_body_is_routed_rewritten_and_forwarded_as_on_the_event_loop(fake: Fake, gateway: Gateway) -> None:
    """A 7.9 MB stream request for the speculative pool (low temperature, a code task): its class, task and route,
    and the body the pool gets (the client's request_id dropped, the usage option added) are the same whether the
    body was parsed in the parsing process or on the loop; meanwhile /health answers."""
    big = big_chat(229_000, temperature=0.1, stream=True, request_id="client-chosen", max_tokens=4)
    assert 7_500_000 < len(big) < 8 * 2**20
    seen: dict[int, tuple[dict[str, str], dict[str, Any]]] = {}
    health: list[float] = []
    for workers in (1, 0):
        spec, std = fake(f"spec{workers}"), fake(f"std{workers}")
        gw = gateway(rules_for([spec.url], [std.url]), parse_workers=workers)
        results: dict[str, Any] = {}

        def post(url: str = gw.url, out: dict[str, Any] = results) -> None:
            with httpx.Client(timeout=60) as client:
                r = client.post(url + "/v1/chat/completions", content=big)
                out["status"], out["headers"], out["text"] = r.status_code, r.headers, r.text

        sender = threading.Thread(target=post)
        sender.start()
        with httpx.Client(timeout=30) as client:
            while sender.is_alive():
                t0 = time.perf_counter()
                assert client.get(gw.url + "/health").status_code == 200
                if workers:
                    health.append(time.perf_counter() - t0)
        sender.join()
        assert results["status"] == 200, results["text"][:500]
        assert "data: [DONE]" in results["text"]
        assert not posts(std)
        seen[workers] = ({h: results["headers"][h] for h in ROUTE_HEADERS}, forwarded(spec))
    headers, body = seen[1]
    assert headers == seen[0][0]
    assert headers["x-specgate-class"] == "precise"
    assert headers["x-specgate-task-type"] == "code"
    assert body == seen[0][1]
    assert "request_id" not in body
    assert body["stream_options"] == {"include_usage": True}
    assert body["messages"] == orjson.loads(big)["messages"]
    # Generous: the test's threads, the upstream and the gateway share one interpreter here; the number for the
    # record comes from a gateway of its own (docs/limits.md, python -m gateway.bench.attacks bigbody).
    assert health
    assert max(health) < 10


def test_the_container_cap_refuses_small_and_large_bodies_before_parsing(fake: Fake, gateway: Gateway) -> None:
    std = fake("std")
    gw = gateway(rules_for([std.url], [std.url]), max_json_containers=5000)

    def post(body: bytes) -> httpx.Response:
        return httpx.post(gw.url + "/v1/chat/completions", content=body, timeout=60)

    messages = [{"role": "user", "content": "[[{{ brackets in text are not containers"}] * 2000
    ok = post(orjson.dumps({"model": MODEL, "messages": messages}))  # 2,002 containers, 10,000 brackets in strings
    assert ok.status_code == 200, ok.text
    for size in (6000, 40_000):  # under and over 1 MiB: on the loop and in the parsing process
        body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}] * size})
        r = post(body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_json"
        assert "more than 5000 arrays and objects" in err["message"]
    long_texts = [{"role": "user", "content": "y" * 5000}] * 300  # 1.5 MB, 302 containers: parsed elsewhere
    r = post(orjson.dumps({"model": MODEL, "messages": long_texts}))
    assert r.status_code == 200, r.text
    assert forwarded(std)["messages"] == long_texts
