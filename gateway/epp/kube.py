"""The pools' endpoints from Kubernetes: the InferencePool's pods, watched through the API (``specgate epp
--kube-selector``; the official ``kubernetes`` client, the ``kube`` extra).

A pod is an endpoint while it matches the selector, has an IP, runs, is Ready and is not being deleted. Its pool
is the routing YAML's pool named by its label ``specgate.io/pool``, else the YAML's one pool of the kind its label
``specgate.io/pool-kind`` names (``speculative`` | ``standard``); a pod that names neither (or a kind two pools
share) is left out, with a log line. Its endpoint is ``http://<pod IP>:<port>`` with the pod's name as its id.

The YAML keeps everything else of a pool (models, timeouts, the speculative config); its endpoints are replaced by
the pods'. A pool with no such pod keeps the YAML's endpoints drained (weight 0: the YAML needs one per pool; give
placeholders). Each change builds a new ``LiveConfig`` from the YAML's rules (``previous``: the one in force, so
endpoints that stay keep their state, in-flight counts and health) and swaps it in, as a reload does; a reload of
the YAML itself is followed by the pods being applied again (``KubeEndpoints.run`` notices the swap).

The client is synchronous: the list and watch run in a thread that hands each change to the event loop. A watch
that ends is resumed from the last resourceVersion; one the API no longer has (410) or an error starts over with
a new list after a backoff (1 s doubling to 30 s). At most ``MAX_PODS`` pods are tracked.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.config.pool import Endpoint
from gateway.config.schema import RoutingRules
from gateway.runtime.container import Runtime
from gateway.runtime.live import LiveConfig

logger = logging.getLogger("specgate")

POOL_LABEL = "specgate.io/pool"
KIND_LABEL = "specgate.io/pool-kind"
MAX_PODS = 4096
_WATCH_S = 60  # one watch call, then resumed from the last resourceVersion
_SETTLE_S = 0.2  # changes arriving together are applied once
_RECHECK_S = 1.0  # how often the YAML's own reloads are looked for


@dataclass(frozen=True, slots=True)
class PodEndpoint:
    """One ready pod: its name, IP and the pool labels it carries."""

    name: str
    ip: str
    pool: str | None
    kind: str | None


def pod_endpoint(pod: Any) -> PodEndpoint | None:
    """A ``V1Pod`` as an endpoint, or None while it is not one (no IP, not Running and Ready, being deleted)."""
    meta, status = pod.metadata, pod.status
    if meta is None or status is None or meta.deletion_timestamp is not None:
        return None
    if not status.pod_ip or status.phase != "Running":
        return None
    if not any(c.type == "Ready" and c.status == "True" for c in status.conditions or ()):
        return None
    labels = meta.labels or {}
    return PodEndpoint(str(meta.name), str(status.pod_ip), labels.get(POOL_LABEL), labels.get(KIND_LABEL))


def _url(ip: str, port: int) -> str:
    return f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}"


def assign(rules: RoutingRules, pods: Mapping[str, PodEndpoint], port: int) -> RoutingRules:
    """The YAML's rules with each pool's endpoints replaced by its pods' (sorted by name; none: drained)."""
    by_kind: dict[str, list[str]] = {}
    for p in rules.pools:
        by_kind.setdefault(p.kind, []).append(p.name)
    names = {p.name for p in rules.pools}
    members: dict[str, list[PodEndpoint]] = {name: [] for name in names}
    for pod in sorted(pods.values(), key=lambda e: e.name):
        if pod.pool in names:
            members[str(pod.pool)].append(pod)
        elif pod.kind is not None and len(by_kind.get(pod.kind, ())) == 1:
            members[by_kind[pod.kind][0]].append(pod)
    pools = []
    for p in rules.pools:
        found = members[p.name]
        if found:
            # the pod's name as the id (a Kubernetes name may be longer than an id: then the address is the id)
            endpoints = [Endpoint(url=_url(e.ip, port), id=e.name if len(e.name) <= 63 else None) for e in found]
        else:
            endpoints = [e.model_copy(update={"weight": 0.0}) for e in p.endpoints]
        pools.append(p.model_copy(update={"endpoints": endpoints}))
    return rules.model_copy(update={"pools": pools})


def unassigned(rules: RoutingRules, pods: Mapping[str, PodEndpoint]) -> list[str]:
    """The ready pods no pool takes (no label, an unknown pool, a kind two pools share)."""
    names = {p.name for p in rules.pools}
    kinds: dict[str, int] = {}
    for p in rules.pools:
        kinds[p.kind] = kinds.get(p.kind, 0) + 1
    return sorted(
        e.name for e in pods.values() if e.pool not in names and not (e.kind is not None and kinds.get(e.kind) == 1)
    )


class PodWatcher:
    """List and watch the pods of ``namespace`` matching ``selector`` in a thread; ``pods`` holds the ready ones;
    ``on_change`` is called on the event loop after each change."""

    def __init__(self, api_client: Any, namespace: str, selector: str, loop: asyncio.AbstractEventLoop) -> None:
        from kubernetes import client  # the kube extra

        self.core = client.CoreV1Api(api_client)
        self.namespace, self.selector, self.loop = namespace, selector, loop
        self.pods: dict[str, PodEndpoint] = {}
        self.changed = asyncio.Event()
        self.synced = asyncio.Event()  # the first list is in
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: Any = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="specgate-kube-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def _publish(self, pods: dict[str, PodEndpoint], synced: bool) -> None:
        def apply() -> None:
            self.pods = pods
            self.changed.set()
            if synced:
                self.synced.set()

        self.loop.call_soon_threadsafe(apply)

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        backoff = 1.0
        while not self._stop.is_set():
            try:
                pods, version = self._list()
                self._publish(dict(pods), synced=True)
                backoff = 1.0
                while not self._stop.is_set():
                    self._watch = watch.Watch()  # type: ignore[no-untyped-call]
                    stream = self._watch.stream(
                        self.core.list_namespaced_pod,
                        self.namespace,
                        label_selector=self.selector,
                        resource_version=version,
                        timeout_seconds=_WATCH_S,
                        allow_watch_bookmarks=True,
                    )
                    for event in stream:
                        version = self._on_event(event, pods) or version
                        if self._stop.is_set():
                            break
                    version = self._watch.resource_version or version
            except ApiException as exc:
                if exc.status != 410:
                    logger.warning("kubernetes pods watch: %s %s", exc.status, exc.reason)
            except Exception as exc:
                logger.warning("kubernetes pods watch failed: %r", exc)
            if self._stop.wait(backoff):
                return
            backoff = min(30.0, backoff * 2)

    def _list(self) -> tuple[dict[str, PodEndpoint], str]:
        found = self.core.list_namespaced_pod(self.namespace, label_selector=self.selector, limit=MAX_PODS)
        pods: dict[str, PodEndpoint] = {}
        for pod in found.items or ():
            ep = pod_endpoint(pod)
            if ep is not None:
                pods[ep.name] = ep
        meta = found.metadata
        return pods, str(meta.resource_version if meta is not None else "")

    def _on_event(self, event: Mapping[str, Any], pods: dict[str, PodEndpoint]) -> str | None:
        kind, pod = event.get("type"), event.get("object")
        if kind == "BOOKMARK" or pod is None or getattr(pod, "metadata", None) is None:
            meta = getattr(pod, "metadata", None)
            return str(meta.resource_version) if meta is not None and meta.resource_version else None
        name = str(pod.metadata.name)
        ep = None if kind == "DELETED" else pod_endpoint(pod)
        before = pods.get(name)
        if ep is None:
            pods.pop(name, None)
        elif name in pods or len(pods) < MAX_PODS:
            pods[name] = ep
        else:
            logger.warning("kubernetes pods watch: more than %d pods match %r; %s left out", MAX_PODS, self.selector,
                           name)  # fmt: skip
        if pods.get(name) != before:
            self._publish(dict(pods), synced=False)
        version = pod.metadata.resource_version
        return str(version) if version else None


_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def api_client() -> Any:
    """The API client: in a pod its service account, else the local kubeconfig (``KUBECONFIG``)."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]
    return client.ApiClient()


def own_namespace() -> str:
    """The namespace this pod runs in (its service account's), else ``default``."""
    try:
        with open(_NAMESPACE_FILE) as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


class KubeEndpoints:
    """Keeps ``rt.live``'s pool endpoints equal to the watched pods (see the module's text)."""

    def __init__(self, rt: Runtime, watcher: PodWatcher, port: int) -> None:
        self.rt, self.watcher, self.port = rt, watcher, port
        self.yaml: LiveConfig = rt.live  # the config the YAML made (before the pods were applied to it)
        self.applied: LiveConfig | None = None  # the last config built here
        self._unassigned: list[str] = []

    def apply(self) -> None:
        rt = self.rt
        if rt.live is not self.applied:
            self.yaml = rt.live  # a reload of the YAML swapped in its own config
        rules = assign(self.yaml.rules, self.watcher.pods, self.port)
        missing = unassigned(self.yaml.rules, self.watcher.pods)
        if missing != self._unassigned:
            if missing:
                logger.warning("pods without a pool (label %s or %s): %s", POOL_LABEL, KIND_LABEL, ", ".join(missing))
            self._unassigned = missing
        old = rt.live
        new = LiveConfig.build(rules, self.yaml.source, self.yaml.text, previous=old)
        rt.live = new
        self.applied = new
        rt.reloader.retirer.retire([c for n, c in old.clients.items() if new.clients.get(n) is not c], old.pools)

    async def run(self) -> None:
        """Apply the pods on every change, and after every reload of the YAML (until cancelled)."""
        while True:
            try:
                await asyncio.wait_for(self.watcher.changed.wait(), _RECHECK_S)
                await asyncio.sleep(_SETTLE_S)
            except TimeoutError:
                if self.rt.live is self.applied or not self.watcher.synced.is_set():
                    continue
            self.watcher.changed.clear()
            if self.watcher.synced.is_set():
                try:
                    self.apply()
                except Exception:
                    logger.exception("applying the pods' endpoints failed; the config in force is kept")
