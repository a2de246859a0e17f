"""Where a start continues from: the newest snapshot, a named one, or nothing (a new run), and the
rules that keep two runs apart: one run per store, a restart of the same job always resumes its
own newest snapshot, and a snapshot of another model shape or tokenizer is refused."""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import replace
from pathlib import Path

from mingpt.config import RunConfig, SnapshotConfig
from mingpt.snapshot.store import SnapshotError, SnapshotStore, load_from
from mingpt.training.metrics import MetricsWriter

log = logging.getLogger("mingpt")


class MismatchError(SnapshotError):
    pass


# Where each shape field is set: the advice in a mismatch names the key to change.
_SHAPE_KEYS = {"n_layer": "model.n_layer", "n_head": "model.n_head", "n_embd": "model.n_embd",
               "block_size": "data.block_size", "bias": "model.bias"}


def check_compatible(cfg: RunConfig, manifest: dict) -> None:
    """Refuse a snapshot of another model shape or tokenizer (before any data is read); log the
    other config changes."""
    saved_shape = manifest["model_shape"]
    current = replace(cfg.model, block_size=cfg.data.block_size).shape_dict()
    diff = [f"{key}: snapshot {saved_shape.get(k)!r} vs config {current[k]!r}" for k, key in _SHAPE_KEYS.items()
            if saved_shape.get(k) != current[k]]
    saved_tok = manifest.get("tokenizer", {}).get("kind")
    if saved_tok != cfg.data.tokenizer.kind:
        diff.append(f"data.tokenizer.kind: snapshot {saved_tok!r} vs config {cfg.data.tokenizer.kind!r}")
    if diff:
        raise MismatchError(
            "the snapshot to resume has another model shape or tokenizer (" + "; ".join(diff) + "). Use the "
            "snapshot's settings to continue it, or start a new run in its own directory: trainer.run_dir=runs/NEW"
        )
    # Compare as JSON sees them, so that a tuple and the list it was saved as are equal.
    old, now = manifest["config"], json.loads(json.dumps(cfg.to_dict()))
    for section in ("data", "optim", "trainer"):
        for k, v in now[section].items():
            if old.get(section, {}).get(k) != v and not isinstance(v, dict):
                log.info("config changed since the snapshot: %s.%s %r -> %r", section, k,
                         old.get(section, {}).get(k), v)


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def choose_start(store: SnapshotStore, scfg: SnapshotConfig, job_id: str | None):
    """(state, manifest, run id, other run's snapshots) this start continues from; a fresh run has
    no state.

    Two runs never share a store: starting afresh (resume=never) or from an explicit snapshot in a
    store that holds other snapshots is refused, unless `move_aside` allows moving them aside.
    A restart of the same torchrun job (same rendezvous id) always resumes its own newest
    snapshot, whatever `resume` says: torchrun restarts workers with the same arguments.
    """
    resume = scfg.resume
    committed = [s for s in store.list() if s.committed]
    if resume != "latest" and committed and job_id:
        try:
            newest = store.read_manifest(committed[-1].path)
        except Exception:  # noqa: BLE001 - an unreadable manifest is no snapshot of this job
            newest = {}
        if newest.get("job_id") == job_id:
            log.info("this job (rendezvous id %s) saved step %d already: resuming from its own newest snapshot",
                     job_id, newest["step"])
            resume = "latest"
    if resume == "latest":
        found = store.load_latest()
        if found is None:
            return None, None, new_run_id(), []
        return found[0], found[1], found[1].get("run_id") or new_run_id(), []
    if resume == "never":
        state, manifest, run_id, start_step = None, None, new_run_id(), 0
        what = "snapshot.resume=never starts a new run"
    else:
        state, manifest = load_from(resume, store.storage_options)
        run_id, start_step = manifest.get("run_id") or new_run_id(), manifest["step"]
        what = f"resuming from {resume} (step {start_step}) would mix them with this run's"
    others = [s for s in committed if s.step > start_step or resume == "never"
              or store.run_id_of(s) not in (run_id, None)]
    if others and not scfg.move_aside:
        elsewhere = ("trainer.run_dir=runs/NEW" if scfg.dir is None
                     else "a new snapshot.dir and trainer.run_dir=runs/NEW")
        raise SnapshotError(
            f"snapshot store {store.url} holds snapshots of another run ({_steps(others)}); {what}. Give this run "
            f"its own directory ({elsewhere}), or add snapshot.move_aside=true to move them aside (nothing is deleted)")
    return state, manifest, run_id, others


def set_aside(store: SnapshotStore, others: list, run_dir: Path, job_id: str | None, fresh: bool) -> None:
    """Move another run's snapshots (`others`) and metrics out of the way, saying where to."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved = [store.move_aside(others, stamp)] if others else []
    foreign_metrics = MetricsWriter.existing(run_dir, job_id) if fresh else None
    if others or foreign_metrics:  # metrics describe the run whose snapshots moved, or an earlier one
        moved += MetricsWriter.move_aside(run_dir, stamp)
    if moved:
        log.warning("moved an earlier run's files aside (nothing deleted): %s", ", ".join(moved))


def _steps(snaps) -> str:
    steps = [s.step for s in snaps]
    return f"step {steps[0]}" if len(steps) == 1 else f"{len(steps)} snapshots, steps {steps[0]}-{steps[-1]}"
