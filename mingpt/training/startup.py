"""A run's start-up, the steps about its snapshots: the store's lease (one live job per store),
the one decision of where a run starts (`where_to_start`: the newest good snapshot, GPT-2 weights or
nothing), another run's files set aside, the snapshotter, loading the snapshot into the live
tensors, and the start record. main.assemble calls these in order."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from mingpt.config.schema import RunConfig
from mingpt.model.pretrained import pretrained_checkpoint, with_pretrained_shape
from mingpt.parallel.layouts import Parallel
from mingpt.runtime import distributed
from mingpt.runtime.distributed import DistInfo
from mingpt.runtime.exits import Exit, exit_process, report_error
from mingpt.runtime.trust import derive, job_secret
from mingpt.snapshot import SnapshotStore, Snapshotter, open_store
from mingpt.snapshot.layout import layout_name
from mingpt.snapshot.lease import Lease
from mingpt.snapshot.nodecache import NodeCache
from mingpt.snapshot.restore import restore
from mingpt.snapshot.start import abort_unfinished, check_compatible, choose_start
from mingpt.snapshot.store import newest_that_loads
from mingpt.training.ledger import Ledger
from mingpt.training.metrics import MetricsWriter
from mingpt.training.trainer import Trainer

log = logging.getLogger("mingpt")


def set_aside(store: SnapshotStore, others: list, run_dir: Path, launch_id: str, fresh: bool) -> None:
    """Move another run's snapshots (`others`) and metrics out of the way, saying where to."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved = [store.move_aside(others, stamp)] if others else []
    foreign_metrics = MetricsWriter.existing(run_dir, launch_id) if fresh else None
    if others or foreign_metrics:  # metrics describe the run whose snapshots moved, or an earlier one
        moved += MetricsWriter.move_aside(run_dir, stamp)
    if moved:
        log.warning("moved an earlier run's files aside (nothing deleted): %s", ", ".join(moved))


@dataclass(frozen=True)
class Start:
    """Where this run starts from, decided once by `where_to_start`."""
    store: SnapshotStore  # where this run saves
    source: SnapshotStore  # where its snapshot to continue is (the store, or one named by snapshot.resume)
    candidates: list  # (path, manifest) of the snapshots to continue, newest first; [] = a new run
    run_id: str
    pretrained: Path | None  # GPT-2 weights to begin from (a snapshot to continue wins over them)

    @property
    def manifest(self) -> dict | None:
        return self.candidates[0][1] if self.candidates else None


def where_to_start(cfg: RunConfig, info: DistInfo, lease: Lease | None = None) -> tuple[RunConfig, Start]:
    """The one decision of where a run starts: the newest good snapshot of its store (or one named by
    snapshot.resume), GPT-2 weights, or nothing; its run id; which other run's files to set aside.
    Rank 0 decides; every rank gets the same candidates (manifests only). Nothing is moved before
    the snapshot to continue is known to fit. Returns the config with the shape of the weights."""
    sc = cfg.snapshot  # the store the lease holds (rank 0), opened once
    store = lease.store if lease is not None else open_store(cfg.snapshot_store, sc.endpoint_url, sc.uploader)
    # a restart is told by its launch id where it has one that lasts (a retried refusal stays refused);
    # under torchrun's default rendezvous id "none" each start's id is its own: only the count tells
    restarted = info.restarted and info.job_id is None
    source, found, run_id, others = distributed.on_rank0(lambda: choose_start(store, sc, info.launch_id, restarted))
    if cfg.replicas.enabled and not found:  # every group's first start names one run: theirs is one launch id
        run_id = f"replicas-{info.launch_id[:12]}"
    pretrained = pretrained_checkpoint(cfg.model.init_from, info) if cfg.model.init_from else None
    if pretrained is not None:
        cfg = with_pretrained_shape(cfg, pretrained)
    start = Start(store, store.other(source), found, run_id, pretrained)
    if start.manifest:
        check_compatible(cfg, start.manifest)
    if info.is_rank0:
        set_aside(store, others, Path(cfg.trainer.run_dir), info.launch_id, fresh=not found and not info.restarted)
        if not cfg.replicas.enabled:  # a replica group starts while another may be saving: its upload is not an orphan
            abort_unfinished(store)
    return cfg, start


def take_lease(cfg: RunConfig, info: DistInfo) -> Lease | None:
    """Rank 0 holds the store's lease while the job runs (one live job per store), taken before the
    store is read; a store that another live job holds is refused on every rank. A world that another
    world of this launch superseded (a split brain of torchrun's rendezvous) ends at once, without
    saving: its peers lose contact and torchrun restarts them, to rejoin."""
    sc, held, secret = cfg.snapshot, [], job_secret()

    def lost(why: str) -> None:  # another launch took the store over: stop now, without committing
        exit_process(report_error(info, why, code=Exit.LEASE_LOST), True)

    distributed.on_rank0(lambda: held.append(
        Lease(open_store(cfg.snapshot_store, sc.endpoint_url, sc.uploader), info.launch_id, sc.lease_s,
              shared=cfg.replicas.enabled, on_superseded=lambda: exit_process(Exit.FAILED, True),
              job=derive(secret, "job")[:16] if secret else None, on_lost=lost).take()))
    return held[0] if held else None


def record_start(ledger: Ledger, info: DistInfo, start: Start, parallel: str, hosts: list[str], group: int | None,
                 write, trainer: Trainer) -> None:
    """The "start" record: this process's start-up time by state, at the step it starts from."""
    ledger.record(write, trainer.progress.step, lambda v: distributed.all_gather_floats(v, info.device),
                  kind="start", run_id=start.run_id, job_id=info.job_id, launch_id=info.launch_id,
                  world_size=info.world_size, restart=info.restart_count, parallel=parallel, hosts=hosts,
                  **({"group": group} if group is not None else {}))


def append_once(run_dir: str, info: DistInfo, record: dict) -> None:
    """A replica group's record, by the group's first process only (the job's writer is the epoch's leader)."""
    if info.is_rank0:
        MetricsWriter.append(run_dir, record)


def build_snapshotter(cfg: RunConfig, info: DistInfo, start: Start, metrics: MetricsWriter,
                      parallel: Parallel, lease: Lease | None = None) -> Snapshotter:
    """Where and how snapshots are saved: every rank writes its share (HSDP, tensor parallel under
    FSDP: its part of the rows that it and its copies hold), the first commits."""
    sc = cfg.snapshot
    cache = NodeCache(sc.node_cache_dir, start.store.url, info.launch_id) if sc.node_cache == "on" or (
        sc.node_cache == "auto" and not start.store.local) else None
    return Snapshotter(start.store, writer=parallel.writer, writers=info.world_size, copies=parallel.copies,
                       stages=parallel.stages,
                       group=distributed.side_group(), keep_last=sc.keep_last, keep_every=sc.keep_every,
                       retries=sc.retries, events=metrics.write, cache=cache, guard=lease.check if lease else None)


def load_snapshot(cfg: RunConfig, trainer: Trainer, start: Start) -> None:
    """Every rank loads its share of the newest good snapshot into the live tensors."""
    info, first, snapshotter = trainer.info, start.manifest, trainer.snapshotter
    slots = trainer.parallel.slots(trainer.optimizer)
    t0 = time.perf_counter()
    cache = snapshotter.cache if start.source is start.store else None

    def load(path: str, manifest: dict) -> dict:
        return restore(start.source, path, manifest, slots, rank=info.rank, world=info.world_size,
                       layout=cfg.snapshot.load_layout, cache=cache)

    manifest, extra = newest_that_loads(start.source, start.candidates, load,
                                        lambda m: m is first or check_compatible(cfg, m), reject=info.rank == 0)
    trainer.load_state(extra)
    log.info("resumed from snapshot step %d in %.2fs (saved by %d rank%s with %s, now %d with %s; torchrun restart "
             "%d here)", trainer.progress.step, time.perf_counter() - t0, manifest["world_size"],
             "" if manifest["world_size"] == 1 else "s", layout_name(manifest),
             info.world_size, layout_name({**trainer.parallel.layout(), "stages": trainer.parallel.stages}),
             info.restart_count)
    trainer.metrics.write({"kind": "resume", "step": trainer.progress.step, "world_size": info.world_size})
