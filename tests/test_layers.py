"""The package's layers (pyproject.toml, [tool.importlinter]) hold: no module imports upwards, and
no two modules import each other, checked by import-linter over every import of the package."""

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def test_no_import_goes_upwards_or_closes_a_cycle():
    lint = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    proc = subprocess.run([lint, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout and "Contracts: 3 kept" in proc.stdout, proc.stdout[-2000:]
