"""Metrics sinks of the first rank: JSON lines in the run directory, optionally TensorBoard."""

from __future__ import annotations

import json
import time
from pathlib import Path


class MetricsWriter:
    """Appends one JSON object per record to run_dir/metrics.jsonl.

    After a resume the steps since the last snapshot are trained and logged again; a reader
    keeps the last record of each step (`read_metrics` does).
    """

    def __init__(self, run_dir: str, enabled: bool, tensorboard: bool = False):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._fh = None
        self._tb = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", buffering=1)
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / "tb"))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self._fh.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")
        if self._tb is not None and "step" in record:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("step", "time"):
                    self._tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(path: str | Path, kind: str = "train") -> dict[int, dict]:
    """step -> the last record of that kind ("train" or "eval") in a metrics file."""
    out: dict[int, dict] = {}
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == kind:
            out[rec["step"]] = rec
    return out
