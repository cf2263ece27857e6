"""What the route changes of the controlled classes leave behind: the route state's metrics (the families of
``gateway.observability.metrics_routes``), a log line on the ``specgate.controller`` logger, or the owner's callback
(the audit log, which records it in one line).

- a transition: ``specgate_controller_transitions_total{class,from,to,reason}``, the
  ``specgate_class_route_state{class,state}`` gauge, ``on_transition`` or a ``controller_transition`` line;
- a share step within ``split``: ``specgate_class_speculative_share`` and a ``controller_step`` line;
- a probe change (probing starts or stops): ``specgate_class_probe_share``, ``on_probe`` or a ``controller_probe``
  line; each probe sent counts in ``specgate_controller_probes_total{class}``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from gateway.observability.logs import log_event
from gateway.observability.metrics_routes import RouteMetrics
from gateway.routing.class_track import ProbeChange
from gateway.routing.controller import Controller, Transition
from gateway.routing.controller_rules import ControllerState

logger = logging.getLogger("specgate.controller")

STATES: tuple[ControllerState, ...] = ("speculative", "split", "standard")


class RouteEvents:
    """Records the route changes of the controlled classes of one routing state."""

    def __init__(
        self,
        registry: CollectorRegistry,
        on_transition: Callable[[Transition], object] | None = None,
        on_probe: Callable[[ProbeChange], object] | None = None,
    ) -> None:
        self.metrics = RouteMetrics(registry)
        self._on_transition = on_transition
        self._on_probe = on_probe

    def transition(self, t: Transition) -> None:
        m = self.metrics
        m.transitions.labels(t.class_name, t.from_state, t.to_state, t.reason).inc()
        self.set_state(t.class_name, t.to_state, t.share)
        if self._on_transition is not None:  # its owner records it (the audit log, one line): not logged twice
            self._on_transition(t)
            return
        line = {
            "class": t.class_name,
            "from": t.from_state,
            "to": t.to_state,
            "reason": t.reason,
            "share": t.share,
            "at": t.at,
            "detail": t.detail,
        }
        log_event(logger, "controller_transition", line)

    def step(self, class_name: str, before: float, controller: Controller) -> None:
        """A share step within ``split``: the share gauge and a log line (not a transition)."""
        self.metrics.share.labels(class_name).set(controller.share)
        snap = controller.snapshot()
        line = {
            "class": class_name,
            "share_from": before,
            "share": controller.share,
            "reason": snap.last_reason,
            "at": snap.share_since,
        }
        log_event(logger, "controller_step", line)

    def probe_changed(self, class_name: str, share: float, now: float) -> None:
        """Probing started (``share`` > 0) or stopped: the gauge, and ``on_probe`` or a log line."""
        self.metrics.probe_share.labels(class_name).set(share)
        detail = "acceptance never measured and the speculative pool has headroom" if share > 0 else "probing stopped"
        change = ProbeChange(class_name, share, now, detail)
        if self._on_probe is not None:  # its owner records it (the audit log, one line): not logged twice
            self._on_probe(change)
            return
        log_event(logger, "controller_probe", {"class": class_name, "share": share, "at": now, "detail": detail})

    def probe_sent(self, class_name: str) -> None:
        self.metrics.probes.labels(class_name).inc()

    def set_state(self, class_name: str, state: ControllerState, share: float) -> None:
        """The route-state gauges of the class: 1 for ``state``, 0 for the others, and its share."""
        for s in STATES:
            self.metrics.route_state.labels(class_name, s).set(1 if s == state else 0)
        self.metrics.share.labels(class_name).set(share)

    def forget(self, class_name: str) -> None:
        """A class that lost its controller: its gauges go."""
        m = self.metrics
        for s in STATES:
            m.route_state.remove(class_name, s)
        m.share.remove(class_name)
        with contextlib.suppress(KeyError):
            m.probe_share.remove(class_name)
