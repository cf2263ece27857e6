"""The line at the end of a run that names the tools whose absence made tests skip (tests/conftest.py)."""

from __future__ import annotations

from tests.conftest import skipped_tools


def test_names_each_missing_tool_with_its_count_and_install_command() -> None:
    reasons = [
        "Skipped: helm 3 not found on PATH or in .tools/bin (install it: tools/install-ci-tools.sh)",
        "Skipped: helm 3 not found on PATH or in .tools/bin (install it: tools/install-ci-tools.sh)",
        "Skipped: redis-server is not installed (CI installs it: .ci/run; locally: apt-get install redis-server)",
        "Skipped: promtool is not installed (CI installs it: tools/install-ci-tools.sh; locally: ...)",
        "Skipped: no SIGHUP on this platform",
    ]
    assert skipped_tools(reasons) == (
        "4 tests skipped for missing tools (helm: 2, redis-server: 1, promtool: 1); "
        "install them with tools/install-ci-tools.sh and apt-get install redis-server"
    )


def test_nothing_when_no_tool_is_missing() -> None:
    assert skipped_tools([]) is None
    assert skipped_tools(["Skipped: no /proc here"]) is None
