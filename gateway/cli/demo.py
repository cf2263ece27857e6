"""``specgate demo``: the gateway plus one simulated vLLM server per pool, on this machine, no GPU.

The routing YAML is used as it is, except that every pool's endpoints are replaced by a local ``specgate sim``
server (the 70B preset; speculative pools run with the ``--speculative-config`` their YAML block describes).
The simulated servers are child processes, stopped with the gateway.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml

from gateway.config.settings import Settings
from gateway.sim.launch import PRESET, free_port, plan_stand_ins, stand_in_rules, wait_for_port


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_demo(rules_path: Path, port: int, *, time_scale: float = 1.0) -> None:
    from gateway.cli.serve import run_server

    if not rules_path.exists():
        raise RuntimeError(f"{rules_path} not found")
    rules = yaml.safe_load(rules_path.read_text())
    ports = {p["name"]: free_port() for p in rules["pools"]}
    stand_ins = plan_stand_ins(rules, ports, time_scale=time_scale)
    procs = [subprocess.Popen(s.cmd) for s in stand_ins]
    # uvicorn re-raises a captured SIGTERM once it has shut down; under the default handler that would end this
    # process before the ``finally`` below and leave the simulated servers running. Exit through Python instead.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    with tempfile.TemporaryDirectory(prefix="specgate-demo-") as tmp:
        try:
            for s in stand_ins:
                wait_for_port(s.port)
            path = Path(tmp) / "rules.yaml"
            path.write_text(yaml.safe_dump(stand_in_rules(rules, ports), sort_keys=False))
            admin_port = port + 1 if port < 65535 else port - 1
            print(_banner(rules, ports, port, admin_port), flush=True)
            settings = Settings(rules=path, host="127.0.0.1", port=port, health_interval_s=2.0, admin_port=admin_port)
            run_server(settings)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)


def _banner(rules: dict[str, Any], ports: dict[str, int], port: int, admin_port: int) -> str:
    model = rules["pools"][0]["models"][0]
    pools = ", ".join(f"{p['name']} ({p.get('kind')}) on :{ports[p['name']]}" for p in rules["pools"])
    return f"""
specgate demo — gateway on http://127.0.0.1:{port}/v1
simulated vLLM servers ({PRESET}): {pools}

  curl -s http://127.0.0.1:{port}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "{model}", "temperature": 0.2, "max_tokens": 256,
         "messages": [{{"role": "user", "content": "Write a Python function that reverses a list."}}]}}' -i

  from openai import OpenAI
  client = OpenAI(base_url="http://127.0.0.1:{port}/v1", api_key="demo")
  r = client.chat.completions.with_raw_response.create(model="{model}", max_tokens=64,
        messages=[{{"role": "user", "content": "Tell me a story"}}])
  print(r.headers["x-specgate-class"], r.headers["x-specgate-pool"], r.parse().choices[0].message.content)

Why a request goes where it goes (admin API on http://127.0.0.1:{admin_port}/admin, read-only without a token):

  echo '{{"model": "{model}", "temperature": 0.2,
         "messages": [{{"role": "user", "content": "Write a Python function that reverses a list."}}]}}' \\
    | specgate explain - --url http://127.0.0.1:{admin_port}

Ctrl-C stops the gateway and the simulated servers.
"""
