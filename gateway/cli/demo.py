"""``specgate demo``: the gateway plus one simulated vLLM server per pool, on this machine, no GPU.

The routing YAML is used as it is, except that every pool's endpoints are replaced by a local ``specgate sim``
server (the 70B preset; speculative pools run with the ``--speculative-config`` their YAML block describes).
The simulated servers are child processes, stopped with the gateway. Without ``SPECGATE_ADMIN_TOKEN`` set, the demo
makes one up for its admin listener and prints the ``export`` lines that let ``specgate pools``, ``specgate weight``
and the other on-call commands work from another shell at once.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

import yaml

from gateway.admin.protocol import ACTOR_ENV, TOKEN_ENV, URL_ENV
from gateway.config.settings import Settings
from gateway.sim.launch import PRESET, free_port, plan_stand_ins, wait_for_port


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def demo_admin_token(environ: MutableMapping[str, str]) -> tuple[str, bool]:
    """The demo's admin token: ``SPECGATE_ADMIN_TOKEN`` when set, else a new random one, put into ``environ`` for
    the gateway's admin listener (which reads it there). Returns the token and whether it was made here."""
    given = environ.get(TOKEN_ENV, "").strip()
    if given:
        return given, False
    token = secrets.token_urlsafe(24)
    environ[TOKEN_ENV] = token
    return token, True


def run_demo(rules_path: Path, port: int, admin_port: int | None = None, *, time_scale: float = 1.0) -> None:
    """The demo on ``port``, its admin API on ``admin_port`` (None: ``port`` + 1)."""
    from gateway.cli.serve import run_server

    if not rules_path.exists():
        raise RuntimeError(f"{rules_path} not found")
    rules_path = rules_path.resolve()
    admin_port = port + 1 if admin_port is None else admin_port
    check_ports(port, admin_port)
    rules = yaml.safe_load(rules_path.read_text())
    ports = {p["name"]: free_port() for p in rules["pools"]}
    stand_ins = plan_stand_ins(rules, ports, time_scale=time_scale)
    procs = [subprocess.Popen(s.cmd) for s in stand_ins]
    # uvicorn re-raises a captured SIGTERM once it has shut down; under the default handler that would end this
    # process before the ``finally`` below and leave the simulated servers running. Exit through Python instead.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        for s in stand_ins:
            wait_for_port(s.port)
        token, generated = demo_admin_token(os.environ)
        shown = banner(rules, ports, port, admin_port, token if generated else None, rules_path, specgate_command())
        print(shown, flush=True)
        settings = Settings(
            rules=rules_path,
            host="127.0.0.1",
            port=port,
            health_interval_s=2.0,
            admin_port=admin_port,
            stand_ins=",".join(f"{name}=http://127.0.0.1:{p}" for name, p in ports.items()),
        )
        run_server(settings)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)


def check_ports(port: int, admin_port: int) -> None:
    """Refuse to start, before anything is printed or started, when the gateway's port or the admin port is taken
    (another demo, say): the message names each port taken and how to choose others. Never moves a port silently:
    the banner's URLs and ``export`` lines must be the ones that answer."""
    if port == admin_port:
        raise RuntimeError(f"--port and --admin-port are both {port}: choose two different ports")
    taken = [f"{p} ({what})" for p, what in ((port, "the gateway"), (admin_port, "the admin API")) if _in_use(p)]
    if taken:
        raise RuntimeError(
            f"cannot start the demo: port {' and '.join(taken)} {'is' if len(taken) == 1 else 'are'} already in use "
            "(another demo?). Stop it, or choose free ports: make run ARGS='--port 9080 --admin-port 9081' "
            "(or specgate demo --port 9080 --admin-port 9081)"
        )


def _in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a TIME_WAIT is no conflict
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def specgate_command(environ: Mapping[str, str] | None = None) -> str:
    """How to run ``specgate`` from another shell, as the banner prints it: ``specgate`` when the shell's PATH
    finds this very program, else its path (``.venv/bin/specgate`` after ``make run``), relative when under the
    working directory."""
    here = Path(sys.executable).parent / "specgate"
    if not here.exists():
        return f"{sys.executable} -m gateway"
    path = (environ if environ is not None else os.environ).get("PATH", "")
    found = shutil.which("specgate", path=path)
    if found is not None and Path(found).resolve() == here.resolve():
        return "specgate"
    try:
        return str(here.relative_to(Path.cwd()))
    except ValueError:
        return str(here)


def banner(
    rules: dict[str, Any],
    ports: dict[str, int],
    port: int,
    admin_port: int,
    new_token: str | None,
    rules_path: Path,
    cmd: str = "specgate",
) -> str:
    """What the demo prints before it serves. ``new_token``: the admin token the demo made up, shown in an
    ``export`` line (None: the user's own ``SPECGATE_ADMIN_TOKEN``, never printed). ``cmd``: how the user's
    shell runs ``specgate`` (``specgate_command``): every command line printed runs as printed."""
    model = rules["pools"][0]["models"][0]
    pools = ", ".join(f"{p['name']} ({p.get('kind')}) on :{ports[p['name']]}" for p in rules["pools"])
    pool = rules["pools"][0]["name"]
    admin_url = f"http://127.0.0.1:{admin_port}"
    if new_token is not None:
        token_line = f"  export {TOKEN_ENV}={new_token}   # made up for this demo"
    else:
        token_line = f"  # {TOKEN_ENV}: yours, from the environment"
    return f"""
specgate demo — gateway on http://127.0.0.1:{port}/v1
simulated vLLM servers ({PRESET}): {pools}
routing YAML: {rules_path} (the pools' endpoints are the simulated servers; edit the rest, the demo reloads it)

  curl -s http://127.0.0.1:{port}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "{model}", "temperature": 0.2, "max_tokens": 256,
         "messages": [{{"role": "user", "content": "Write a Python function that reverses a list."}}]}}' -i

  from openai import OpenAI
  client = OpenAI(base_url="http://127.0.0.1:{port}/v1", api_key="demo")
  r = client.chat.completions.with_raw_response.create(model="{model}", max_tokens=64,
        messages=[{{"role": "user", "content": "Tell me a story"}}])
  print(r.headers["x-specgate-class"], r.headers["x-specgate-pool"], r.parse().choices[0].message.content)

On-call commands, from another shell in this directory (admin API on {admin_url}/admin):

  export {URL_ENV}={admin_url}
{token_line}
  export {ACTOR_ENV}="$USER"   # your name in the audit log (else plain "admin")
  {cmd} pools
  {cmd} weight {pool} 0.5 --reason "trying the demo" --ttl 10m
  {cmd} audit
  echo '{{"model": "{model}", "temperature": 0.2,
         "messages": [{{"role": "user", "content": "Write a Python function that reverses a list."}}]}}' \\
    | {cmd} explain -
  {cmd} reload   # after editing {rules_path.name}; also picked up by itself within seconds

Console in a browser: {admin_url}/admin/ui (sign in with the token above and your name).

Ctrl-C stops the gateway and the simulated servers.
"""
