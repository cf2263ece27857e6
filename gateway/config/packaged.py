"""Files shipped inside the package, so that an installed ``specgate`` works from any directory."""

from __future__ import annotations

from pathlib import Path
from typing import Final

# The default routing YAML: a copy of the repository's ``routing_rules/default.yaml`` (the file to edit; a test
# fails while the two differ), the decision matrix with its reasons in comments. Its pools are placeholder hosts.
DEFAULT_RULES: Final[Path] = Path(__file__).with_name("default_rules.yaml")
