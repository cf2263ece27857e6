"""What an installed package carries and needs: the default routing YAML inside it (so ``specgate demo`` and the
benchmarks work from any directory), and matplotlib only as the optional ``bench`` extra (a report without plots,
and a line saying how to get them, when it is missing)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from gateway.bench.load import Summary
from gateway.bench.mix import load_mix
from gateway.bench.plots import BENCH_EXTRA_HINT, PlotsUnavailable, plot_points, write_report
from gateway.bench.points import Point, Setup
from gateway.config.loader import load_rules_file
from gateway.config.packaged import DEFAULT_RULES

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_package_carries_the_repositorys_default_rules_unchanged() -> None:
    assert DEFAULT_RULES.resolve().is_relative_to((ROOT / "gateway").resolve())
    load_rules_file(DEFAULT_RULES)  # valid
    # routing_rules/default.yaml is the file to edit (the README, the examples and the Helm chart's copy follow
    # it); the package carries a copy, which must not drift.
    source = ROOT / "routing_rules" / "default.yaml"
    assert DEFAULT_RULES.read_bytes() == source.read_bytes(), (
        "cp routing_rules/default.yaml gateway/config/default_rules.yaml"
    )


def test_the_wheel_declares_the_default_rules_as_package_data() -> None:
    data = PYPROJECT["tool"]["setuptools"]["package-data"]["gateway"]
    assert DEFAULT_RULES.relative_to(ROOT / "gateway").as_posix() in data


def test_matplotlib_is_an_optional_extra_that_the_dev_extra_pulls_in() -> None:
    project = PYPROJECT["project"]
    assert not [d for d in project["dependencies"] if d.lower().startswith("matplotlib")]
    assert any(d.startswith("matplotlib") for d in project["optional-dependencies"]["bench"])
    own = [d for d in project["optional-dependencies"]["dev"] if d.startswith("specgate[")]
    assert any("bench" in d[len("specgate[") : -1].split(",") for d in own)  # `make test` runs the plot tests


def test_the_cli_and_the_benchmarks_import_without_matplotlib() -> None:
    code = (
        "import sys; import gateway.cli.main, gateway.bench.policies, gateway.bench.plots; "
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported at module level'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_bench_classify_finds_the_default_rules_from_any_directory(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gateway", "bench", "classify", "--n", "200"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "classification cost per request: 200 requests" in proc.stdout


def _points() -> list[Point]:
    def pt(policy: str, load: float, p99: float) -> Point:
        s = Summary("all", 10, 0, 1.0, 1.0, (0, 0, 0), (0, 0, 0), (0, 0, 0), (1.0, 1.0, p99))
        return Point(policy, load, load * 4.0, s, (), 1.0)

    return [pt(p, load, 1.0 + load) for p in ("standard", "adaptive") for load in (0.5, 1.1)]


def test_without_matplotlib_the_report_is_written_and_says_how_to_get_the_plots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    with pytest.raises(PlotsUnavailable, match=r"specgate\[bench\]"):
        plot_points(_points(), tmp_path)
    lines: list[str] = []
    mix = load_mix("default", ROOT / "bench" / "mixes")
    write_report(_points(), mix, Setup(), "test", tmp_path, ("standard", "adaptive"), lines.append)
    assert lines == [f"plots not drawn: matplotlib is not installed ({BENCH_EXTRA_HINT})"]
    report = (tmp_path / "report.md").read_text()
    assert f"- not drawn: matplotlib not installed ({BENCH_EXTRA_HINT})" in report
    assert "## p99 E2E (s)" in report
    assert not list(tmp_path.glob("*.png"))


def test_with_matplotlib_the_report_links_its_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    lines: list[str] = []
    mix = load_mix("default", ROOT / "bench" / "mixes")
    write_report(_points(), mix, Setup(), "test", tmp_path, ("standard", "adaptive"), lines.append)
    assert lines == []
    assert "![policies.png](policies.png)" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "policies.png").read_bytes()[:4] == b"\x89PNG"
