"""Hot reload (gateway.runtime.reload, .watch): the watcher's change detection, Runtime.reload's results, the admin
routes."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.admin.app import create_admin_app
from gateway.config.settings import Settings
from gateway.proxy.app import create_app
from gateway.runtime.container import Runtime
from gateway.runtime.live import LiveConfig, config_digest
from gateway.runtime.watch import ConfigWatcher, file_signature
from tests.conftest import rules_for

TOKEN = "reload-test-token"


# -- the watcher -----------------------------------------------------------------------------------------------


async def _never() -> None:
    raise AssertionError("poll() only")


def watcher(path: Path, in_force: str, *, recheck_every: int = 1000) -> ConfigWatcher:
    digest = config_digest(in_force)
    return ConfigWatcher(path, _never, lambda: digest, recheck_every=recheck_every)


def test_the_first_poll_compares_with_the_config_in_force(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text("a: 1\n")
    assert not watcher(path, "a: 1\n").poll()
    assert watcher(path, "a: 0\n").poll()  # changed between the load and the watcher's start


def test_an_edit_in_place_is_seen_once(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text("a: 1\n")
    w = watcher(path, "a: 1\n")
    assert not w.poll()
    inode = path.stat().st_ino
    with path.open("r+") as f:  # same inode, same size
        f.write("a: 2\n")
    assert path.stat().st_ino == inode
    assert w.poll()
    assert not w.poll()
    assert w.changes == 1


def test_rewriting_the_same_content_is_no_change(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text("a: 1\n")
    w = watcher(path, "a: 1\n")
    assert not w.poll()
    path.write_text("a: 1\n")
    os.utime(path, ns=(1, 1))  # a new mtime: the signature changed, the hash did not
    assert not w.poll()


def test_an_atomic_rename_is_seen(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text("a: 1\n")
    w = watcher(path, "a: 1\n")
    assert not w.poll()
    tmp = tmp_path / ".rules.yaml.tmp"
    tmp.write_text("a: 2\n")
    st = path.stat()
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime: only the inode tells
    os.replace(tmp, path)
    assert w.poll()


def _configmap_version(root: Path, name: str, text: str) -> None:
    """What the kubelet does: a new timestamped directory, ``..data`` swapped to it by a rename, old one removed."""
    new = root / name
    new.mkdir()
    (new / "rules.yaml").write_text(text)
    tmp = root / "..data_tmp"
    tmp.symlink_to(name)
    os.replace(tmp, root / "..data")


def test_a_configmap_double_symlink_swap_is_seen(tmp_path: Path) -> None:
    _configmap_version(tmp_path, "..2024_01_01_00_00_00.1", "a: 1\n")
    path = tmp_path / "rules.yaml"
    path.symlink_to("..data/rules.yaml")
    w = watcher(path, "a: 1\n")
    assert not w.poll()
    before = file_signature(path)
    assert before is not None
    _configmap_version(tmp_path, "..2024_01_01_00_01_00.2", "a: 2\n")  # same size
    for f in (tmp_path / "..2024_01_01_00_01_00.2").iterdir():
        os.utime(f, ns=(before.mtime_ns, before.mtime_ns))
    (tmp_path / "..2024_01_01_00_00_00.1" / "rules.yaml").unlink()
    (tmp_path / "..2024_01_01_00_00_00.1").rmdir()
    after = file_signature(path)
    assert after is not None
    assert after.realpath != before.realpath
    assert w.poll()
    assert not w.poll()


def test_a_half_written_file_is_handed_on_then_again_once_complete(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text("a: 1\n")
    w = watcher(path, "a: 1\n")
    assert not w.poll()
    with path.open("w") as f:
        f.write("pools:\n  - name: sp")
        f.flush()
        assert w.poll()  # handed on (validation rejects it)
        f.write("ec\n")
    assert w.poll()  # complete: handed on again


def test_a_missing_file_is_no_change_and_its_return_is(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text("a: 1\n")
    w = watcher(path, "a: 1\n")
    assert not w.poll()
    path.unlink()
    assert not w.poll()
    path.write_text("a: 2\n")
    assert w.poll()


def test_the_recheck_reads_the_file_even_with_the_same_signature(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text("a: 1\n")
    w = watcher(path, "a: 1\n", recheck_every=3)
    assert not w.poll()  # poll 1
    st = path.stat()
    with path.open("r+") as f:
        f.write("a: 2\n")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # a coarse-mtime filesystem: nothing in the signature
    assert not w.poll()  # poll 2: signature unchanged
    assert w.poll()  # poll 3: the recheck


# -- Runtime.reload ----------------------------------------------------------------------------------------------


def _rules(**kw: Any) -> dict[str, Any]:
    return rules_for(["http://127.0.0.1:9"], ["http://127.0.0.1:10"], **kw)  # nothing listens; never called


def _write(path: Path, rules: dict[str, Any]) -> None:
    path.write_text(yaml.safe_dump(rules, sort_keys=False))


@pytest.fixture
async def rt(tmp_path: Path) -> AsyncIterator[Runtime]:
    path = tmp_path / "rules.yaml"
    _write(path, _rules())
    runtime: Runtime = create_app(Settings(rules=path)).state.runtime
    runtime.reloader.retirer.min_grace_s = 0.0
    runtime.reloader.retirer.check_s = 0.01
    yield runtime
    await runtime.reloader.stop()
    for c in runtime.live.clients.values():
        await c.close()


def _metric(rt: Runtime, name: str, **labels: str) -> float | None:
    return rt.metrics.registry.get_sample_value(name, labels)


def _with_class(rules: dict[str, Any], name: str = "bulk") -> dict[str, Any]:
    new = {"name": name, "when": {"temperature": {"gte": 1.5}}, "route": {"preferred": "std"}}
    rules["classes"].insert(1, new)
    return rules


async def test_the_same_file_is_unchanged_and_swaps_nothing(rt: Runtime) -> None:
    live = rt.live
    r = await rt.reload("admin")
    assert r.result == "unchanged"
    assert rt.live is live
    assert r.hash == live.digest == r.previous_hash
    assert _metric(rt, "specgate_config_reload_total", result="unchanged") == 1
    assert rt.audit.records()[-1].action == "config_reload"


async def test_a_valid_change_is_swapped_with_metrics_audit_and_config_info(
    rt: Runtime, caplog: pytest.LogCaptureFixture
) -> None:
    old = rt.live
    _write(rt.settings.rules, _with_class(_rules()))
    with caplog.at_level(logging.INFO, logger="specgate"):
        r = await rt.reload("sighup")
    assert r.result == "ok", r
    new = rt.live
    assert new is not old
    assert [c.name for c in new.rules.classes] == ["precise", "bulk", "default"]
    assert r.hash == new.digest != old.digest == r.previous_hash
    assert new.text == rt.settings.rules.read_text()
    # unchanged pools keep their client (open connections) and endpoint state
    assert new.clients["spec"] is old.clients["spec"]
    assert new.pools["spec"].endpoints[0] is old.pools["spec"].endpoints[0]
    assert _metric(rt, "specgate_config_reload_total", result="ok") == 1
    assert _metric(rt, "specgate_config_info", version="1", hash=new.digest) == 1
    assert _metric(rt, "specgate_config_info", version="1", hash=old.digest) is None
    rec = rt.audit.records()[-1]
    assert (rec.actor, rec.action, rec.detail["result"]) == ("signal", "config_reload", "ok")
    assert any("config reload (sighup): loaded" in m for m in caplog.messages)


async def test_an_invalid_file_changes_nothing_and_names_every_error(
    rt: Runtime, caplog: pytest.LogCaptureFixture
) -> None:
    old = rt.live
    bad = _rules()
    bad["classes"][0]["route"]["preferred"] = "nope"
    bad["pools"][0]["max_connections"] = -1
    _write(rt.settings.rules, bad)
    with caplog.at_level(logging.ERROR, logger="specgate"):
        r = await rt.reload("watch")
    assert r.result == "invalid"
    assert rt.live is old
    assert r.hash == old.digest
    paths = [i.path for i in r.issues]
    assert "pools[0].max_connections" in paths
    assert all(i.line is not None for i in r.issues)
    assert _metric(rt, "specgate_config_reload_total", result="invalid") == 1
    assert _metric(rt, "specgate_config_info", version="1", hash=old.digest) == 1
    assert any("pools[0].max_connections" in m for m in caplog.messages)
    rec = rt.audit.records()[-1]
    assert rec.actor == "watcher"
    assert rec.detail["result"] == "invalid"
    assert rec.detail["errors"]
    # a broken YAML too
    rt.settings.rules.write_text("pools: [\n")
    r = await rt.reload("watch")
    assert r.result == "invalid"
    assert r.issues[0].line is not None
    assert rt.live is old


async def test_an_unreadable_file_is_invalid(rt: Runtime) -> None:
    old = rt.live
    rt.settings.rules.unlink()
    r = await rt.reload("admin")
    assert r.result == "invalid"
    assert "cannot read the file" in r.issues[0].message
    assert rt.live is old


async def test_a_failure_while_building_is_an_error_and_changes_nothing(
    rt: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = rt.live

    def boom(*a: Any, **kw: Any) -> LiveConfig:
        raise RuntimeError("boom")

    monkeypatch.setattr(LiveConfig, "build", boom)
    _write(rt.settings.rules, _with_class(_rules()))
    r = await rt.reload("admin")
    assert r.result == "error"
    assert "boom" in r.message
    assert rt.live is old
    assert _metric(rt, "specgate_config_reload_total", result="error") == 1


async def test_dropped_overrides_are_reported(rt: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    dropped = [{"id": "ovr_000000000001", "kind": "drain", "pool": "gone"}]
    monkeypatch.setattr(rt, "apply_overrides", lambda: dropped)
    _write(rt.settings.rules, _with_class(_rules()))
    r = await rt.reload("admin")
    assert r.result == "ok"
    assert r.as_dict()["dropped_overrides"] == dropped
    assert "dropped 1 override" in r.message


async def test_a_replaced_pool_client_is_closed_only_when_its_requests_are_done(rt: Runtime) -> None:
    old = rt.live
    ep = old.pools["std"].endpoints[0]
    ep.in_flight = 1  # a request (a stream) still open on the old config
    old_client = old.clients["std"]
    old_client._host(ep.url)  # an open connection pool
    rules = _rules()
    rules["pools"][1]["timeouts"]["total_s"] = 20  # a changed spec: a new client
    _write(rt.settings.rules, rules)
    r = await rt.reload("admin")
    assert r.result == "ok"
    assert rt.live.clients["std"] is not old_client
    assert rt.live.clients["spec"] is old.clients["spec"]
    assert rt.reloader.retirer.pending == 1
    await asyncio.sleep(0.1)
    assert not old_client.closed
    ep.in_flight = 0
    for _ in range(100):
        if old_client.closed:
            break
        await asyncio.sleep(0.01)
    assert old_client.closed
    assert rt.reloader.retirer.pending == 0


async def test_reloads_are_serialised(rt: Runtime) -> None:
    _write(rt.settings.rules, _with_class(_rules()))
    results = await asyncio.gather(*(rt.reload("admin") for _ in range(3)))
    assert sorted(r.result for r in results) == ["ok", "unchanged", "unchanged"]


async def test_the_watcher_task_reloads_the_runtime(rt: Runtime) -> None:
    rt.reloader.watch_interval_s = 0.02
    rt.reloader.start()
    _write(rt.settings.rules, _with_class(_rules()))
    for _ in range(200):
        if len(rt.live.rules.classes) == 3:
            break
        await asyncio.sleep(0.01)
    assert [c.name for c in rt.live.rules.classes] == ["precise", "bulk", "default"]
    assert rt.reloader.last is not None
    assert rt.reloader.last.trigger == "watch"


# -- SIGHUP ------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP on this platform")
async def test_sighup_reloads_the_tenants_file_too(tmp_path: Path) -> None:
    rules, tenants = tmp_path / "rules.yaml", tmp_path / "tenants.yaml"
    _write(rules, _rules())
    tenants.write_text("tenants:\n  - {name: a, keys: [sk-a-old-0001]}\n")
    runtime: Runtime = create_app(Settings(rules=rules, tenants_file=tenants)).state.runtime
    assert runtime.tenants_reloader is not None
    assert runtime.tenancy is not None
    runtime.reloader.watch_interval_s = 0  # no file watcher: only the signal may reload
    runtime.reloader.start()
    try:
        assert runtime.reloader.handles_sighup, "the handler must be on the loop before the signal is sent"
        tenants.write_text("tenants:\n  - {name: a, keys: [sk-a-new-0001]}\n  - {name: b, keys: [sk-b-0000001]}\n")
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(500):
            if runtime.tenants_reloader.reloads and runtime.reloader.last is not None:
                break
            await asyncio.sleep(0.01)
        assert runtime.tenants_reloader.reloads == 1
        assert runtime.tenancy.identify("Bearer sk-b-0000001").name == "b"
        assert runtime.reloader.last is not None
        assert runtime.reloader.last.trigger == "sighup"
        tenants.write_text("tenants:\n  - {name: a, keys: [sk-a-new-0001], weight: -1}\n")
        os.kill(os.getpid(), signal.SIGHUP)  # invalid: logged, the tenants in force stay
        for _ in range(500):
            if (
                runtime.reloader.last is not None
                and _metric(runtime, "specgate_config_reload_total", result="unchanged") == 2
            ):
                break
            await asyncio.sleep(0.01)
        assert runtime.tenants_reloader.reloads == 1
        assert runtime.tenancy.identify("Bearer sk-b-0000001").name == "b"
    finally:
        await runtime.reloader.stop()
        await runtime.tenancy.close()
        for c in runtime.live.clients.values():
            await c.close()


# -- the admin routes --------------------------------------------------------------------------------------------


def _admin(rt: Runtime, token: str | None = TOKEN) -> httpx.AsyncClient:
    app = create_admin_app(rt, token)
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost", headers=headers)


async def test_admin_config_shows_the_yaml_in_force(rt: Runtime) -> None:
    async with _admin(rt) as c:
        body = (await c.get("/admin/config")).json()
    assert body == {
        "source": str(rt.settings.rules),
        "version": 1,
        "hash": rt.live.digest,
        "loaded_at": rt.live.loaded_at,
        "yaml": rt.settings.rules.read_text(),
    }


async def test_admin_reload_answers_ok_unchanged_and_422(rt: Runtime) -> None:
    async with _admin(rt) as c:
        r = await c.post("/admin/reload")
        assert r.status_code == 200
        assert r.json()["result"] == "unchanged"
        _write(rt.settings.rules, _with_class(_rules()))
        r = await c.post("/admin/reload", headers={"x-specgate-actor": "alice"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert (body["result"], body["hash"], body["dropped_overrides"]) == ("ok", rt.live.digest, [])
        assert rt.audit.records()[-1].actor == "alice"
        good = rt.live.digest
        bad = _rules()
        bad["pools"][1]["max_connections"] = 0
        bad["defaults"]["max_attempts"] = 0
        _write(rt.settings.rules, bad)
        r = await c.post("/admin/reload")
    assert r.status_code == 422
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code", "errors"}
    assert body["error"]["code"] == "invalid_config"
    assert body["result"] == "invalid"
    assert body["hash"] == good
    paths = {e["path"] for e in body["error"]["errors"]}
    assert {"defaults.max_attempts", "pools[1].max_connections"} <= paths
    for p in paths:
        assert p in body["error"]["message"]
    assert rt.live.digest == good


async def test_admin_reload_is_refused_without_a_token(rt: Runtime) -> None:
    async with _admin(rt, None) as c:
        r = await c.post("/admin/reload")
        assert r.status_code == 403
        assert r.json()["error"]["code"] == "admin_token_not_set"
        assert (await c.get("/admin/config")).status_code == 200
