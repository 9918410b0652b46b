"""The layering the house style asks for, checked by import-linter on every run."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_policies_import_nothing_from_proxy() -> None:
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint, "import-linter is part of the test extra: pip install -e '.[test]'"
    result = subprocess.run([lint, "--config", "pyproject.toml", "--no-cache"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "policies know nothing of the server KEPT" in result.stdout
