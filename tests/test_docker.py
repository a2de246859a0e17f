"""No Docker engine here: lint the Dockerfile and check its structure. tests/test_image.py builds it
with podman and runs it; where podman cannot run, its install steps run here in a clean virtual
environment instead."""

import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from conftest import REPO
from image_base import image_fixture  # noqa: F401 - the session's image, when podman can build it

DOCKERFILE = (REPO / "Dockerfile").read_text()
INSTRUCTIONS = [line for line in DOCKERFILE.splitlines() if line and not line.startswith((" ", "#"))]
# the image users pull: the default of the build argument that FROM names
BASE = next(line for line in INSTRUCTIONS if line.startswith("ARG BASE=")).split("=", 1)[1]


def test_hadolint_passes():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    proc = subprocess.run([hadolint, "--failure-threshold", "info", str(REPO / "Dockerfile")], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_structure():
    assert "FROM ${BASE}" in INSTRUCTIONS
    assert BASE.startswith("pytorch/pytorch:") and re.search(r":\d+\.\d+\.\d+-cuda[\d.]+-cudnn\d+-runtime$", BASE)
    user = [line.split()[1] for line in INSTRUCTIONS if line.startswith("USER")]
    assert user and user[-1].split(":")[0] not in ("root", "0")
    uid = user[-1].split(":")[0]
    assert 'ENTRYPOINT ["mingpt-torchrun"]' in INSTRUCTIONS  # the job-private rendezvous, the workers' exit codes
    # the recipe: the run on a volume, a stop timeout above torchrun's grace, the host user, the secret by name
    recipe = DOCKERFILE.split("FROM", 1)[0]
    assert "-v /data/mingpt:/data/mingpt" in recipe and "trainer.run_dir=/data/mingpt/" in recipe
    stop, grace = (int(re.search(rf"{flag}[ =](\d+)", recipe).group(1)) for flag in ("--stop-timeout", "--shutdown-timeout"))
    assert stop > grace
    # every container is the image's user, which owns the volume; the secret by name
    assert f"install -d -o {uid} -g {uid} /data/mingpt" in recipe and "--user" not in recipe
    assert "-e MINGPT_JOB_SECRET " in recipe
    run = next(line for line in INSTRUCTIONS if line.startswith("RUN pip install"))
    # non-editable; boto3 for snapshot.uploader=boto3 (an extra since 2026-11-28: images write to S3)
    assert re.search(r'pip install --no-cache-dir "\.\[formats,boto3\]"', run) and " -e " not in run
    assert "snapshot.dir=s3://" in DOCKERFILE  # the documented multi-node example snapshots to S3


def test_the_image_torch_is_the_floor_of_pyproject():
    """The image's torch satisfies the project's floor exactly: pip then installs no other torch
    into the image (that would pull gigabytes of CUDA packages, or a torch without the APIs we call)."""
    import tomllib

    image_torch = re.match(r"pytorch/pytorch:(\d+\.\d+)\.\d+-", BASE).group(1)
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    floor = next(d for d in deps if d.startswith("torch")).removeprefix("torch>=")
    assert image_torch == floor, (BASE, floor)
    import torch

    assert tuple(map(int, torch.__version__.split("+")[0].split(".")[:2])) >= tuple(map(int, floor.split(".")))
    # what the code calls, by the release that brought it (all within the floor)
    import inspect

    from torch.distributed.fsdp import fully_shard  # noqa: F401 - public since 2.6
    from torch.distributed.run import get_args_parser
    assert "init_sync" in inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters  # 2.6
    assert "--shutdown-timeout" in get_args_parser().format_help()  # 2.12: the preemption grace


@pytest.fixture(scope="module")
def image_venv(request, tmp_path_factory):
    """COPY what the Dockerfile copies, pip install it non-editable (a wheel is built from it) into
    a clean virtual environment: the image's install, without the image. Only where podman cannot
    build the image: then tests/test_image.py checks the same in the image itself."""
    try:
        request.getfixturevalue("image")
    except pytest.skip.Exception:
        pass
    else:
        pytest.skip("tests/test_image.py checks the installed commands in the real image instead")
    tmp = tmp_path_factory.mktemp("image")
    ctx = tmp / "image"
    ctx.mkdir()
    for line in INSTRUCTIONS:
        if line.startswith("COPY"):
            *sources, dest = line.split()[1:]
            for src in sources:
                target = ctx / src if dest == "./" else ctx / dest
                if (REPO / src).is_dir():
                    shutil.copytree(REPO / src, target, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy(REPO / src, target)
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=True)
    py = str(env_dir / "bin" / "python")
    # the base image brings torch; here the CPU wheel of the pinned version stands in for it
    subprocess.run([py, "-m", "pip", "install", "-q", "torch==2.13.0"], check=True, timeout=600)
    run = next(line for line in INSTRUCTIONS if line.startswith("RUN pip install"))
    pip_args = [a.strip('"') for a in run.split("&&")[0].split()[3:]]  # ["--no-cache-dir", ".[formats,boto3]"]
    build = subprocess.run([py, "-m", "pip", "install", "-v", *pip_args], cwd=ctx, capture_output=True, text=True,
                           timeout=600)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    assert "DeprecationWarning" not in build.stdout + build.stderr  # e.g. project.license as a table
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    return env_dir, elsewhere


@pytest.mark.slow
def test_install_steps_in_a_clean_virtualenv(image_venv):
    """The config is composed from the installed package, far from the source tree."""
    env_dir, elsewhere = image_venv
    py = str(env_dir / "bin" / "python")
    code = ("import pyarrow, zstandard, s3transfer; from mingpt.config.compose import compose, config_dir; "
            "print(config_dir()); print(compose(['model=gpt2', 'snapshot=s3']).snapshot.dir); "
            "print(compose(['experiment=finetune_shakespeare']).model.init_from)")
    out = subprocess.run([py, "-c", code], cwd=elsewhere, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    conf, snapdir, init_from = out.stdout.split()
    assert "site-packages/mingpt/conf" in conf and snapdir.startswith("s3://") and init_from == "gpt2"
    help_out = subprocess.run([str(env_dir / "bin" / "mingpt-torchrun"), "--help"], capture_output=True, text=True)
    assert help_out.returncode == 0 and "--rdzv_endpoint" in help_out.stdout


def readme_entries() -> set[str]:
    """Every `python -m mingpt...` (or torchrun's `-m mingpt...`) that the READMEs name."""
    text = "".join(p.read_text() for p in [REPO / "README.md", *REPO.glob("*/README.md"), *REPO.glob("docs/*.md")])
    return set(re.findall(r"-m (mingpt[\w.]*)", text))


@pytest.mark.slow
def test_every_command_and_module_the_readme_names_runs_from_the_installed_wheel(image_venv):
    import tomllib

    env_dir, elsewhere = image_venv
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    modules = readme_entries()
    assert {"mingpt.main", "mingpt.report"} <= modules
    commands = [[str(env_dir / "bin" / name)] for name in scripts]
    commands += [[str(env_dir / "bin" / "python"), "-m", m] for m in sorted(modules)]
    for cmd in commands:
        out = subprocess.run([*cmd, "--help"], cwd=elsewhere, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip(), f"{' '.join(cmd[-2:])} --help: {out.stderr[-2000:]}"
