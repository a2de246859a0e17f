"""Metrics sinks of the first rank (JSON lines in the run directory, optionally TensorBoard and an
experiment tracker, a progress bar), and the train record's figures: throughput, MFU, the slowest rank."""

from __future__ import annotations

import contextlib
import json
import logging
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from mingpt.training.tracking import ID_FILE as TRACKER_ID_FILE
from mingpt.training.tracking import Tracker

if TYPE_CHECKING:  # the report reads metrics without importing torch
    import torch

    from mingpt.config.schema import TrainerConfig
    from mingpt.runtime.distributed import DistInfo

log = logging.getLogger(__name__)

# Dense bf16 peak FLOP/s per GPU, by a substring of the device name, for MFU.
GPU_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12,
                  "L4": 121e12, "V100": 125e12, "4090": 165e12}


def peak_flops(cfg: TrainerConfig, d: DistInfo, device: torch.device) -> float:
    """The job's peak FLOP/s for MFU: per machine on CPU, per GPU on GPUs."""
    if device.type == "cpu":
        return cfg.cpu_peak_flops * max(1, d.world_size // d.local_world_size)
    if cfg.gpu_peak_flops > 0:
        return cfg.gpu_peak_flops * d.world_size
    import torch

    name = torch.cuda.get_device_name(device)
    per_gpu = next((flops for key, flops in GPU_PEAK_FLOPS.items() if key in name), None)
    if per_gpu is None:
        log.warning("unknown GPU %r: MFU assumes 312 TFLOP/s; set trainer.gpu_peak_flops", name)
    return (per_gpu or 312e12) * d.world_size


def train_record(step: dict, loss: float, step_s: float, compute: list[float], hosts: list[str],
                 flops_per_token: float, peak: float) -> dict:
    """The log line and metrics record of a step. `step`: its step, tokens_seen, tokens (global),
    lr and grad_norm; the rest every rank contributed (`compute`: each rank's compute seconds)."""
    tok_s = step["tokens"] / step_s
    mfu = tok_s * flops_per_token / peak
    slowest = max(range(len(compute)), key=compute.__getitem__)
    ratio = compute[slowest] / max(statistics.median(compute), 1e-9)
    log.info("step %d | loss %.4f | lr %.2e | grad norm %.3f | %.0f tok/s | mfu %.1f%% | %.1f ms/step%s", step["step"],
             loss, step["lr"], step["grad_norm"], tok_s, 100 * mfu, 1000 * step_s,
             f" | compute max/median {ratio:.2f} (slowest {hosts[slowest]}, rank {slowest})" if len(compute) > 1 else "")
    return {"kind": "train", "step": step["step"], "loss": loss, "lr": step["lr"], "grad_norm": step["grad_norm"],
            "tokens_per_s": tok_s, "mfu": mfu, "step_ms": 1000 * step_s, "tokens_seen": step["tokens_seen"],
            "compute_ms": [round(1000 * c, 2) for c in compute], "compute_max_median": ratio,
            "slowest": hosts[slowest]}


class StepTimer:
    """The interval a logged step's rate is measured over: the steps trained and the ledger's step
    seconds since the last log. `restart` it after anything that moves the step without training it
    here: a replica heal (a member healed from step 0 to 130 trained no 130 steps) or a step in flight
    dropped at a regroup."""

    def __init__(self, step_seconds: Callable[[], float], step: int):
        self.step_seconds = step_seconds
        self.restart(step)

    def restart(self, step: int) -> None:
        self.since = (step, self.step_seconds())

    def per_step(self, step: int) -> float:
        """Step seconds per step trained since the last call (or restart); the next interval starts now."""
        (s0, t0), now = self.since, self.step_seconds()
        self.since = (step, now)
        return (now - t0) / max(1, step - s0)


class MetricsWriter:
    """Appends one JSON object per record to run_dir/metrics.jsonl.

    After a resume the steps since the last snapshot are trained and logged again; a reader
    keeps the last record of each step.
    """

    def __init__(self, run_dir: str, enabled: bool, tensorboard: bool = False, tracker: Tracker | None = None):
        self.enabled = enabled
        self.tracker = tracker  # trainer.tracker: every record goes to it too
        self.path = Path(run_dir) / "metrics.jsonl"
        self._fh = None
        self._tb = None
        self._lock = threading.Lock()  # the snapshot thread writes its records too
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", buffering=1)
            self._fh.write(_after_cut(self.path))
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / "tb"))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with self._lock:
            if self._fh is None:  # closed: a save finishing after the end of training
                return
            self._fh.write(_line(record))
            self._write_tb(record)
            if self.tracker is not None:
                self.tracker.record(record)

    def _write_tb(self, record: dict) -> None:
        if self._tb is not None and record.get("kind") in ("train", "eval"):
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("step", "time"):
                    self._tb.add_scalar(k, v, record["step"])

    @staticmethod
    def append(run_dir: str | Path, record: dict) -> None:
        """One record from a rank that does not write the metrics (a survivor's "fault" record),
        added to an existing metrics file only: one short line, appended whole."""
        path = Path(run_dir) / "metrics.jsonl"
        if path.is_file():
            with open(path, "a") as fh:
                fh.write(_after_cut(path) + _line(record))

    @staticmethod
    def existing(run_dir: str | Path, launch_id: str) -> str | None:
        """What an earlier launch left in run_dir (a description), or None: nothing, or records that
        end with this same launch's (a restart before its first snapshot)."""
        path = Path(run_dir) / "metrics.jsonl"
        if not path.is_file() or path.stat().st_size == 0:
            return None
        last = None
        with open(path) as fh:
            for line in fh:
                if '"start"' in line:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:  # a line cut short by a kill
                        continue
                    if rec.get("kind") == "start":
                        last = rec.get("launch_id")
        return None if last == launch_id else str(path)

    @staticmethod
    def move_aside(run_dir: str | Path, stamp: str) -> list[str]:
        """Rename metrics.jsonl, tb/ and tracker.json to *.aside-<stamp>; returns the new paths."""
        moved = []
        for name, new in (("metrics.jsonl", f"metrics.aside-{stamp}.jsonl"), ("tb", f"tb.aside-{stamp}"),
                          (TRACKER_ID_FILE, f"tracker.aside-{stamp}.json")):  # a new run gets a new tracked run
            src = Path(run_dir) / name
            if src.exists():
                src.rename(src.with_name(new))
                moved.append(str(src.with_name(new)))
        return moved

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None
                if self.tracker is not None:  # the end figures, read from the file just closed
                    self.tracker.close(summarise=self.enabled)
            if self._tb is not None:
                self._tb.close()
                self._tb = None


def _line(record: dict) -> str:
    """One record as a JSON line, stamped with the time."""
    return json.dumps({"time": round(time.time(), 3), **record}) + "\n"


def _after_cut(path: Path) -> str:
    """A newline if the file ends in a line cut short (a process killed mid-write): the next record
    then starts a line of its own instead of being glued to the cut one."""
    with open(path, "rb") as fh:
        if fh.seek(0, 2) == 0:
            return ""
        fh.seek(-1, 2)
        return "" if fh.read(1) == b"\n" else "\n"


def read_records(path: str | Path) -> list[dict]:
    """Every record of a metrics file, in order; a line cut short by a kill is skipped."""
    out = []
    with open(path) as fh:
        for line in fh:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


@contextlib.contextmanager
def progress_bar(enabled: bool, start: int, total: int):
    """A progress bar on a terminal (else a stand-in that shows nothing). While it is shown, log
    lines are written through it, so that a line never lands in the middle of the bar."""
    if not enabled:
        yield SimpleNamespace(update=lambda _: None)
        return
    if not sys.stderr.isatty():  # piped, SLURM, docker logs: a plain line now and then
        yield PlainProgress(start, total)
        return
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(), tqdm(total=total, initial=start, unit="step", dynamic_ncols=True) as bar:
        yield bar


class PlainProgress:
    """Where no terminal shows a bar: one line every `every_s` seconds with the step, the share done
    and the time left at the rate since this process began training."""

    def __init__(self, start: int, total: int, every_s: float = 60.0, clock=time.monotonic):
        self.step, self.total, self.every_s, self.clock = start, total, every_s, clock
        self.t0, self.step0, self.last = clock(), start, clock()

    def update(self, n: int) -> None:
        self.step += n
        now = self.clock()
        if now - self.last < self.every_s or self.step >= self.total:
            return
        self.last = now
        rate = (self.step - self.step0) / max(now - self.t0, 1e-9)
        left = (self.total - self.step) / rate if rate > 0 else float("inf")
        logging.getLogger("mingpt").info("progress: step %d of %d (%.0f%%), %s elapsed, about %s left", self.step,
                                         self.total, 100 * self.step / self.total, duration(now - self.t0),
                                         duration(left))


def duration(seconds: float) -> str:
    """4 s, 12 min 5 s, 1 h 3 min."""
    if seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"
