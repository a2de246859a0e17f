"""The newest snapshots' files that this node wrote, kept in node-local memory.

After a writer has written its shard to the store, it also writes the same bytes to a tmpfs
(`/dev/shm` by default): a restart on the same node then reads those pieces from RAM instead of the
store (most restarts: a worker died, the node lives). Nothing is trusted: a copy is used only at the
size the manifest gives, every piece read from it is checked against the manifest's sha256, and a
missing or damaged copy is read from the store instead. The two newest steps are kept; a node
without room (a container's small /dev/shm) turns the cache off with one warning.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)


class NodeCache:
    def __init__(self, root: str, store_url: str, keep: int = 2):
        key = hashlib.sha1(store_url.rstrip("/").encode()).hexdigest()[:12]
        self.dir = Path(root) / f"mingpt-snapshots-{os.getuid()}-{key}"
        self.keep, self.enabled = keep, True

    def folder(self, step: int) -> Path:
        return self.dir / f"step_{step:09d}"

    def put(self, step: int, name: str, data) -> None:
        """Keep a copy of one file of snapshot `step` (a failure turns the cache off, with a warning)."""
        if not self.enabled:
            return
        folder = self.folder(step)
        tmp = folder / f".{name}.{os.getpid()}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as fh:
                fh.write(memoryview(data).cast("B"))
            os.replace(tmp, folder / name)
        except OSError as e:
            self.enabled = False
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            shutil.rmtree(folder, ignore_errors=True)
            log.warning("node cache off: cannot keep %s in %s (%s); restarts read snapshots from the store (set "
                        "snapshot.node_cache=off to silence this, or give the container a larger /dev/shm)",
                        name, self.dir, e.strerror or e)
            return
        self.prune()

    def prune(self) -> None:
        """Keep the `keep` newest steps."""
        steps = sorted(p for p in self.dir.glob("step_*") if p.is_dir())
        for old in steps[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def file(self, step: int, name: str, size: int) -> str | None:
        """The path of the copy of `name` of snapshot `step`, if there is one of that size."""
        path = self.folder(step) / name
        try:
            return str(path) if path.stat().st_size == size else None
        except OSError:
            return None

    def clear(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
