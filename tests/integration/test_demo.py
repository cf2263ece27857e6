"""`make run` (`specgate demo`) as a process: it serves from any directory (the default routing YAML is shipped in
the package), and a SIGTERM (docker stop, a supervisor) takes its simulated servers down with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from gateway.sim.launch import free_port, wait_for_port


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}/stat").exists() else ""
    return " Z " not in stat  # a zombie has exited


def test_demo_serves_and_sigterm_stops_its_simulated_servers(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "demo", "--port", str(port), "--admin-port", str(free_port())],
        cwd=tmp_path,  # not the repository root: no routing_rules/ here
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, 60.0)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 200
        # The Responses API through the demo with the OpenAI SDK: two turns of one conversation, then retrieve.
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="demo", max_retries=0, timeout=30)
        model = client.models.list().data[0].id
        first = client.responses.create(model=model, input="Write a python function.", max_output_tokens=8)
        second = client.responses.create(
            model=model, input="Now in one line.", max_output_tokens=8, previous_response_id=first.id
        )
        assert second.previous_response_id == first.id
        assert client.responses.retrieve(second.id).output_text == second.output_text
        sims = _children(proc.pid)
        assert len(sims) == 2  # one simulated vLLM server per pool of the default routing file
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in sims) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in sims)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _exports(banner: str) -> dict[str, str]:
    """The ``export NAME=VALUE`` lines of the demo's banner (a trailing comment dropped)."""
    found: dict[str, str] = {}
    for line in banner.splitlines():
        words = line.split("#", 1)[0].split()
        if len(words) == 2 and words[0] == "export":
            name, _, value = words[1].partition("=")
            found[name] = value
    return found


def test_the_demo_prints_an_admin_token_that_the_on_call_commands_use_at_once(tmp_path: Path) -> None:
    port, admin_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("SPECGATE_ADMIN_TOKEN", "SPECGATE_ADMIN_URL")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "demo", "--port", str(port), "--admin-port", str(admin_port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        banner = ""
        for line in proc.stdout:
            banner += line
            if line.startswith("Ctrl-C"):
                break
        exports = _exports(banner)
        assert set(exports) == {"SPECGATE_ADMIN_TOKEN", "SPECGATE_ADMIN_URL", "SPECGATE_ADMIN_ACTOR"}, banner
        assert len(exports["SPECGATE_ADMIN_TOKEN"]) >= 32
        assert exports["SPECGATE_ADMIN_URL"] == f"http://127.0.0.1:{admin_port}"  # the port asked for, never another
        wait_for_port(admin_port, 60.0)

        def specgate(*args: str, token: bool = True) -> subprocess.CompletedProcess[str]:
            run_env = {**env, **exports}
            if not token:
                del run_env["SPECGATE_ADMIN_TOKEN"]
            cmd = [sys.executable, "-m", "gateway", *args]
            return subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=60, check=False)

        refused = specgate("weight", "speculative", "0.5", "--reason", "demo", "--ttl", "1m", token=False)
        assert refused.returncode != 0  # a change needs the token: the export line is what makes it work
        changed = specgate("weight", "speculative", "0.5", "--reason", "demo", "--ttl", "1m")
        assert changed.returncode == 0, changed.stdout + changed.stderr
        listed = specgate("overrides", "--json")
        assert listed.returncode == 0, listed.stderr
        overrides = json.loads(listed.stdout)["overrides"]
        expected = [("pool_weight", "speculative", 0.5)]
        assert [(o["kind"], o["pool"], o["value"]) for o in overrides] == expected, overrides
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_second_demo_fails_before_its_banner_naming_the_taken_port(tmp_path: Path) -> None:
    import socket

    with socket.socket() as held:  # the first demo's gateway port
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cmd = [sys.executable, "-m", "gateway", "demo", "--port", str(port), "--admin-port", str(free_port())]
        done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0
    assert "specgate demo" not in done.stdout  # no banner, no "ready"
    assert f"port {port} (the gateway) is already in use" in done.stderr
    assert "--admin-port" in done.stderr


def test_a_newcomer_runs_the_banner_as_printed_and_a_hot_reload_of_the_edited_file(tmp_path: Path) -> None:
    """``make run`` in a checkout, then, in a clean shell (no virtualenv on its PATH, nothing set but what the banner
    says to do), every on-call line of the banner run as printed; then an edit of routing_rules/default.yaml, which
    the demo serves and watches."""
    import shutil

    repo = Path(__file__).resolve().parents[2]
    (tmp_path / "routing_rules").mkdir()
    rules = tmp_path / "routing_rules" / "default.yaml"
    shutil.copy(repo / "routing_rules" / "default.yaml", rules)
    port, admin_port = free_port(), free_port()
    clean = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "USER": "newcomer", "LANG": "C.UTF-8"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "demo", "--port", str(port), "--admin-port", str(admin_port)],
        cwd=tmp_path,
        env=clean,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        banner = ""
        for line in proc.stdout:
            banner += line
            if line.startswith("Ctrl-C"):
                break
        assert f"routing YAML: {rules.resolve()}" in banner
        assert f"http://127.0.0.1:{admin_port}/admin/ui" in banner
        assert "SPECGATE_ADMIN_ACTOR" in banner
        lines = banner.splitlines()
        block = lines[lines.index(next(s for s in lines if s.startswith("On-call commands"))) + 1 :]
        script = "\n".join(s for s in block[: block.index(next(s for s in block if s.startswith("Console")))])
        curl = "\n".join(lines[lines.index(next(s for s in lines if "curl -s" in s)) :][:3])
        wait_for_port(admin_port, 60.0)
        wait_for_port(port, 60.0)
        ran = subprocess.run(
            ["bash", "-ec", script], cwd=tmp_path, env=clean, capture_output=True, text=True, timeout=120, check=False
        )
        assert ran.returncode == 0, banner + ran.stdout + ran.stderr
        assert "newcomer" in ran.stdout  # the audit names who changed the weight
        answered = subprocess.run(["bash", "-ec", curl], env=clean, capture_output=True, text=True, timeout=60)
        assert "x-specgate-route:" in answered.stdout.lower(), answered.stdout + answered.stderr

        admin = f"http://127.0.0.1:{admin_port}/admin/config"
        auth = {"authorization": f"Bearer {_exports(banner)['SPECGATE_ADMIN_TOKEN']}"}
        before = httpx.get(admin, headers=auth, timeout=10).json()
        assert before["source"] == str(rules.resolve())
        rules.write_text(rules.read_text() + "\n# edited by the newcomer\n")
        deadline = time.monotonic() + 30
        while httpx.get(admin, headers=auth, timeout=10).json()["hash"] == before["hash"]:
            assert time.monotonic() < deadline, "the demo never picked up the edited file"
            time.sleep(0.2)
        assert httpx.get(admin, headers=auth, timeout=10).json()["yaml"].endswith("# edited by the newcomer\n")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
