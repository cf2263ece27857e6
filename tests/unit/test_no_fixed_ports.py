"""No test starts a gateway on a default port: every command line that runs ``specgate serve`` or ``specgate demo``
in the tests names its client port and its admin port (a free one, or ``--admin-port 0``). A test that left one
implicit would bind 8080 or 8081 and fail whenever anything else holds it (a demo running on the same machine).

The check reads the test sources (an AST walk, nothing is run): each function that builds such a command line must
also name ``--port`` and ``--admin-port`` in it."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
COMMANDS = {"serve", "demo"}  # the subcommands that listen
PORT_FLAGS = ("--port", "--admin-port")


def _strings(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _launches(node: ast.AST) -> str | None:
    """The listening subcommand a command line literal runs, if any: ``[python, "-m", "gateway", "serve", ...]``
    or ``[path_to_specgate, "demo", ...]`` (a computed program, then the subcommand; a list of constants only,
    such as a Dockerfile's expected ``ENTRYPOINT``, starts nothing)."""
    if not isinstance(node, ast.List | ast.Tuple):
        return None
    items = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
    for i, item in enumerate(items[:-1]):
        after = items[i + 1]
        if after not in COMMANDS:
            continue
        if (item == "gateway" and i > 0 and items[i - 1] == "-m") or not isinstance(node.elts[i], ast.Constant):
            return str(after)
    return None


def implicit_ports(source: str, name: str) -> list[str]:
    """One line per function of ``source`` that launches a listening command without naming both ports."""
    out = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        launched = {c for node in ast.walk(fn) if (c := _launches(node)) is not None}
        if not launched:
            continue
        named = set(_strings(fn))
        missing = [flag for flag in PORT_FLAGS if flag not in named]
        if missing:
            out.append(f"{name}:{fn.lineno} {fn.name} runs {'/'.join(sorted(launched))} without {', '.join(missing)}")
    return out


def test_no_test_leaves_a_default_port() -> None:
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        found += implicit_ports(path.read_text(), str(path.relative_to(TESTS)))
    assert found == []


def test_the_check_finds_a_command_line_without_the_admin_port() -> None:
    bad = 'def t():\n    cmd = [sys.executable, "-m", "gateway", "serve", "--port", str(port)]\n'
    assert implicit_ports(bad, "x.py") == ["x.py:1 t runs serve without --admin-port"]
    good = bad.replace("str(port)]", 'str(port), "--admin-port", "0"]')
    assert implicit_ports(good, "x.py") == []
    venv = 'def t():\n    subprocess.run([str(bin / "specgate"), "demo"])\n'
    assert implicit_ports(venv, "x.py") == ["x.py:1 t runs demo without --port, --admin-port"]
    assert implicit_ports('def t():\n    assert entrypoint == ["specgate", "serve"]\n', "x.py") == []
