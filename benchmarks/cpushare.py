"""Each group of a benchmark in its own CPU share, as if on a machine of its own.

On one box the groups of a job share its cores: a restarting group's interpreter takes CPU from the
survivors, which on a cluster run on other nodes. A cgroup per group with a CPU quota of
cores / groups (cgroup v1's `cpu.cfs_quota_us`, or v2's `cpu.max`) keeps each group, its restarts
included (a child stays in its parent's cgroup), within its own share. A quota is a cap, not a
reservation: other users of the machine still compete for the cores.

    with CpuShares(3) as shares:          # 3 groups, os.cpu_count() cores between them
        Popen(cmd, preexec_fn=shares.enter(g))
    shares.isolation                      # what it did, for the JSON line: "cgroup v1 cpu: ..." or "none (why)"

With `beside=C`, C of the cores go to one more share, beside the groups' (theirs are cut from the
rest): the cores of a node that its training leaves idle, as on a GPU node, where a warm spare's
start-up runs beside the member training. `move(pid, None)` puts a running process there, `move(pid, g)`
back into group g's share.

Needs write access to the cgroup file system (root); without it, `isolation` says why and `enter`
does nothing.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

PERIOD_US = 100_000
ROOTS = (("v1", Path("/sys/fs/cgroup/cpu")), ("v2", Path("/sys/fs/cgroup")))


def _find() -> tuple[str, Path] | str:
    """The writable cpu controller (version, root), or why there is none."""
    why = "no cpu controller mounted"
    for version, root in ROOTS:
        if version == "v1" and not (root / "cpu.cfs_quota_us").exists():
            continue
        controllers = root / "cgroup.controllers"
        if version == "v2" and (not controllers.exists() or "cpu" not in controllers.read_text().split()):
            continue
        if not os.access(root, os.W_OK):
            why = f"no write access to {root} (run as root for one CPU share per group)"
            continue
        return version, root
    return why


class CpuShares:
    """`groups` cgroups of `cores` / `groups` cores each (`cores`: all of the machine's by default), made
    under a directory of this process's own, removed on exit."""

    def __init__(self, groups: int, cores: float | None = None, label: str = "mingpt-bench", beside: float = 0.0):
        self.groups, self.cores, self.beside = groups, cores or os.cpu_count(), beside
        self.each = (self.cores - beside) / groups
        self.dirs: list[Path] = []
        found = _find() if os.environ.get("MINGPT_BENCH_NO_CGROUPS") != "1" else "turned off (MINGPT_BENCH_NO_CGROUPS=1)"
        if isinstance(found, str):
            self.isolation = f"none ({found}): the groups share the machine's {self.cores} cores"
            return
        version, root = found
        self.top = root / f"{label}-{os.getpid()}-{time.monotonic_ns() % 10**9}"
        try:
            self.top.mkdir()
            if version == "v2":  # children of a v2 cgroup get a controller only if their parent passes it on
                (self.top / "cgroup.subtree_control").write_text("+cpu")
            for g, cores in [*((g, self.each) for g in range(groups)), *([("beside", beside)] if beside else [])]:
                d = self.top / f"group{g}"
                d.mkdir()
                quota = max(1000, round(PERIOD_US * cores))
                if version == "v1":
                    (d / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                    (d / "cpu.cfs_quota_us").write_text(str(quota))
                else:
                    (d / "cpu.max").write_text(f"{quota} {PERIOD_US}")
                self.dirs.append(d)
        except OSError as e:
            self.close()
            self.dirs = []
            self.isolation = (f"none (cannot make cgroups under {root}: {e.strerror}): the groups share the "
                              f"machine's {self.cores} cores")
            return
        self.isolation = (f"cgroup {version} cpu: each group (torchrun, processes, restarts) capped at "
                          f"{self.each:.2f} of {self.cores} cores" if groups > 1 else
                          f"cgroup {version} cpu: the job (torchrun, processes, restarts) capped at "
                          f"{self.each:.2f} of {self.cores} cores, all the groups' cores")
        if beside:
            self.isolation += f"; {beside:.2f} cores beside them for the spares (a node's idle cores)"

    def enter(self, group: int | None):
        """A preexec_fn that puts the child (and so everything it starts) into `group`'s share (None:
        beside the groups')."""
        if not self.dirs:
            return lambda: None
        procs = str(self.dirs[self.groups if group is None else group] / "cgroup.procs")

        def join() -> None:
            with open(procs, "w") as fh:
                fh.write("0")  # 0: the writing process itself
        return join

    def move(self, pid: int, group: int | None) -> bool:
        """Put running process `pid` (all its threads) into `group`'s share, or beside the groups' (None);
        False where it has ended (or nothing is isolated)."""
        if not self.dirs:
            return False
        try:
            (self.dirs[self.groups if group is None else group] / "cgroup.procs").write_text(str(pid))
        except (ProcessLookupError, FileNotFoundError):
            return False
        return True

    def close(self) -> None:
        """Remove the cgroups (a process still in one is moved out first)."""
        if not getattr(self, "top", None) or not self.top.exists():
            return
        parent = self.top.parent / "cgroup.procs"
        for d in [*self.dirs, self.top]:
            for _ in range(50):
                with contextlib.suppress(OSError):
                    for pid in (d / "cgroup.procs").read_text().split():
                        with contextlib.suppress(OSError):
                            parent.write_text(pid)
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)

    def __enter__(self) -> CpuShares:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
