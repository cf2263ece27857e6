"""specgate: a traffic-class routing gateway for vLLM (speculative vs standard pools)."""

__version__ = "0.1.0"
