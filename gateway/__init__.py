"""specgate: a traffic-class routing gateway for vLLM (speculative vs standard pools).

One request's path through the packages::

    client -> proxy.app           the dispatcher: a proxied POST goes to proxy.intake, the rest to Starlette
           -> proxy.intake        parse the body once, auth, size limits, request id (proxy.responses: a Responses
                                  API follow-up is pinned to the endpoint holding its conversation)
           -> routing.classify    body + headers + rules -> features -> traffic class         (pure)
           -> routing.decision    class + live pool views + overrides + controller -> Plan  (pure)
           -> proxy.idempotency   only with an Idempotency-Key: claim, or replay / 409 / 422
           -> proxy.forward       attempt loop: fleet.pools picks an endpoint, fleet.upstream sends it;
                                  before the commit point a failure moves on, after it never re-sent
           -> proxy.record        metrics (observability), acceptance, the log line, the stored result

In the background (``runtime.container``): ``fleet.scraper`` and ``fleet.health`` read every endpoint,
``routing.routing_state`` runs the class controllers on what they read, ``overrides`` syncs on-call changes
(``store``: memory or Redis), ``runtime.reload`` swaps in a new routing YAML (``config``). ``admin`` is the
on-call API, ``cli`` the ``specgate`` command; ``sim`` simulates vLLM, ``bench`` and ``report`` measure.
Layers only point down: cli -> admin -> proxy -> runtime -> cluster -> overrides -> routing -> fleet -> config ->
store -> observability (``tests/unit/test_layers.py`` checks it). ``cluster`` makes several replicas act as one.
"""

__version__ = "0.1.0"
