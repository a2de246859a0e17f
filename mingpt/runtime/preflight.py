"""Checks at every start, before any training: the classic multi-node mistakes, found on all ranks at
once, each reported as one line that names the host(s), what differs and the fix.

Every process reports what it can see (its code, library versions, config, corpus, devices, and
whether it reads what rank 0 just wrote into the snapshot store); rank 0 compares the reports and
every rank stops with the same message when something would make the job fail or silently train on
the wrong state.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from mingpt.data.prepare import MANIFEST
from mingpt.runtime.distributed import DistInfo, all_gather_objects, broadcast_object
from mingpt.runtime.storage import is_local

log = logging.getLogger(__name__)

PROBE_PREFIX = ".mingpt-probe-"


class PreflightError(RuntimeError):
    """The job would fail or train on the wrong state; the message says where and what to do."""


@lru_cache(maxsize=1)
def code_fingerprint() -> dict[str, str]:
    """sha256 (short) of every source file of the mingpt package that runs, and of its config files."""
    package = Path(__file__).resolve().parent.parent  # mingpt/ (this file is in mingpt/runtime/)
    files = sorted(package.rglob("*.py"))
    from mingpt.config.compose import config_dir  # the conf/ this process composes from

    conf = Path(config_dir())
    files += sorted(conf.rglob("*.yaml"))
    out = {}
    for f in files:
        name = f"conf/{f.relative_to(conf)}" if conf in f.parents else str(f.relative_to(package.parent))
        out[name] = hashlib.sha256(f.read_bytes()).hexdigest()[:12]
    return out


def versions() -> dict[str, str]:
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
    return {"python": platform.python_version(), "torch": torch.__version__, "nccl": nccl}


def file_fingerprint(path: str) -> str:
    """"missing", or size and a hash of the first and last MiB: cheap, and different corpora differ."""
    p = Path(os.path.expanduser(path))
    if not p.exists():
        return "missing"
    if (p / MANIFEST).is_file():  # a prepared dataset: its manifest names every shard's sha256
        return "prepared, " + hashlib.sha256((p / MANIFEST).read_bytes()).hexdigest()[:12]
    if p.is_dir():  # a directory of documents: names and sizes
        items = sorted((str(f.relative_to(p)), f.stat().st_size) for f in p.rglob("*") if f.is_file())
        return f"{len(items)} files, " + hashlib.sha256(json.dumps(items).encode()).hexdigest()[:12]
    size = p.stat().st_size
    h = hashlib.sha256()
    with open(p, "rb") as fh:
        h.update(fh.read(1 << 20))
        if size > 2 << 20:
            fh.seek(size - (1 << 20))
            h.update(fh.read())
    return f"{size} bytes, {h.hexdigest()[:12]}"


@dataclass
class Report:
    """What one process sees."""

    host: str
    node: int
    local_rank: int
    local_world_size: int
    code: dict[str, str]
    versions: dict[str, str]
    config: str
    data: str | None
    sees_probe: bool | None
    device: str = "cpu"
    gpus: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.host} (node {self.node})"


def report(info: DistInfo, config: dict, data_path: str, store_root: str | None, nonce: str | None) -> Report:
    first_on_node = info.local_rank == 0  # one process per node looks at node-wide things
    data = file_fingerprint(data_path) if first_on_node and is_local(data_path) else None
    probe = None
    if first_on_node and store_root is not None and nonce is not None:
        path = Path(store_root) / f"{PROBE_PREFIX}{nonce}"
        probe = path.is_file() and path.read_text() == nonce
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if first_on_node else []
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return Report(info.hostname, info.node, info.local_rank, info.local_world_size, code_fingerprint(), versions(),
                  digest, data, probe, info.device.split(":")[0], gpus)


def _corpus_problems(firsts: list[Report], data_path: str) -> list[str]:
    """The corpus is the same on every node (missing everywhere is left to the data loader)."""
    problems: list[str] = []
    seen: dict[str, list[str]] = {}
    for r in firsts:
        if r.data is not None:
            seen.setdefault(r.data, []).append(r.where)
    if len(seen) > 1 and "missing" in seen:
        problems.append(f"data.path={data_path} is missing on {', '.join(seen['missing'])} but present on the other "
                        "nodes; copy the corpus there (or read it from a shared file system or s3://)")
    elif len(seen) > 1:
        found = "; ".join(f"{fingerprint} on {', '.join(where)}" for fingerprint, where in seen.items())
        problems.append(f"data.path={data_path} differs between nodes ({found}); copy the same corpus to every node")
    return problems


def compare(reports: list[Report], data_path: str = "", store_url: str = "") -> tuple[list[str], list[str]]:
    """(problems, warnings): one line each. reports[0] is rank 0's, the reference."""
    problems, warnings = [], []
    ref = reports[0]
    firsts = [r for r in reports if r.local_rank == 0]

    # the same code: name the node and the first files that differ
    odd = [r for r in reports if r.code != ref.code]
    if odd:
        r = odd[0]
        files = sorted(k for k in set(r.code) | set(ref.code) if r.code.get(k) != ref.code.get(k))
        problems.append(f"mingpt's code differs between nodes: {r.where} runs other files than rank 0 on {ref.where} "
                        f"({', '.join(files[:3])}{' ...' if len(files) > 3 else ''}); install the same version "
                        "on every node")
    for key in ("python", "torch", "nccl"):
        seen = {}
        for r in firsts:
            seen.setdefault(r.versions[key], r.where)
        if len(seen) > 1:
            found = "; ".join(f"{version} on {where}" for version, where in seen.items())
            problems.append(f"{key} versions differ between nodes ({found}); install the same on every node")
    odd = [r for r in firsts if r.config != ref.config]
    if odd:
        problems.append(f"the resolved config differs between nodes: {odd[0].where} was started with other settings "
                        "than rank 0; give every node the same command line")
    problems += _corpus_problems(firsts, data_path)
    # one store: every node must read what rank 0 wrote
    blind = [r.where for r in firsts if r.sees_probe is False]
    if blind:
        problems.append(f"snapshot.dir={store_url} is not shared between nodes: {', '.join(blind)} cannot see what "
                        f"rank 0 on {ref.where} writes there, so a restart could resume from an old snapshot or "
                        "start over; put snapshots on a shared file system or s3://")
    # devices
    for r in firsts:
        if r.device == "cuda" and len(r.gpus) < r.local_world_size:
            problems.append(f"{r.where} has {len(r.gpus)} GPUs for {r.local_world_size} processes; lower "
                            f"--nproc_per_node to {len(r.gpus)} there")
    models = {g for r in firsts for g in r.gpus}
    if len(models) > 1:
        warnings.append(f"the nodes have different GPU models ({', '.join(sorted(models))}): the slowest sets the pace "
                        "and MFU figures mix peaks")
    return problems, warnings


def run_checks(info: DistInfo, config: dict, data_path: str, store_url: str,
               raise_on_problem: bool = True) -> tuple[list[str], list[str], float]:
    """Every rank: report, rank 0 compares, every rank gets the verdict. Returns (problems, warnings, seconds)."""
    t0 = time.perf_counter()
    store_root = store_url if is_local(store_url) else None  # an object store is one store by construction
    nonce = None
    multi_node = len({n for n in all_gather_objects(info.node)}) > 1
    if multi_node and store_root is not None:
        if info.is_rank0:
            nonce = uuid.uuid4().hex
            Path(store_root).mkdir(parents=True, exist_ok=True)
            (Path(store_root) / f"{PROBE_PREFIX}{nonce}").write_text(nonce)
        nonce = broadcast_object(nonce)  # a collective: rank 0 wrote it before anyone reads
    reports = all_gather_objects(report(info, config, data_path, store_root, nonce))
    verdict = None
    if info.is_rank0:
        verdict = compare(reports, data_path=data_path, store_url=store_url)
        if nonce is not None:
            (Path(store_root) / f"{PROBE_PREFIX}{nonce}").unlink(missing_ok=True)
    problems, warnings = broadcast_object(verdict)
    for w in warnings:
        if info.is_rank0:
            log.warning("%s", w)
    seconds = time.perf_counter() - t0
    if problems and raise_on_problem:
        raise PreflightError("\n".join(problems))
    return problems, warnings, seconds


