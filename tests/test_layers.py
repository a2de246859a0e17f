"""The house rules that tools check: the package's layers (pyproject.toml, [tool.importlinter]) hold,
no module imports upwards, no two modules import each other; and ruff's rules ([tool.ruff]) pass
over the package, the tests and the benchmarks."""

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def test_no_import_goes_upwards_or_closes_a_cycle():
    lint = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    proc = subprocess.run([lint, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    contracts = (REPO / "pyproject.toml").read_text().count("[[tool.importlinter.contracts]]")
    assert f"Contracts: {contracts} kept, 0 broken" in proc.stdout, proc.stdout[-2000:]


def test_ruff_passes():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    proc = subprocess.run([ruff, "check", "--no-cache", "mingpt", "tests", "benchmarks"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
