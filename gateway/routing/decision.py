"""One request's routing decision, shared by the proxy handler and ``explain``: body → class → attempt plan.

Pure apart from reading the live config and the controllers' state; sends nothing anywhere. Raises the gateway's
client errors (unknown model, no pool for embeddings, bad parameters) exactly as the handler answers them.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.config.schema import RoutingRules, TrafficClass
from gateway.errors import ModelNotFound, RouteNotFound
from gateway.fleet.pools import PoolState
from gateway.routing.classify import ApiKind, Classifier, RequestFeatures, Texts
from gateway.routing.plan import Plan, PoolView, plan_route
from gateway.routing.prompt_hashes import PromptHashes
from gateway.routing.prompt_key import continues, prompt_chunks
from gateway.routing.routing_state import RouteChoice, RoutingState


class RoutingInputs(Protocol):
    """What a decision reads of the config in force (``gateway.runtime.live.LiveConfig`` is one)."""

    @property
    def rules(self) -> RoutingRules: ...
    @property
    def pools(self) -> Mapping[str, PoolState]: ...
    @property
    def classifier(self) -> Classifier: ...
    @property
    def model_set(self) -> frozenset[str]: ...
    def views(self) -> Mapping[str, PoolView]: ...


# Built on every request: not ``frozen`` (a frozen dataclass sets each field through ``object.__setattr__``, five
# times slower to build); never changed once built, and hashed by its fields as a frozen one is.
@dataclass(slots=True, unsafe_hash=True)
class Decision:
    """What the gateway decided for one request, before any attempt."""

    traffic_class: str
    plan: Plan
    stream: bool
    max_attempts: int
    features: RequestFeatures | None = None  # None for embeddings (not classified)
    klass: TrafficClass | None = None
    choice: RouteChoice | None = None  # the class controller's answer; None without a controller
    unknown_model: str | None = None  # the requested model when no pool serves it (the plan is empty)
    served: frozenset[str] = frozenset()  # with unknown_model: the models the pools serve, for the 404's message
    # the prompt's chunk hashes when the decision computed them (a controller pool has prefix affinity on: the
    # attempts record them where the request goes); None: not computed
    prompt: tuple[int, ...] | None = None
    warmth: Mapping[str, int] | None = None  # controller pool → counted warm prefix (tokens); None: not weighed

    def check_model(self) -> None:
        """Raise the 404 for a model no pool serves (after the caller has recorded the class)."""
        if self.unknown_model is not None:
            raise ModelNotFound(not_found(self.unknown_model, self.served), param="model")


MAX_LISTED_MODELS = 20  # a 404's message names at most this many served models


def not_found(model: object, served: Collection[str]) -> str:
    """The 404 message for a model no pool serves, naming the ones served (as ``GET /v1/models`` lists them)."""
    names = sorted(served)
    listed = ", ".join(names[:MAX_LISTED_MODELS]) + (
        f" and {len(names) - MAX_LISTED_MODELS} more" if len(names) > MAX_LISTED_MODELS else ""
    )
    return f"The model `{model}` does not exist. Models served here: {listed or 'none'} (GET /v1/models)."


def decide(
    live: RoutingInputs,
    routing: RoutingState,
    api: ApiKind | None,
    body: Mapping[str, Any],
    task_header: str | None,
    rng: random.Random,
    *,
    count: bool = True,
    texts: Callable[[], Texts] | None = None,
    prompt: tuple[int, ...] | None = None,
    weigh_all: bool = False,
    hashes: PromptHashes | None = None,
) -> Decision:
    """The decision for one parsed request body. ``api`` None: embeddings (one pool, named by the YAML).
    ``count``: the request counts toward its class controller's samples (explain passes False). A model no pool
    serves gives an empty plan with ``unknown_model`` set: ``check_model`` raises the 404. ``texts``: the prompt's
    texts when read elsewhere (a large body, whose ``body`` here holds stand-ins for its bulk); ``prompt``: its
    chunk hashes, taken from the rendering made there; ``hashes``: the process's recent prompts, whose hashes a
    prompt hashed here reuses (``gateway.routing.prompt_hashes``; None: hashed whole). ``weigh_all``: the pools'
    warmth is weighed (and the warm home's verdict kept in the plan) for a request that cannot go to a warm home too
    (explain shows it); else only for one that continues a conversation."""
    if api is None:
        model = body.get("model")
        pool_name = live.rules.embeddings_pool
        if pool_name is None:
            raise RouteNotFound("this gateway has no pool for embeddings")
        if not isinstance(model, str) or model not in live.pools[pool_name].models:
            raise ModelNotFound(not_found(model, live.pools[pool_name].models), param="model")
        plan = Plan((pool_name,), "embeddings") if live.pools[pool_name].routable() else Plan((), "embeddings")
        return Decision("embeddings", plan, stream=False, max_attempts=1)
    c = live.classifier.classify(api, body, task_header, texts)
    f = c.features
    if f.model not in live.model_set:
        empty = Plan((), "model not served")
        return Decision(
            c.traffic_class.name, empty, f.stream, 1, f, c.traffic_class, unknown_model=f.model, served=live.model_set
        )
    choice = routing.choose(c.traffic_class.name, rng, count=count, temperature=f.temperature)
    prompt, warmth, eligible = _warmth(live, api, body, choice, prompt, weigh_all, hashes)
    plan = plan_route(
        c.traffic_class.route,
        f.model,
        live.views(),
        pick=None if choice is None else choice.pick,
        split=choice is not None and choice.state == "split",
        forced=choice is not None and choice.forced,
        by_kind=None if choice is None or not choice.pools else dict(choice.pools),
        probe=choice is not None and choice.why == "probe",
        speeds=None if choice is None else choice.speeds,
        visitor_limit=None if choice is None else choice.visitor_limit,
        why=None if choice is None else choice.why,
        warmth=warmth,
        warm_eligible=eligible,
        away_limit=None if choice is None else choice.away_limit,
    )
    return Decision(
        c.traffic_class.name,
        plan,
        stream=f.stream,
        max_attempts=live.rules.defaults.max_attempts,
        features=f,
        klass=c.traffic_class,
        choice=choice,
        prompt=prompt,
        warmth=warmth,
    )


def _warmth(
    live: RoutingInputs,
    api: ApiKind,
    body: Mapping[str, Any],
    choice: RouteChoice | None,
    hashed: tuple[int, ...] | None = None,
    weigh_all: bool = False,
    hashes: PromptHashes | None = None,
) -> tuple[tuple[int, ...] | None, dict[str, int] | None, bool]:
    """For a class with a controller whose pools have prefix affinity on: the prompt's chunk hashes (the attempts
    record them, so that the next turn finds its prefix), whether the request continues a conversation (it may go
    to its warm home) and, for such a request (or any, ``weigh_all``), each controller pool's counted warm prefix
    of it (only when some index holds anything). Nothing for other requests: they pay no hashing here. A request
    that starts a conversation cannot go to a warm home: its pools' indexes are not searched."""
    if choice is None or not choice.pools:
        return None, None, False
    pools = [p for _, name in choice.pools if (p := live.pools.get(name)) is not None]
    if not any(p.affinity.enabled for p in pools):
        return None, None, False
    if hashed is not None:
        prompt = hashed
    else:
        prompt = prompt_chunks(api, body) if hashes is None else hashes.of_request(api, body)
    if not prompt:
        return prompt, None, False
    eligible = continues(api, body)
    if not (eligible or weigh_all) or not any(p.indexed() for p in pools):
        return prompt, None, False
    return prompt, {p.name: p.warm_tokens(prompt) for p in pools}, eligible
