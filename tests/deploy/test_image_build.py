"""The CI image build (tools/build-image.sh) without building: the script parses, CI calls it under a time limit,
it builds exactly docker/Dockerfile with the probes the image must pass, and the docs describe it. The build and
the probes themselves run in .ci/run (buildah, a few minutes), not in the test suite."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "build-image.sh"


def test_the_script_parses_and_explains_itself() -> None:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    subprocess.run([bash, "-n", str(SCRIPT)], check=True, timeout=30)
    help_text = subprocess.run(
        [bash, str(SCRIPT), "--help"], check=True, timeout=30, capture_output=True, text=True
    ).stdout
    for flag in ("--install-missing", "--rebuild-base", "--keep", "--probe-only", "--context"):
        assert flag in help_text
    bad = subprocess.run([bash, str(SCRIPT), "--no-such-flag"], timeout=30, capture_output=True, text=True)
    assert bad.returncode == 2
    assert "unknown argument" in bad.stderr


def test_ci_builds_and_probes_the_image_under_a_time_limit() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^timeout (--kill-after=\d+ )?\d+ bash tools/build-image.sh --install-missing", ci, re.M)


def test_the_script_builds_exactly_the_dockerfile_and_probes_what_users_rely_on() -> None:
    text = SCRIPT.read_text()
    assert '-f "$context/docker/Dockerfile"' in text
    assert "--format docker" in text  # HEALTHCHECK survives only in the docker format
    assert "--isolation chroot" in text
    assert "--storage-driver vfs" in text
    assert "/etc/ssl/certs/ca-certificates.crt:ro" in text
    for probe in ("specgate --version", "id -u", "specgate validate", "specgate sim", "specgate serve", "/ready"):
        assert probe in text, probe
    assert '"/health"' in text
    assert "/v1/chat/completions" in text
    # every external step runs under a time limit
    for line in text.splitlines():
        stripped = line.strip()
        if re.match(r"(step \S+ \d+ )?(mmdebstrap|apt-get)\b", stripped) and not stripped.startswith("step"):
            assert stripped.startswith("timeout"), stripped
    assert all(re.match(r"step [\w-]+ \d+ ", s.strip()) for s in re.findall(r"^\s*step .*$", text, re.M))


def test_the_docs_describe_the_build() -> None:
    doc = (ROOT / "docs" / "container-image.md").read_text()
    assert "tools/build-image.sh" in doc
    assert "pip install 'specgate[bench]'" in doc
    assert "docker build -f docker/Dockerfile" in doc
