"""``specgate bench overhead``'s distinct-prompt rows: what prefix affinity costs when every prompt is new.

The other rows send one body again and again: a gateway with prefix affinity would find that prompt's hashes kept
and its chunks the most recent of an index already, which is the cheapest case there is. Most real traffic brings
a prompt never seen before on every request. Here wrk (a Lua script) puts a number no other request of the run
carries at the start of the user message of the same ~2,000-character prompt, so every chunk after the system
prompt is new: the prompt is rendered and hashed whole, kept, and recorded into an index that is full after the
first few hundred requests (the default capacity, 16,384 chunks, is ~512 such prompts).

The targets, measured in turns (``gateway.bench.turns``: one-second rounds, each process's CPU per request from
/proc, req/s ratios as the median of the rounds' ratios to the first target):

- ``minimal-aiohttp``: the simplest pass-through proxy (``gateway.bench.minimal_proxy``);
- ``specgate``: the overhead rows' gateway (one endpoint per pool: prefix affinity has nothing to pick, nothing
  is hashed);
- ``specgate-affinity``: the same rules with two endpoint ids per pool (both the static upstream): every request
  is rendered, hashed, matched against both indexes and recorded into one;
- with ``base_tree`` (a checkout of another commit, for an A/B of a change): ``specgate-affinity-base``, the same
  as ``specgate-affinity`` but importing ``gateway`` from that tree (``PYTHONPATH``) with the same interpreter.

wrk only: the built-in closed loop sends one body.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from gateway.bench.overhead import _BODY, _process, _rules, run_wrk
from gateway.bench.turns import in_turns
from gateway.sim.launch import free_port

_DISTINCT_LUA = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
math.randomseed(os.time() + math.floor(os.clock() * 1000000))
local run = math.random(1, 1000000000)
local n = 0
local head = '{head}'
local tail = '{tail}'
request = function()
  n = n + 1
  return wrk.format(nil, nil, nil, head .. run .. "-" .. n .. " " .. tail)
end
"""
_MARK = "@@N@@"  # where the request's number goes in the body


@dataclass(frozen=True, slots=True)
class DistinctRow:
    """One connection count: each target's mean req/s, CPU us per request, and req/s ratio to minimal-aiohttp."""

    connections: int
    rps: dict[str, float]
    cpu_us: dict[str, float]
    ratios: dict[str, float]
    errors: dict[str, int]


def distinct_script(path: Path, prompt_chars: int) -> None:
    """Write the wrk script that sends the overhead rows' body with a number of its own in each prompt."""
    text = ("lorem ipsum dolor sit amet " * (prompt_chars // 27 + 1))[:prompt_chars]
    body = _BODY.format(stream="false", text=_MARK + text)
    head, tail = body.split(_MARK)
    path.write_text(_DISTINCT_LUA.format(head=head, tail=tail))


def _affinity_rules(upstream_url: str) -> dict[str, object]:
    doc = _rules(upstream_url)
    for pool in doc["pools"]:  # type: ignore[attr-defined]
        ids = [e["id"] for e in pool["endpoints"]]
        pool["endpoints"] = [{"url": upstream_url, "id": f"{i}{suffix}"} for i in ids for suffix in ("", "b")]
    return doc


def bench_distinct(
    connections: list[int], rounds: int, *, prompt_chars: int = 2000, base_tree: Path | None = None
) -> list[DistinctRow]:
    """Every target at every connection count, in turns (module docstring)."""
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="specgate-bench-distinct-") as tmp, contextlib.ExitStack() as stack:
        d = Path(tmp)
        script = d / "distinct.lua"
        distinct_script(script, prompt_chars)
        up_port = free_port()
        up_url = f"http://127.0.0.1:{up_port}"
        stack.enter_context(_process([py, "-m", "gateway.bench.static_upstream", "--port", str(up_port)], up_port))
        plain, affinity = d / "rules.yaml", d / "affinity.yaml"
        plain.write_text(yaml.safe_dump(_rules(up_url), sort_keys=False))
        affinity.write_text(yaml.safe_dump(_affinity_rules(up_url), sort_keys=False))
        targets: dict[str, tuple[list[str], dict[str, str] | None]] = {
            "minimal-aiohttp": ([py, "-m", "gateway.bench.minimal_proxy", "--client", "aiohttp", "--upstream",
                                 up_url], None),
            "specgate": (_serve(py, plain), None),
            "specgate-affinity": (_serve(py, affinity), None),
        }  # fmt: skip
        if base_tree is not None:
            env = {**os.environ, "PYTHONPATH": str(base_tree.resolve())}
            targets["specgate-affinity-base"] = ([py, "-P", *_serve(py, affinity)[1:]], env)  # -P: not the cwd first
        urls: dict[str, str] = {}
        pids: dict[str, int] = {}
        for name, (cmd, extra) in targets.items():
            port = free_port()
            pids[name] = stack.enter_context(_process([*cmd, "--port", str(port)], port, extra)).pid
            urls[name] = f"http://127.0.0.1:{port}/v1/chat/completions"
        rows = []
        for c in connections:
            for url in urls.values():
                run_wrk(url, script, c, 1)  # warm: connection pools, and the indexes filled
            got = in_turns(urls, rounds, pids, lambda url: run_wrk(url, script, c, 1))  # noqa: B023
            rps = {t: sum(r.rps for r in rs) / len(rs) for t, rs in got.samples.items()}
            errors = {t: sum(r.errors for r in rs) for t, rs in got.samples.items()}
            rows.append(DistinctRow(c, rps, got.cpu_us, got.ratios, errors))
    return rows


def _serve(py: str, rules: Path) -> list[str]:
    return [py, "-m", "gateway", "serve", "--rules", str(rules), "--host", "127.0.0.1", "--admin-port", "0"]


def render_distinct(rows: list[DistinctRow], load: tuple[float, float, float] | None = None) -> str:
    """The distinct-prompt table and what affinity adds per request (CPU over specgate's, req/s vs minimal)."""
    lines = [
        "distinct prompts (a new ~2,000-character prompt every request; targets in one-second turns; CPU of each "
        "gateway process per request)" + (f"; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}" if load else ""),
        f"{'conns':>6} {'target':<24}{'req/s':>9}{'vs minimal':>11}{'CPU/request':>13}{'errors':>8}",
    ]
    for r in rows:
        for t, rps in r.rps.items():
            vs = f"{r.ratios[t]:.2f}" if t in r.ratios and t != "minimal-aiohttp" else ""
            cpu = f"{r.cpu_us[t]:.0f}us" if t in r.cpu_us else "-"
            lines.append(f"{r.connections:>6} {t:<24}{rps:>9.0f}{vs:>11}{cpu:>13}{r.errors[t]:>8}")
        base = r.cpu_us.get("specgate")
        for t in (t for t in r.cpu_us if t.startswith("specgate-affinity")):
            if base:
                lines.append(f"{'':>6} prefix affinity's CPU ({t}): {r.cpu_us[t] - base:+.0f} us/request over specgate")
        lines.append("")
    return "\n".join(lines)
