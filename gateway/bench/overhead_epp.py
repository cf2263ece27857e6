"""The EPP path of ``specgate bench overhead``: Envoy alone and Envoy + ``specgate epp`` in front of the same static
upstream, measured in the same run as the proxy mode.

``envoy``: the shipped Envoy config without its ext_proc filter (round robin to the upstream); ``envoy-epp``: the
same Envoy asking ``specgate epp`` (one process, the bench's routing YAML) for every request. The picker's cost
is ``envoy-epp`` minus ``envoy``. Where the Envoy binary or the epp extra is missing, the targets are left out
and the report says why.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import yaml

from gateway.bench.envoy import envoy_binary, envoy_command, render_envoy
from gateway.sim.launch import free_port


class _Measured(Protocol):
    @property
    def rps(self) -> float: ...
    @property
    def p50_s(self) -> float: ...
    @property
    def p99_s(self) -> float: ...


class _Row(Protocol):
    """What the EPP section reads of one measured row (``gateway.bench.overhead.OverheadRow``)."""

    @property
    def mode(self) -> str: ...
    @property
    def connections(self) -> int: ...
    @property
    def results(self) -> Mapping[str, _Measured]: ...


EPP_TARGETS = ("envoy", "envoy-epp")
TARGET_EPP_RPS_32 = 1500  # one picker process, through Envoy, 32 connections, everything on the 2-core machine
TARGET_EPP_ADDED_P50_MS = 2.0  # over Envoy alone, 1 connection


Starter = Callable[[list[str], int], contextlib.AbstractContextManager[object]]


@contextlib.contextmanager
def start_epp_targets(workdir: Path, rules: Path, upstream_url: str, start: Starter) -> Iterator[dict[str, str]]:
    """Envoy alone and Envoy + ``specgate epp`` as processes (``start(cmd, port)`` runs one until the block ends);
    yields their base URLs."""
    binary = envoy_binary()
    assert binary is not None
    epp_port = free_port()
    with contextlib.ExitStack() as stack:
        epp_cmd = [sys.executable, "-m", "gateway", "epp", "--rules", str(rules), "--host", "127.0.0.1"]
        epp_cmd += ["--port", str(epp_port), "--admin-port", "0", "--metrics-port", "0"]
        stack.enter_context(start(epp_cmd, epp_port))
        urls: dict[str, str] = {}
        for target, picker in (("envoy", None), ("envoy-epp", epp_port)):
            port = free_port()
            config = render_envoy(port, free_port(), picker, [upstream_url])
            path = workdir / f"{target}.yaml"
            path.write_text(yaml.safe_dump(config, sort_keys=False))
            stack.enter_context(start(envoy_command(binary, path), port))
            urls[target] = f"http://127.0.0.1:{port}"
        yield urls


def render_epp(rows: Sequence[_Row], skipped: str | None) -> list[str]:
    """The EPP section: req/s per connection count, the picker's added latency over Envoy alone, the targets."""
    if skipped is not None:
        return [f"EPP path (Envoy + specgate epp): not measured: {skipped}"]
    if not any("envoy-epp" in r.results for r in rows):
        return []
    out = ["EPP path, non-streaming (added: Envoy + specgate epp over Envoy alone):"]
    head = f"{'conns':>6} {'envoy req/s':>12}{'+epp req/s':>12}{'proxy req/s':>12}{'added p50':>11}{'added p99':>11}"
    out += [head, "-" * len(head)]
    verdicts: list[str] = []
    for r in rows:
        if r.mode != "json" or "envoy-epp" not in r.results:
            continue
        env, epp, proxy = r.results["envoy"], r.results["envoy-epp"], r.results["specgate"]
        added50 = (epp.p50_s - env.p50_s) * 1000
        added99 = (epp.p99_s - env.p99_s) * 1000
        out.append(
            f"{r.connections:>6} {env.rps:>12.0f}{epp.rps:>12.0f}{proxy.rps:>12.0f}{added50:>9.2f}ms{added99:>9.2f}ms"
        )
        if r.connections == 1:
            ok = added50 <= TARGET_EPP_ADDED_P50_MS
            verdicts.append(f"  EPP added p50, 1 connection: {added50:.2f} ms (target <= {TARGET_EPP_ADDED_P50_MS} "
                            f"ms): {'met' if ok else 'NOT met'}")  # fmt: skip
        if r.connections == 32:
            ok = epp.rps >= TARGET_EPP_RPS_32
            verdicts.append(f"  EPP req/s through Envoy, 32 connections: {epp.rps:.0f} (target >= "
                            f"{TARGET_EPP_RPS_32}): {'met' if ok else 'NOT met'}")  # fmt: skip
    return [*out, "", *verdicts]
