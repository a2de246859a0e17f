"""Where a start continues from: the newest snapshot, a named one, or nothing (a new run), and the
rules that keep two runs apart: one run per store, a restart of the same job always resumes its
own newest snapshot, and a snapshot of another model shape or tokenizer is refused."""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import replace

from mingpt.config.schema import RunConfig, SnapshotConfig
from mingpt.snapshot.store import STEP_RE, MismatchError, SnapshotError, SnapshotStore, candidates

log = logging.getLogger("mingpt")


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
    saved_opt = manifest["config"].get("trainer", {}).get("optimizer", "adamw")  # (older snapshots: AdamW's)
    if saved_opt != cfg.trainer.optimizer:  # each keeps other state: Muon a momentum, AdamW two moments
        diff.append(f"trainer.optimizer: snapshot {saved_opt!r} vs config {cfg.trainer.optimizer!r}")
    if diff:
        raise MismatchError(
            "the snapshot to resume has another model shape, tokenizer or optimizer (" + "; ".join(diff) + "). Use the "
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


def choose_start(store: SnapshotStore, scfg: SnapshotConfig, launch_id: str, restarted: bool):
    """(store URL, candidate snapshots, run id, other run's snapshots) this start continues from;
    a fresh run has no candidates. The candidates are (path, manifest), newest first.

    Two runs never share a store: starting afresh (resume=never) or from an explicit snapshot in a
    store that holds other snapshots is refused, unless `move_aside` allows moving them aside.
    A start of the launch that saved the newest snapshot (a torchrun restart, counted or not: an
    elastic change of nodes is not), or a torchrun restart whose launch has no lasting id
    (`restarted`), always resumes its own newest snapshot whatever `resume` says: torchrun restarts
    workers with the same arguments. A new launch does what `resume` says, whatever its rendezvous
    id (users reuse one).
    """
    resume = scfg.resume
    committed = [s for s in store.list() if s.committed]
    if resume != "latest" and committed:
        try:
            newest = store.read_manifest(committed[-1].path)
        except Exception:  # noqa: BLE001 - an unreadable manifest is no snapshot of this launch
            newest = {}
        if restarted or newest.get("launch_id") == launch_id:
            log.info("a restart of launch %s: resuming its own newest snapshot, whatever snapshot.resume=%s says",
                     launch_id, resume)
            resume = "latest"
    if resume == "latest":
        found = candidates(store, committed)
        run_id = (found[0][1].get("run_id") if found else None) or new_run_id()
        return store.url, found, run_id, []
    if resume == "never":
        source, found, run_id, start_step = store.url, [], new_run_id(), 0
        what = "snapshot.resume=never starts a new run"
    else:
        parent, _, name = resume.rstrip("/").rpartition("/")
        one = STEP_RE.match(name)
        source = (parent or ".") if one else resume
        other = store.other(source)
        infos = [s for s in other.list() if s.committed and (not one or s.path.rstrip("/").endswith(name))]
        if not infos:
            raise SnapshotError(f"no committed snapshot at {resume}")
        found = candidates(other, infos, limit=1)
        run_id, start_step = found[0][1].get("run_id") or new_run_id(), found[0][1]["step"]
        what = f"resuming from {resume} (step {start_step}) would mix them with this run's"
    others = [s for s in committed if s.step > start_step or resume == "never"
              or store.run_id_of(s) not in (run_id, None)]
    if others and not scfg.move_aside:
        elsewhere = ("trainer.run_dir=runs/NEW" if scfg.dir is None
                     else "a new snapshot.dir and trainer.run_dir=runs/NEW")
        raise SnapshotError(
            f"snapshot store {store.url} holds snapshots of another run ({_steps(others)}); {what}. Give this run "
            f"its own directory ({elsewhere}), or add snapshot.move_aside=true to move them aside (nothing is deleted)")
    return source, found, run_id, others


def _steps(snaps) -> str:
    steps = [s.step for s in snaps]
    return f"step {steps[0]}" if len(steps) == 1 else f"{len(steps)} snapshots, steps {steps[0]}-{steps[-1]}"


def abort_unfinished(store: SnapshotStore) -> int:
    """Abort the multipart uploads of this store's snapshot files left unfinished by an earlier attempt
    of this job (a writer SIGKILLed mid-upload leaves its parts stored, and billed, until an abort).
    Called by the first rank at start, before any rank of this attempt saves: every upload into the
    store's step folders is then an orphan; other keys under the same prefix (snapshot.dir=s3://bucket)
    are someone else's and left alone. Returns how many; a store that refuses to list them is only
    warned about."""
    try:
        found = store.uploads(0.0)
        for upload in found:
            store.files.abort_upload(upload)
    except Exception as e:  # noqa: BLE001 - cleaning up must never stop a job from starting
        log.warning("could not look for unfinished multipart uploads in %s (%s: %s); `mingpt-snapshot uploads "
                    "--abort` cleans them up later", store.url, e.__class__.__name__, e)
        return 0
    if found:
        log.info("aborted %d unfinished multipart upload%s left in %s by an earlier attempt", len(found),
                 "" if len(found) == 1 else "s", store.url)
    return len(found)
