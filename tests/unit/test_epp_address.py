"""An endpoint URL as the ``ip:port`` Envoy's override-host load balancing expects (the fast path and urlsplit's)."""

from __future__ import annotations

import pytest

from gateway.epp.pick import address


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://10.0.0.5:8000", "10.0.0.5:8000"),
        ("http://10.0.0.5:8000/", "10.0.0.5:8000"),
        ("http://10.0.0.5:8000/v1?x=1", "10.0.0.5:8000"),
        ("https://Pod-1.Example:8443/", "pod-1.example:8443"),
        ("http://10.0.0.5/", "10.0.0.5:80"),
        ("https://10.0.0.5", "10.0.0.5:443"),
        ("http://[fd00::5]:8000/", "[fd00::5]:8000"),
        ("http://user@10.0.0.5:8000/", "10.0.0.5:8000"),
        ("http://10.0.0.5:08000", "10.0.0.5:8000"),
    ],
)
def test_address(url: str, expected: str) -> None:
    assert address(url) == expected
