"""The vLLM endpoints behind the gateway: their state, the client that talks to them, and what they report.

- ``pools``: ``PoolState`` / ``EndpointState``: weights, health, ejection, in-flight counts, the endpoint pick.
- ``prefix_index``: per endpoint, the chunk hashes of the prompts sent there (LRU, bounded);
  ``affinity``: the load-bounded warm pick that ``PoolState.pick`` tries first.
- ``h1client``: a lean HTTP/1.1 client (asyncio + httptools) with keep-alive pools and bounded reads
  (``h1response``: its response, body decoding and limits, and its errors);
  ``upstream``: one per pool (``PoolClient``), its failures mapped onto the gateway's errors.
- ``health``: active ``GET /health`` checks; ``scraper``: the ``/metrics`` scrape loop;
  ``vllm_exposition``: vLLM's Prometheus text → one sample (pure); ``vllm_metrics``: samples → endpoint and pool
  load (pure).
"""
