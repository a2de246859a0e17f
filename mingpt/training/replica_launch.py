"""A replica group's process as main.py assembles its run (mingpt.replicas): a member of its own in the job,
the warm spare it may be, its Replicas, and what its ReplicaTrainer takes beside a Trainer's parts."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

from mingpt.config.schema import RunConfig
from mingpt.replicas import ReplicaExit, Replicas, member_view
from mingpt.replicas.standby import MemberLock, release
from mingpt.replicas.wire import contexts
from mingpt.runtime.distributed import DistInfo
from mingpt.runtime.exits import Exit, PreemptionFlag
from mingpt.runtime.trust import derive, job_secret
from mingpt.training.replica_trainer import LOOK_EVERY_S, ReplicaTrainer, RunFinished
from mingpt.training.startup import Start, append_once, load_snapshot, where_to_start

log = logging.getLogger(__name__)


def as_member(cfg: RunConfig, info: DistInfo) -> DistInfo:
    """The process as its run sees it: a replica group's is a member of its own (mingpt.replicas.member_view), its
    place in its torchrun kept in `torchrun`; every group of a job is one launch, its id the job secret's, not its
    torchrun's nonce (MINGPT_LAUNCH_ID): the groups share one lease and one run (docs/replicas.md)."""
    if not cfg.replicas.enabled:
        return info
    member, secret = replace(member_view(info, sharded=splits_the_model(cfg)), torchrun=info), job_secret()
    return replace(member, launch_id=derive(secret, "launch")[:16]) if secret else member


def splits_the_model(cfg: RunConfig) -> bool:
    """The processes of a replica group split the model between them: FSDP or tensor parallelism."""
    return cfg.trainer.parallel == "fsdp" or cfg.trainer.tensor_parallel > 1


class ReplicaLaunch:
    """This process's side of a replica-group job (replicas.peers set) while its run is assembled: its Replicas,
    built at once (listening first: the other groups see it start), unless another process of this node is its
    member already (it holds the member's lock: mingpt/replicas/standby.py): then it is that member's `spare`."""

    def __init__(self, cfg: RunConfig, info: DistInfo):
        place, secret = info.torchrun or info, job_secret()  # its place in its group's torchrun
        self.build = partial(Replicas.build, cfg.replicas, place, secret, sharded=splits_the_model(cfg),
                             tp=cfg.trainer.tensor_parallel)  # (without a secret it says what to do)
        lock = secret and MemberLock(secret, cfg.replicas.group * place.local_world_size + place.local_rank)
        self.spare = lock if lock and not lock.take() else None
        self.replicas = None if self.spare else self.build()
        self.me = f"group {cfg.replicas.group}" + (f" process {place.local_rank}" if place.local_world_size > 1 else "")

    def stand_by(self, cfg: RunConfig, info: DistInfo, lease, start: Start, ledger, preempt) -> Start:
        """A spare, built, waits for its member's lock; then it starts as the member would, from where the
        run is now (its Replicas built then), its start counted from here (the wait was no start-up of the
        job's). ReplicaExit when it is stopped, or the run finished, before it took the place. A member: `start`."""
        lock, me, preempt = self.spare, self.me, preempt or PreemptionFlag()
        if lock is None:
            return start
        log.info("replica %s runs on this node already: this process stands by as its spare, built, and takes its "
                 "place the moment it exits", me)
        contexts(lock.secret)  # its TLS libraries imported now, not after the takeover (tens of ms there)
        waited, finished = time.monotonic(), RunFinished(start.store, cfg.trainer.max_steps, first_look_s=LOOK_EVERY_S)
        over = f"replica {me}'s spare ends: the run finished while it stood by"
        if not lock.wait(lambda: preempt.requested or finished()):
            if preempt.requested:
                raise ReplicaExit(f"replica {me}'s spare stopped while standing by (it trained nothing: nothing to save)",
                                  Exit.PREEMPTED)
            raise ReplicaExit(over, 0)
        start = where_to_start(cfg, info, lease)[1]
        if start.manifest and start.manifest["step"] >= cfg.trainer.max_steps:  # its member exited at the end
            release(lock.secret, lock.member)
            raise ReplicaExit(over, 0)
        log.info("replica %s: its process exited; this spare takes its place (stood by %.0f s)", me, time.monotonic() - waited)
        ledger.begin_again()
        self.replicas = self.build()
        return start

    @staticmethod
    def heals(cfg: RunConfig, start: Start) -> bool:
        """It heals from live peers (the snapshot its start found is read only if none is), unless that is the last."""
        return bool(start.candidates and start.manifest["step"] < cfg.trainer.max_steps)

    def trainer(self, cfg: RunConfig, info: DistInfo, start: Start, started: Callable) -> Callable[..., ReplicaTrainer]:
        """The ReplicaTrainer, given a Trainer's parts: it records its start (`started`) once joined, at the step healed to."""
        resume = partial(load_snapshot, cfg, start=start) if self.heals(cfg, start) else None
        return partial(ReplicaTrainer, replicas=self.replicas, resume=resume,
                       joined=partial(started, partial(append_once, cfg.trainer.run_dir, info)))
