"""``specgate epp``'s gRPC process settings: set before gRPC is imported, never over an operator's own."""

from __future__ import annotations

import sys

import pytest

from gateway.epp.tuning import GRPC_EXPERIMENTS, prefer_poller_io


def test_the_event_engine_io_is_turned_off_before_grpc_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "grpc", raising=False)
    env: dict[str, str] = {}
    assert prefer_poller_io(env) is True
    assert env == {"GRPC_EXPERIMENTS": GRPC_EXPERIMENTS}
    assert "-event_engine_listener" in GRPC_EXPERIMENTS.split(",")


def test_an_operators_setting_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "grpc", raising=False)
    env = {"GRPC_EXPERIMENTS": ""}
    assert prefer_poller_io(env) is False
    assert env == {"GRPC_EXPERIMENTS": ""}


def test_too_late_once_grpc_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "grpc", sys)  # any module object: only its presence counts
    env: dict[str, str] = {}
    assert prefer_poller_io(env) is False
    assert env == {}
