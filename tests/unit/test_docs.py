"""The documentation stays true to the code and to itself.

- README.md opens with exactly two commands, `make run` and `make test`, and links every page of docs/.
- Every flag and environment variable of `specgate serve` has a row in docs/configuration.md's table.
- Every `specgate_*` metric the gateway registers has a row in docs/metrics.md's table, and every admin route one
  in docs/operations.md's.
- Every relative link in README.md and docs/*.md points at a file that exists, and at a heading that exists when
  it names one; every repository path they name in a code span exists.
- No text in README.md, docs/, gateway/, tests/ and the shipped configuration and deploy files points at a
  document outside the repository (design notes, vLLM notes, seed documents, issue numbers).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
import typer.main

from gateway.cli.main import app
from gateway.observability.metrics import GatewayMetrics

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CONFIGURATION = DOCS / "configuration.md"
METRICS = DOCS / "metrics.md"
METRIC_TYPES = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"}


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def table_cells(text: str) -> set[str]:
    """The code spans in the first two cells of every Markdown table row: what a reference table lists (a flag
    and its environment variable, a metric and its type)."""
    found: set[str] = set()
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            for cell in line.split("|")[1:3]:
                found.update(re.findall(r"`([^`]+)`", cell))
    return found


# -- the front page ------------------------------------------------------------------------------------------------


def test_readme_starts_with_the_two_commands() -> None:
    text = README.read_text()
    first_block = re.search(r"```\w*\n(.*?)```", text, re.S)
    assert first_block is not None
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines() if line.strip()]
    assert commands == ["make run", "make test"]
    assert text.index(first_block.group(0)) < text.index("\n## "), "the two commands come before any section"


def test_readme_stays_a_front_page() -> None:
    assert len(README.read_text().splitlines()) <= 250, "move the detail to docs/ and link it"


def test_every_doc_is_linked_from_the_readme() -> None:
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in relative_links(README)}
    unlinked = [str(d.relative_to(ROOT)) for d in sorted(DOCS.glob("*.md")) if d.resolve() not in linked]
    assert not unlinked, f"link these from the Documentation list of README.md: {unlinked}"


# -- configuration -------------------------------------------------------------------------------------------------


def serve_params() -> list[Any]:
    """The options of ``specgate serve`` as the CLI builds them (typer ships its own click: no isinstance)."""
    group = typer.main.get_command(app)
    serve = group.commands["serve"]  # type: ignore[attr-defined]
    return [p for p in serve.params if p.param_type_name == "option" and p.name != "help"]


def test_the_serve_flags_are_found() -> None:
    flags = {opt for p in serve_params() for opt in p.opts}
    assert {"--rules", "--port", "--redis-url", "--admin-port"} <= flags


def test_every_serve_flag_and_variable_is_in_the_configuration_table() -> None:
    cells = table_cells(CONFIGURATION.read_text())
    flags_in_doc = {c.split()[0] for c in cells if c.startswith("--")}
    missing: list[str] = []
    for param in serve_params():
        for opt in param.opts:
            if opt not in flags_in_doc:
                missing.append(opt)
        envvars = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or [])
        missing += [env for env in envvars if env not in cells]
    assert not missing, f"add a row to the flag table of docs/configuration.md for: {missing}"


def test_every_admin_route_is_in_the_operations_table() -> None:
    """The admin API's OpenAPI description (kept in step with the routes by its own test) against the table."""
    from gateway.admin.openapi import openapi

    def shape(route: str) -> str:
        method, path = route.split(" ", 1)
        return method + " " + re.sub(r"\{[^}]*\}", "{}", path.split("?")[0])

    documented = {shape(c) for c in re.findall(r"`([A-Z]+ /admin/[^`]*)`", (DOCS / "operations.md").read_text())}
    missing = [
        f"{method.upper()} {path}"
        for path, operations in openapi()["paths"].items()
        for method in operations
        if method in ("get", "put", "post", "delete", "patch") and shape(f"{method.upper()} {path}") not in documented
    ]
    assert not missing, f"add these admin routes to the Admin API table of docs/operations.md: {missing}"


# -- metrics -------------------------------------------------------------------------------------------------------


def registered_metric_names() -> set[str]:
    """Every ``specgate_*`` metric constructed anywhere in gateway/, as Prometheus exposes it (counters with
    ``_total``), from the source: a metric registered only when some component is built still counts."""
    names: set[str] = set()
    for path in sorted((ROOT / "gateway").rglob("*.py")):
        tree = ast.parse(path.read_text())
        constants = {
            node.targets[0].id: node.value.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        }
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            func = node.func
            kind = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if kind not in METRIC_TYPES:
                continue
            arg = node.args[0]
            name = arg.value if isinstance(arg, ast.Constant) else constants.get(getattr(arg, "id", ""))
            if not isinstance(name, str) or not name.startswith("specgate_"):
                continue
            if kind == "Counter" and not name.endswith("_total"):
                name += "_total"
            if kind == "Info" and not name.endswith("_info"):
                name += "_info"
            names.add(name)
    return names


def test_the_source_walk_finds_every_metric_of_the_registry() -> None:
    """The walk below is only as good as what it finds: at least every metric of GatewayMetrics."""
    exposed = set()
    for family in GatewayMetrics().registry.collect():
        exposed.add(family.name + "_total" if family.type == "counter" else family.name)
    walked = registered_metric_names()
    assert exposed <= walked, exposed - walked
    assert "specgate_controller_transitions_total" in walked  # registered outside GatewayMetrics
    assert "specgate_store_up" in walked


def test_every_metric_is_in_the_metrics_list() -> None:
    listed = {c for c in table_cells(METRICS.read_text()) if c.startswith("specgate_")}
    missing = sorted(registered_metric_names() - listed)
    assert not missing, f"add a row to the table of docs/metrics.md for: {missing}"


def test_the_metrics_list_names_no_metric_that_does_not_exist() -> None:
    listed = {c for c in table_cells(METRICS.read_text()) if c.startswith("specgate_")}
    stale = sorted(listed - registered_metric_names())
    assert not stale, f"docs/metrics.md lists metrics the gateway does not register: {stale}"


# -- links ---------------------------------------------------------------------------------------------------------

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors_of(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    return {github_anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.+?)#*$", text, re.M)}


def relative_links(path: Path) -> list[str]:
    text = _FENCE.sub("", path.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans are not links
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


_REPO_PATH = re.compile(r"`((?:gateway|routing_rules|docs|deploy|docker|helm|bench|tests|tools)/[\w./-]*)`")


@pytest.mark.parametrize("doc", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_named_in_the_docs_exists(doc: Path) -> None:
    """A path in a code span (`gateway/config/settings.py`) must still be there after code moves."""
    gone = [p for p in _REPO_PATH.findall(doc.read_text()) if not (ROOT / p).exists()]
    assert not gone, f"{doc.relative_to(ROOT)} names paths that do not exist: {gone}"


def test_the_path_check_sees_paths() -> None:
    assert _REPO_PATH.findall("in `gateway/settings.py` and `docs/`, not `specgate serve`") == [
        "gateway/settings.py",
        "docs/",
    ]
    assert not (ROOT / "gateway/settings.py").exists()  # the old place of the settings: it would be reported


def test_github_anchor() -> None:
    assert github_anchor("Live load: `scrape:`") == "live-load-scrape"
    assert github_anchor("Fallback, retries and ejection") == "fallback-retries-and-ejection"
    assert github_anchor("SpecgateStoreDegraded") == "specgatestoredegraded"


@pytest.mark.parametrize("doc", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path) -> None:
    broken: list[str] = []
    for target in relative_links(doc):
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors_of(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: {broken}"


def test_the_link_check_sees_links() -> None:
    links = relative_links(README)
    assert "docs/configuration.md" in links
    assert any("#" in link for link in links)


# -- the repository stands alone -----------------------------------------------------------------------------------

_OUTSIDE = re.compile(r"DESIGN\.md|VLLM\.md|\bseeds/|\bissue \d+|\bissues? #\d+", re.I)


def standalone_files() -> list[Path]:
    """The text a reader of the repository meets: docs, code, tests, the shipped configuration and deploy files."""
    files = markdown_files()
    for folder, patterns in {
        "gateway": ("*.py",),
        "tests": ("*.py",),
        "routing_rules": ("*.yaml", "*.json"),
        "bench": ("*.yaml",),
        "docker": ("*.yaml", "*.yml", "Dockerfile"),
        "deploy": ("*.yaml", "*.json"),
        "helm": ("*.yaml", "*.json", "*.tpl", "*.txt"),
    }.items():
        for pattern in patterns:
            files += sorted((ROOT / folder).rglob(pattern))
    this = Path(__file__).resolve()
    return [f for f in files if f.resolve() != this]  # this file spells the patterns out


def test_no_reference_to_documents_outside_the_repository() -> None:
    hits: list[str] = []
    for path in standalone_files():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            m = _OUTSIDE.search(line)
            if m:
                hits.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)}")
    assert not hits, "say it in your own words instead: " + "; ".join(hits)


def test_the_outside_pattern() -> None:
    for text in ("see DESIGN.md", "VLLM.md's table", "(seeds/004)", "target (issue 7)", "Issue 13"):
        assert _OUTSIDE.search(text), text
    for text in ("the seeds of a single run", "an issue with the pool", "random seeds"):
        assert not _OUTSIDE.search(text), text
