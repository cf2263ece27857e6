"""The checks and the report of ``specgate bench soak`` (``gateway.bench.soak``): its settings, the samples taken
every second, the ejections the gateway logged, and what the clients and the gateway's access log say about each
request.

Checks (``Report.problems``; none = pass):

- every request exactly one terminal outcome: no request id in the access log twice or unknown to the clients;
  every request the clients got an HTTP answer for is in the log; a request that failed on the client's side
  (``client_exception``: refused or reset, possibly before the gateway read it) may or may not be; the gateway's
  ``specgate_requests_total`` grew by exactly the number of lines in its access log;
- no stream ended without ``[DONE]`` or an error event (``broken``);
- the in-flight gauges are back to 0 at the end;
- RSS grew less than ``max_rss_growth`` from the end of the warm-up (the first ``warmup_share`` of the run) to the
  end; open file descriptors are back within a few of the start once idle connections have closed;
- no endpoint was ejected outside the fault windows (an endpoint that was only busy is never ejected); a window
  lasts until the fault's effects can have passed: ``effect_s`` after its end (a hung request's first token, a
  restarted server's first health check).
"""

from __future__ import annotations

import calendar
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import orjson

FD_SLACK = 10  # descriptors the gateway may hold open after the run beyond those at the start (logs, the loop's own)
EJECTED = re.compile(r"endpoint (\S+) ejected for")


@dataclass(frozen=True, slots=True)
class SoakConfig:
    rules: Path = Path("routing_rules/default.yaml")
    streams: int = 1000
    duration_s: float = 600.0
    time_scale: float = 0.05
    max_num_seqs: int = 256
    max_tokens: int = 48
    stall_share: float = 0.01  # of the requests: a client that stops reading a long answer
    stall_tokens: int = 30000
    send_timeout_s: float = 2.0  # the gateway's overload.client_send_timeout_s for the run
    faults: bool = True
    redis: bool = False
    warmup_share: float = 0.2
    max_rss_growth: float = 0.10
    sample_s: float = 1.0
    settle_s: float = 6.0  # after the run, before the last sample: idle keep-alive connections close
    effect_s: float = 5.0  # a fault's effects may be seen this long after its window ends
    seed: int = 11


@dataclass(slots=True)
class Sample:
    t: float
    rss_kb: int
    fds: int
    in_flight: float
    ejections: float
    requests: float


@dataclass(slots=True)
class Ejection:
    at: float  # seconds since the start (when the sampler saw it)
    endpoint: str = ""  # pool/endpoint, from the gateway's log
    why: str = ""  # the log line's account of the failures


@dataclass(slots=True)
class Report:
    config: SoakConfig
    samples: list[Sample] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    sent: int = 0
    counted: float = 0.0  # the gateway's specgate_requests_total growth
    final_in_flight: float = float("nan")
    windows: list[tuple[float, float, str]] = field(default_factory=list)  # seconds, fault
    ejected_at: list[float] = field(default_factory=list)
    ejections: list[Ejection] = field(default_factory=list)
    answered: set[str] = field(default_factory=set)  # request ids the clients got an HTTP answer for
    failed: set[str] = field(default_factory=set)  # request ids that failed on the client's side
    logged: Counter[str] = field(default_factory=Counter)  # request id -> access-log lines
    log_read: bool = False  # the access log was read (else the per-request checks are not made)
    problems: list[str] = field(default_factory=list)

    def rss_at(self, t: float) -> int:
        before = [s.rss_kb for s in self.samples if s.t <= t]
        return before[-1] if before else (self.samples[0].rss_kb if self.samples else 0)

    def check(self) -> None:
        c = self.config
        self._check_terminal()
        if self.outcomes.get("broken"):
            self.problems.append(f"{self.outcomes['broken']} stream(s) ended without [DONE] or an error event")
        if self.final_in_flight != 0:
            self.problems.append(f"in-flight gauges at the end: {self.final_in_flight:g} (expected 0)")
        if self.samples:
            warm, end = self.rss_at(c.duration_s * c.warmup_share), self.samples[-1].rss_kb
            if warm and (end - warm) / warm >= c.max_rss_growth:
                self.problems.append(f"RSS grew {100 * (end - warm) / warm:.1f}% after warm-up ({warm} -> {end} kB)")
        if len(self.samples) > 1 and self.samples[-1].fds > self.samples[0].fds + FD_SLACK:
            self.problems.append(f"open fds: {self.samples[0].fds} at the start, {self.samples[-1].fds} at the end")
        for at in self.ejected_at:
            if not any(start - 1.0 <= at <= end + c.effect_s for start, end, _ in self.windows):
                self.problems.append(f"an endpoint was ejected at {at:.1f}s, outside every fault window")

    def _check_terminal(self) -> None:
        """Every request exactly one terminal outcome, by request id (client side vs the gateway's access log)."""
        if not self.log_read:
            self.problems.append("the gateway's access log could not be read: the per-request checks were not made")
            return
        twice = [rid for rid, n in self.logged.items() if n > 1]
        if twice:
            self.problems.append(f"{len(twice)} request(s) logged more than once by the gateway, e.g. {twice[0]}")
        unknown = [rid for rid in self.logged if rid not in self.answered and rid not in self.failed]
        if unknown:
            self.problems.append(
                f"{len(unknown)} request(s) in the gateway's log that no client sent, e.g. {unknown[0]}"
            )
        missing = [rid for rid in self.answered if rid not in self.logged]
        if missing:
            self.problems.append(
                f"{len(missing)} answered request(s) missing from the gateway's log, e.g. {missing[0]}"
            )
        lines = sum(self.logged.values())
        if abs(self.counted - lines) > 0.5:
            self.problems.append(
                f"the gateway's specgate_requests_total grew by {self.counted:g}, its access log has {lines} lines"
            )

    def render(self) -> str:
        c, s = self.config, self.samples
        lines = [
            f"soak: {c.streams} streams for {c.duration_s:g}s through {c.rules} "
            f"({c.stall_share:.0%} of requests stop reading; faults {'on' if c.faults else 'off'})",
            f"requests sent {self.sent}, counted by the gateway {self.counted:g} "
            f"(access log: {sum(self.logged.values())} lines; client-side failures {len(self.failed)}, "
            f"{sum(1 for r in self.failed if r in self.logged)} of them seen by the gateway)",
            "outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items())),
            "faults: " + (", ".join(f"{n} {a:.0f}-{b:.0f}s" for a, b, n in self.windows) or "none"),
        ]
        if s:
            warm = self.rss_at(c.duration_s * c.warmup_share)
            lines += [
                f"RSS kB: start {s[0].rss_kb}, after warm-up {warm}, end {s[-1].rss_kb}, "
                f"peak {max(x.rss_kb for x in s)}",
                f"open fds: start {s[0].fds}, end {s[-1].fds}, peak {max(x.fds for x in s)}",
                f"in flight: peak {max(x.in_flight for x in s):g}, at the end {self.final_in_flight:g}",
                f"ejections: {len(self.ejected_at)}" + (f" at {self.ejected_at}" if self.ejected_at else ""),
                *(f"  ejected {e.endpoint} at {e.at:.1f}s: {e.why}" for e in self.ejections),
                "timeline (t s, RSS kB, fds, in flight): "
                + "; ".join(f"{x.t:.0f} {x.rss_kb} {x.fds} {x.in_flight:g}" for x in s[:: max(1, len(s) // 12)]),
            ]
        lines.append("PASS" if not self.problems else "FAIL: " + "; ".join(self.problems))
        return "\n".join(lines)


def read_gateway_log(path: Path, report: Report, wall0: float) -> None:
    """The gateway's side from its log: access lines per request id, and each ejection (``wall0``: the wall-clock
    time of the run's start, for the ejections' times)."""
    with path.open("rb") as f:
        for raw in f:
            try:
                line = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue  # a line not written by the gateway's logger
            if not isinstance(line, dict):
                continue
            if line.get("event") == "request":
                report.logged[str(line.get("request_id"))] += 1
                continue
            message = str(line.get("message", ""))
            m = EJECTED.search(message)
            if m is not None:
                report.ejections.append(Ejection(_log_time(str(line.get("ts", ""))) - wall0, m.group(1), message))
    report.log_read = True


def _log_time(ts: str) -> float:
    """The epoch seconds of a log line's ``ts`` (UTC, ``2026-12-01T19:29:04.048Z``); nan when unreadable."""
    try:
        whole, _, ms = ts.rstrip("Z").partition(".")
        return calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S")) + int(ms or 0) / 1000
    except ValueError:
        return float("nan")
