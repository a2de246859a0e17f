"""python -m mingpt.report (mingpt/report/__main__.py)."""

import subprocess
import sys

from conftest import REPO


def test_report_of_a_directory_without_metrics_says_so(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mingpt.report", str(tmp_path)], capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    assert proc.returncode == 2 and "no metrics at" in proc.stderr and "Traceback" not in proc.stderr
