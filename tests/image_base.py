"""The images tests/test_image.py runs. No registry can be pulled from here, so the Dockerfile is
built on a base made locally: Debian (debootstrap, from Debian's own mirror) with a virtual
environment on PATH holding the torch CPU wheel, as the PyTorch image holds torch in its conda.
The base also holds mingpt's dependencies, so that each build of the Dockerfile installs only mingpt
(the PyTorch image's pip is recent: so is the base's). The base is tagged with a hash of what went
into it and reused while that tag exists."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

TORCH = "torch==2.13.0"  # CI's torch (.ci/run), CPU
# crun fails on this machine's cgroups v1/v2 hybrid; root lacks CAP_SYS_RESOURCE, so the engine's
# default nofile of 1048576 cannot be set and both limits stay within the hard ones.
PODMAN = ["podman", "--runtime", "runc"]
ULIMITS = ["--ulimit", "nofile=20000:20000", "--ulimit", "nproc=20000:20000"]
DEBOOTSTRAP = ["debootstrap", "--variant=minbase", "--include=python3,python3-venv,python3-pip", "bookworm"]
# pip inside the image reaches the registry as pip here does: the same CA bundle and /etc/pip.conf.
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
PIP_CONF = Path("/etc/pip.conf")
CONTAINERFILE = """\
FROM {rootfs}
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY pip.conf /etc/pip.conf
COPY wheels /tmp/wheels
COPY requirements.txt /tmp/requirements.txt
RUN python3 -m venv /opt/venv && /opt/venv/bin/pip install --no-cache-dir --upgrade pip \
    && /opt/venv/bin/pip install --no-cache-dir /tmp/wheels/torch-*.whl -r /tmp/requirements.txt \
    && rm -rf /tmp/wheels /tmp/requirements.txt
ENV PATH=/opt/venv/bin:$PATH
"""


class NoPodman(Exception):
    """Podman cannot run here; the message says why, in one line."""


def podman(*args: str, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout, **kw)


def check_podman() -> None:
    missing = [tool for tool in ("podman", "runc") if shutil.which(tool) is None]
    if missing:
        raise NoPodman(f"{' and '.join(missing)} not installed (apt-get install podman runc debootstrap)")
    if os.geteuid() != 0:
        raise NoPodman("the image tests build a base with debootstrap, which needs root")
    info = podman("info", timeout=120)
    if info.returncode != 0:
        raise NoPodman(f"podman cannot run: {last_line(info.stderr)}")


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def exists(image: str) -> bool:
    return podman("image", "exists", image, timeout=60).returncode == 0


def torch_wheel(directory: Path) -> None:
    """The torch CPU wheel for the base's Python (bookworm's 3.11), through this machine's pip
    configuration, which knows where the CPU build lies."""
    out = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                          "--python-version", "3.11", "-d", str(directory), TORCH],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"pip download {TORCH}: {out.stderr[-2000:]}")
    [wheel] = directory.glob("torch-*.whl")
    if "+cpu" not in wheel.name:  # the CUDA wheel would pull gigabytes of CUDA packages into the base
        raise NoPodman(f"pip finds no CPU build of {TORCH} here (got {wheel.name})")


def requirements(repo: Path) -> str:
    """What the Dockerfile's `pip install ".[formats]"` brings besides mingpt itself."""
    import tomllib

    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    return "\n".join([*project["dependencies"], *project["optional-dependencies"]["formats"]]) + "\n"


def base_image(work: Path, repo: Path) -> str:
    """The local base: Python, and torch and mingpt's dependencies in a virtual environment on PATH.
    Built once per machine (a few minutes), then found by its tag."""
    work.mkdir(parents=True, exist_ok=True)
    wheels = work / "wheels"
    wheels.mkdir(exist_ok=True)
    torch_wheel(wheels)
    (work / "requirements.txt").write_text(requirements(repo))
    inputs = [" ".join(DEBOOTSTRAP), CONTAINERFILE, *(p.name for p in sorted(wheels.iterdir())),
              requirements(repo), CA_BUNDLE.read_text(), PIP_CONF.read_text() if PIP_CONF.exists() else ""]
    rootfs_image = f"localhost/mingpt-test-debian:{digest(inputs[:1])}"
    base = f"localhost/mingpt-test-base:{digest(inputs)}"
    if exists(base):
        return base
    if not exists(rootfs_image):
        if shutil.which("debootstrap") is None:
            raise NoPodman("debootstrap not installed (apt-get install debootstrap)")
        # on the same file system as the work directory: /tmp may be a small tmpfs
        rootfs = Path(tempfile.mkdtemp(prefix="rootfs-", dir=work))
        try:
            boot = subprocess.run([*DEBOOTSTRAP, str(rootfs)], capture_output=True, text=True, timeout=1200)
            if boot.returncode != 0:
                raise NoPodman(f"debootstrap cannot make a Debian base here: {last_line(boot.stdout + boot.stderr)}")
            tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
            imported = subprocess.run([*PODMAN, "import", "-", rootfs_image], stdin=tar.stdout, capture_output=True,
                                      text=True, timeout=600)
            tar.stdout.close()
            assert tar.wait() == 0 and imported.returncode == 0, imported.stderr[-2000:]
        finally:
            shutil.rmtree(rootfs, ignore_errors=True)
    shutil.copy(CA_BUNDLE, work / "ca-certificates.crt")
    (work / "pip.conf").write_text(PIP_CONF.read_text() if PIP_CONF.exists() else "")
    (work / "Containerfile").write_text(CONTAINERFILE.format(rootfs=rootfs_image))
    build(work, base, work / "Containerfile")
    for keep in (rootfs_image, base):  # images made from other inputs: up to 1.5 GB each
        listed = podman("images", "--format", "{{.Repository}}:{{.Tag}}", keep.split(":")[0], timeout=60)
        for stale in set(listed.stdout.split()) - {keep}:
            podman("rmi", stale, timeout=120)
    return base


def digest(inputs: list[str]) -> str:
    return hashlib.sha256("\0".join(inputs).encode()).hexdigest()[:12]


def build(context: Path, tag: str, containerfile: Path, *args: str) -> None:
    out = podman("build", "--network", "host", *ULIMITS, "-f", str(containerfile), "-t", tag, *args, str(context),
                 timeout=1200)
    assert out.returncode == 0, f"podman build of {containerfile}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"


def mingpt_image(repo: Path, base: str, tag: str) -> str:
    """The real Dockerfile, built from the checkout (its .dockerignore keeps the context small)."""
    build(repo, tag, repo / "Dockerfile", "--build-arg", f"BASE={base}")
    return tag


@pytest.fixture(scope="session", name="image")
def image_fixture(tmp_path_factory):
    """The real Dockerfile built on the local base, once per test session; skipped, with the reason,
    where podman cannot run."""
    from conftest import REPO

    try:
        check_podman()
        base = base_image(tmp_path_factory.mktemp("image-base"), REPO)
    except NoPodman as e:
        pytest.skip(str(e))
    tag = f"localhost/mingpt-test:{os.getpid()}"
    yield mingpt_image(REPO, base, tag)
    podman("rmi", "-f", tag, timeout=120)
