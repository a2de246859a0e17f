"""A replica group's process as main.py assembles its run (mingpt.replicas): a member of its own in the job,
the warm spare it may be, its Replicas, and what its ReplicaTrainer takes beside a Trainer's parts."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

from mingpt.config.schema import RunConfig
from mingpt.replicas import ReplicaExit, Replicas, member_view, one_launch
from mingpt.replicas.standby import MemberLock, release
from mingpt.replicas.wire import contexts
from mingpt.runtime import distributed
from mingpt.runtime.distributed import DistInfo, PreemptionFlag
from mingpt.runtime.trust import job_secret
from mingpt.snapshot.lease import Lease
from mingpt.training.ledger import Ledger
from mingpt.training.replica_trainer import LOOK_EVERY_S, ReplicaTrainer, RunFinished
from mingpt.training.snapshots import Start, append_once, load_snapshot, where_to_start

log = logging.getLogger(__name__)


def as_member(cfg: RunConfig, info: DistInfo) -> DistInfo:
    """The process as its run sees it. A replica group's: a member of its own, with no process group of its
    torchrun (with FSDP or tensor parallelism its torchrun's processes split the model between them), in the
    job's one launch (mingpt.replicas: member_view, one_launch); its place in its torchrun kept in `torchrun`."""
    if not cfg.replicas.enabled:
        return info
    return one_launch(replace(member_view(info, sharded=splits_the_model(cfg)), torchrun=info))


def splits_the_model(cfg: RunConfig) -> bool:
    """The processes of a replica group split the model between them: FSDP or tensor parallelism."""
    return cfg.trainer.parallel == "fsdp" or cfg.trainer.tensor_parallel > 1


class ReplicaLaunch:
    """This process's side of a replica-group job (replicas.peers set) while its run is assembled: its
    Replicas, built at once (listening first: the other groups see it start), unless another process of
    this node is its member already (it holds the member's lock: mingpt/replicas/standby.py); then this
    one is that member's spare: built like it, it stands by (`stand_by`)."""

    def __init__(self, cfg: RunConfig, info: DistInfo):
        self.place = info.torchrun or info  # its place in its group's torchrun
        self.spare = spare_lock(cfg, self.place)
        self.replicas = self.build(cfg) if self.spare is None else None

    def build(self, cfg: RunConfig) -> Replicas:
        return Replicas.build(cfg.replicas, self.place, job_secret(), sharded=splits_the_model(cfg),
                              tp=cfg.trainer.tensor_parallel)

    def stand_by(self, cfg: RunConfig, info: DistInfo, lease: Lease | None, start: Start, ledger: Ledger,
                 preempt: PreemptionFlag | None) -> Start:
        """A spare, built, waits for its member's lock; then it starts as the member would, from where the
        run is now (its Replicas built then), its start counted from here (the wait was no start-up of the
        job's). ReplicaExit when it is stopped, or the run finished, before it took the place. A member: `start`."""
        lock = self.spare
        if lock is None:
            return start
        me = f"group {cfg.replicas.group}" + (f" process {self.place.local_rank}" if self.place.local_world_size > 1 else "")
        log.info("replica %s runs on this node already: this process stands by as its spare, built, and takes its "
                 "place the moment it exits", me)
        contexts(lock.secret)  # its TLS libraries imported now, not after the takeover (tens of ms there)
        waited, finished = time.monotonic(), RunFinished(start.store, cfg.trainer.max_steps, first_look_s=LOOK_EVERY_S)
        over = f"replica {me}'s spare ends: the run finished while it stood by"
        if not lock.wait(lambda: (preempt is not None and preempt.requested) or finished()):
            if preempt is not None and preempt.requested:
                raise ReplicaExit(f"replica {me}'s spare stopped while standing by (it trained nothing: nothing to save)",
                                  distributed.EXIT_PREEMPTED)
            raise ReplicaExit(over, 0)
        start = where_to_start(cfg, info, lease)[1]
        if start.manifest and start.manifest["step"] >= cfg.trainer.max_steps:  # its member exited at the end
            release(lock.secret, lock.member)
            raise ReplicaExit(over, 0)
        log.info("replica %s: its process exited; this spare takes its place (stood by %.0f s)", me, time.monotonic() - waited)
        ledger.begin_again()
        self.replicas = self.build(cfg)
        return start

    @staticmethod
    def heals(cfg: RunConfig, start: Start) -> bool:
        """The process heals from live peers: the snapshot its start found is read only if none is live
        (and at once, by main.assemble, when it is the run's last)."""
        return bool(start.candidates and start.manifest["step"] < cfg.trainer.max_steps)

    def trainer(self, cfg: RunConfig, info: DistInfo, start: Start, started: Callable) -> Callable[..., ReplicaTrainer]:
        """The ReplicaTrainer, to be given a Trainer's parts: it records its start (`started`, record_start's
        partial) once it joined, at the step it healed to."""
        resume = partial(load_snapshot, cfg, start=start) if self.heals(cfg, start) else None
        return partial(ReplicaTrainer, replicas=self.replicas, resume=resume,
                       joined=partial(started, partial(append_once, cfg.trainer.run_dir, info)))


def spare_lock(cfg: RunConfig, place: DistInfo) -> MemberLock | None:
    """Where another process of this node is this process's member already (it holds the member's lock),
    the lock this one, its spare, waits for; else None (the lock taken, or no secret: Replicas.build says
    what to do)."""
    secret = job_secret()
    if secret is None:
        return None
    lock = MemberLock(secret, cfg.replicas.group * place.local_world_size + place.local_rank)
    return None if lock.take() else lock
