"""The training loop: train(), train_step(), evaluate(); what must survive a restart is registered
with the Trainer (the parallel strategy's tensors and the `stateful` parts)."""

from __future__ import annotations

import contextlib
import logging
import time

import numpy as np
import torch
import torch.nn as nn

from mingpt.config import OptimConfig, TrainerConfig
from mingpt.distributed import DistInfo, all_gather_floats, all_reduce_sum
from mingpt.parallel import Parallel
from mingpt.replicas import MembershipChanged, Replicas, flat_grads
from mingpt.snapshot import SaveFailedError, Snapshotter
from mingpt.training.ledger import Ledger
from mingpt.training.metrics import MetricsWriter, StepTimer, duration, peak_flops, progress_bar, train_record
from mingpt.training.optim import lr_at
from mingpt.training.policy import SavePolicy
from mingpt.training.state import Progress, StepStats, Todo, TrainData
from mingpt.training.watchdog import Watchdog

log = logging.getLogger(__name__)


class Trainer:
    """The training loop over parts that main.py builds (constructing it runs no collective). It does
    not know the parallel strategy: `parallel` answers for it, and gives the tensors a snapshot holds;
    the `stateful` parts' state_dict() make the rest. `policy` decides when to save and stop, the
    `snapshotter` saves."""

    def __init__(self, *, cfg: TrainerConfig, optim_cfg: OptimConfig, parallel: Parallel,
                 optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, data: TrainData,
                 snapshotter: Snapshotter, policy: SavePolicy, meta: dict, metrics: MetricsWriter, info: DistInfo,
                 hosts: list[str], ledger: Ledger | None = None, replicas: Replicas | None = None):
        self.cfg, self.optim_cfg, self.parallel, self.optimizer, self.scaler = cfg, optim_cfg, parallel, optimizer, scaler
        self.data, self.snapshotter, self.policy, self.meta = data, snapshotter, policy, meta
        self.metrics, self.info, self.hosts, self.progress = metrics, info, hosts, Progress()
        self.ledger = ledger or Ledger()  # where this process's time goes (records: "time")
        self.watchdog = Watchdog(cfg.watchdog_s, f"rank {info.rank} ({info.hostname}:{info.local_rank})")
        self.stateful = {"scaler": scaler, "sampler": data.sampler, "trainer": self.progress}
        self.device = torch.device(info.device)
        self.amp_dtype = _amp_dtype(cfg.precision, self.device.type)
        self.pin = self.device.type == "cuda"  # pinned host memory: the copy to the GPU overlaps compute
        self.replicas = replicas  # replica groups (mingpt.replicas): the step's shares and its exchange
        # replica groups: the snapshot's loader while no member is live; the run ended while away; the
        # (step, shares' gradients) computed when that step's epoch broke
        self.resume, self.finished_elsewhere, self._store_checked, self._redo = None, False, 0.0, None
        self.joined = lambda: None  # replica groups: called once this member joined its first epoch (healed)
        if replicas is not None:
            policy.agreed = lambda: replicas.flags

    @property
    def leads(self) -> bool:
        """This process logs and saves for the job: rank 0, or the first member of the replica epoch."""
        return self.replicas.leads if self.replicas else self.info.is_rank0

    def train(self) -> bool:
        """Train to max_steps; False when stopped early by a preemption signal (after saving)."""
        p, cfg = self.progress, self.cfg
        if p.step >= cfg.max_steps:
            log.info("already at step %d of %d; nothing to train", p.step, cfg.max_steps)
            return True
        where = (f"replica {self.replicas.me} ({self.replicas.groups // self.replicas.procs} groups)"
                 if self.replicas else
                 f"{self.info.world_size} rank{'' if self.info.world_size == 1 else 's'}")
        log.info("training from step %d to %d on %s (%s), precision %s%s", p.step, cfg.max_steps, where,
                 self.parallel, self.amp_dtype or "fp32", ", deterministic kernels" if cfg.deterministic else "")
        if self.policy.stop_requested():
            if self.info.is_rank0:
                log.warning("%s before the first step", self.policy.preempt.describe())
            return False
        self.watchdog.start()
        self.ledger.switch("first_step")
        self._t0 = time.monotonic()
        try:
            with progress_bar(self.info.is_rank0 and cfg.progress, p.step, cfg.max_steps) as bar:
                finished = self._loop(bar)
            if finished and self.leads and p.step >= cfg.max_steps:
                val = f", best val loss {p.best_val_loss:.4f}" if p.best_val_loss < float("inf") else ""
                log.info("finished: step %d in %s%s; snapshot in %s (sample: mingpt-generate %s)", p.step,
                         duration(time.monotonic() - self._t0), val, self.snapshotter.store.url, cfg.run_dir)
            return finished
        finally:
            self.watchdog.stop()  # on every exit path, errors included

    def _loop(self, bar) -> bool:
        """nanoGPT's loop: a step; then what to do after it, decided once; then that, in order. The
        step time logged is the ledger's (the seconds in its step states), so evaluating and saving
        never count as steps."""
        p, cfg = self.progress, self.cfg
        if self.replicas:
            if not self.regroup("start"):
                return self.finished_elsewhere
            self.joined()
        timer = StepTimer(self.ledger.step_seconds, p.step)  # after the heal: the step it healed to
        while p.step < cfg.max_steps:
            try:
                stats = self.train_step()
            except MembershipChanged as e:  # the step is dropped on every member; the next epoch trains it
                if not self.regroup(str(e)):
                    return self.finished_elsewhere
                timer.restart(p.step)
                continue
            p.step, p.tokens_seen = p.step + 1, p.tokens_seen + stats.tokens
            self.watchdog.beat(p.step)
            bar.update(1)
            todo = self.decide(p.step)
            if todo.log:
                self._log_train(stats, timer.per_step(p.step))
            if todo.evaluate:
                self.evaluate()
            if todo.save:
                self.save_snapshot()
                self.watchdog.beat(p.step)
            if todo.record_time:
                self.record_time()
            if self.replicas and self.replicas.rejoin_pending and not todo.stop and p.step < cfg.max_steps:
                # a group waits to join: let it in now, between steps
                if not self.regroup("a group joins"):
                    return self.finished_elsewhere
                timer.restart(p.step)  # a member behind the others was healed forward
            if todo.stop:
                self.finish_saving(self.policy.preempt.describe())
                if self.leads and self.policy.preempt.restarting:  # nobody need act: say so, quietly
                    log.info("torchrun restarts the workers: snapshot of step %d saved; they resume from it", p.step)
                elif self.leads:  # every rank stops; one says so
                    log.warning("%s: snapshot of step %d saved; the same command resumes from it",
                                self.policy.preempt.describe(), p.step)
                return False
        self.finish_saving(f"the run reached step {p.step}")
        return True

    def regroup(self, why: str) -> bool:
        """Form the next replica epoch and bring every member to the newest state among them; False
        when a preemption signal came first (the process stops without saving: it is no member)."""
        t0, p = time.monotonic(), self.progress
        with self.ledger.during("regroup"):
            while True:
                epoch = self.replicas.form(p.step, lambda: self.policy.preempt.requested or self._finished_elsewhere(),
                                           why)
                if epoch is None and self.finished_elsewhere:
                    log.info("the other replica groups finished the run (its snapshot of step %d is committed) while "
                             "this group was away: nothing left to train", self.cfg.max_steps)
                    return False
                if epoch is None:
                    log.warning("%s while waiting to join the replica groups", self.policy.preempt.describe())
                    return False
                self.metrics.enabled = self.leads  # one member writes the job's records
                if self.resume is not None and not any(m.live for m in epoch.members):  # the job (re)starts
                    with self.ledger.during("restore"):
                        self.resume()
                    self.resume = None
                    continue  # announce the step loaded
                self.resume = None  # a live member holds the job's state: heal from it, never load
                try:
                    source, healed = self.replicas.heal(self.parallel.held(self.optimizer), self._state_json,
                                                        self.load_state)
                    break
                except MembershipChanged as e:  # lost while healing: form the next epoch
                    why = str(e)
        if self.replicas.beacon.group in healed:
            self._redo = None  # other weights now: nothing computed before holds
            log.info("healed from replica %s: at step %d", self.replicas.beacon.name(source), p.step)
        if self.leads:
            self.metrics.write({"kind": "epoch", "step": p.step, "epoch": epoch.number, "groups": epoch.groups(),
                                "why": why, "regroup_s": round(time.monotonic() - t0, 4), "healed": healed,
                                "healed_from": source if healed else None})
        return True

    def _finished_elsewhere(self) -> bool:
        """While this group waits to join: whether the others finished the run meanwhile (its last
        snapshot is committed; looked for every few seconds)."""
        if time.monotonic() - self._store_checked < 5:
            return False
        self._store_checked = time.monotonic()
        try:
            self.finished_elsewhere = any(s.committed and s.step >= self.cfg.max_steps
                                          for s in self.snapshotter.store.list())
        except Exception as e:  # noqa: BLE001 - an unreadable store: keep waiting for the groups
            log.warning("cannot list %s (%s); waiting on", self.snapshotter.store.url, e)
        return self.finished_elsewhere

    def _state_json(self) -> dict:
        """The registered parts' state (sampler, counters, scaler): plain containers, saved and healed alike."""
        return {name: part.state_dict() for name, part in self.stateful.items()}

    def decide(self, step: int) -> Todo:
        """What to do after `step`, the same on every rank: logging and evaluation by their intervals,
        saving and stopping by the policy. Time is recorded after the first step (it ends the
        start-up) and whenever anything else is done."""
        cfg, last = self.cfg, step == self.cfg.max_steps
        todo = Todo(log=step % cfg.log_every == 0 or last,
                    evaluate=bool(cfg.eval_every and (step % cfg.eval_every == 0 or last)))
        todo.save, todo.stop = self.policy.after_step(step, last)
        todo.record_time = not self.ledger.steady or todo.log or todo.evaluate or todo.save
        return todo

    def finish_saving(self, why: str) -> None:
        """Wait for the last save; raise SaveFailedError on every rank if it did not commit anywhere:
        a run must never stop as if saved when its last snapshot is not."""
        with self.ledger.during("snapshot"):
            ok = self.snapshotter.wait() is not False
            if all_reduce_sum(torch.tensor([0.0 if ok else 1.0], device=self.device)).item() > 0:
                raise SaveFailedError(
                    f"{why}, but the snapshot of step {self.progress.step} could not be saved to "
                    f"{self.snapshotter.store.url} (the errors above say why): {self.snapshotter.newest()}. Fix the "
                    "store (permissions, space, credentials) and run the same command: it resumes from there")
        self.record_time()

    def record_time(self) -> None:
        """The "time" record: every rank's seconds by state so far, averaged (a collective)."""
        if not self.ledger.steady:  # the first record ends the start-up
            self.ledger.started()
        with self.ledger.during("log"):
            self.ledger.record(self.metrics.write, self.progress.step,
                               lambda v: all_gather_floats(v, self.info.device))

    def train_step(self) -> StepStats:
        """One optimizer step over the next global batch, split over ranks and micro-batches. No
        host sync: the loss and the gradient norm stay on the device (replica groups: `Replicas.reduce` syncs)."""
        t0 = time.perf_counter()
        self.ledger.switch("step_data")
        step = self.progress.step
        before = self.data.sampler.state_dict() if self.replicas else None
        micro_batches = self.data.sampler.next_step()  # the global step's, the same for any world size
        # every rank knows the global token count from the plan: no collective normalises the loss
        global_tokens = self.data.train.tokens_in(np.concatenate(micro_batches))
        # replica groups: the split of a world of one rank per share, whichever groups are alive
        # (sharded groups: every share cut into a part per process of the group)
        split = self.data.sampler.split(micro_batches, self.replicas.shares_total * self.replicas.parts
                                        if self.replicas else self.parallel.data_world)
        lr = lr_at(step, self.optim_cfg.lr, self.optim_cfg.min_lr, self.optim_cfg.warmup_steps, self.cfg.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.parallel.model.train()
        if self.replicas:
            loss_sum = self._replica_shares(step, split, micro_batches, global_tokens, before)
        else:
            loss_sum = self._accumulate(_weighted(split[self.parallel.data_rank], micro_batches), global_tokens, step)
        compute_s = max(0.0, self.parallel.grads_ready_t - t0)
        self.scaler.unscale_(self.optimizer)  # nanoGPT's order: clip the true gradients
        grad_norm = self.parallel.clip_grad_norm(self.optim_cfg.grad_clip)
        self.scaler.step(self.optimizer)  # fp16 only: a sync (the scaler reads whether a gradient overflowed)
        self.scaler.update()
        return StepStats(loss_sum, global_tokens, grad_norm, lr, compute_s, split)

    def _replica_shares(self, step: int, split: list, micro_batches: list, global_tokens: int, before: dict) -> torch.Tensor:
        """This member's shares of the step, exchanged (`Replicas.reduce`); their summed token loss. Shares
        done when an epoch broke are kept for the step's redo (the same weights and samples, the same gradients)."""
        mine = self.replicas.shares()
        rows = {s: row for s, row in self._redo[1].items() if s in mine} if self._redo and self._redo[0] == step else {}
        if rows:
            log.info("step %d trained again: %d of this group's shares done before the fault kept", step, len(rows))
        try:
            r = self.replicas
            for share in mine:
                if share not in rows:
                    part = split[share * r.parts + r.part]
                    loss = self._accumulate(_weighted(part, micro_batches), global_tokens, step)
                    rows[share] = (flat_grads(self.parallel.gpt), loss, part)
                    if not r.sharded:  # a member lost: on to the redo now, not after the other shares
                        r.check()  # (sharded, the group's processes decide together, in the exchange)
            self.ledger.switch("step_compute")
            timed = 0 < self.policy.every_s <= time.monotonic() - self.policy.last_save_t
            total = self.replicas.reduce(self.parallel.gpt, rows, step, self.policy.preempt.requested, timed)
        except MembershipChanged:
            self.data.sampler.load_state_dict(before)  # the step is trained again, by the next epoch
            self._redo = (step, rows)
            raise
        self._redo = None
        return torch.tensor(total, device=self.device)

    def _accumulate(self, micro_here: list[tuple[np.ndarray, float]], global_tokens: int, step: int) -> torch.Tensor:
        """Forward and backward over one rank's micro-batches (weight 0: run, not counted) into zeroed
        gradients; their summed token loss, on the device."""
        self.optimizer.zero_grad(set_to_none=True)
        model, world = self.parallel.model, self.replicas.parts if self.replicas else self.parallel.data_world
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        x, y = self._fetch(micro_here[0][0])
        for i, (mb, weight) in enumerate(micro_here):
            if self.parallel.gpt.config.dropout > 0:
                # dropout noise of (seed, step, first sample): the same after a resume, on any rank
                torch.manual_seed(hash((self.cfg.seed, step, int(mb[0]) if weight else -1)) & 0x7FFF_FFFF_FFFF)
            with self.parallel.sync(last=i == len(micro_here) - 1):
                with _autocast(self.device.type, self.amp_dtype):
                    _, loss = model(x, y, reduction="sum")
                if i + 1 < len(micro_here):  # the next micro-batch, built while the device runs the forward
                    x, y = self._fetch(micro_here[i + 1][0])
                # gradients are averaged over data ranks: their count / global tokens makes them those of the
                # mean token loss of the whole global batch, however unevenly the samples were split
                # (replica groups sum the shares' gradients instead: a world of 1, or of a sharded group's parts)
                self.scaler.scale(loss * (weight * world / global_tokens)).backward()
            loss_sum += loss.detach().float() * weight
        return loss_sum

    def _fetch(self, samples: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """A micro-batch on the device; on a GPU through pinned memory, so the copy does not wait."""
        self.ledger.switch("step_data")
        x, y = self.data.train.batch(samples)
        if self.pin:
            x, y = x.pin_memory(), y.pin_memory()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        self.ledger.switch("step_compute")
        return x, y

    def evaluate(self) -> float:
        """Validation loss over the fixed subset, across ranks; the best one is kept."""
        p = self.progress
        with self.ledger.during("eval"):
            val_loss = validation_loss(self.parallel.gpt, self.data, self.device, self.amp_dtype)
        p.best_val_loss = min(p.best_val_loss, val_loss)
        if not self.leads:
            return val_loss
        log.info("step %d | val loss %.4f | best %.4f", p.step, val_loss, p.best_val_loss)
        self.metrics.write({"kind": "eval", "step": p.step, "val_loss": val_loss})
        return val_loss

    def close(self, wait: bool = True) -> None:
        """Stop the watchdog, finish (or abandon, after an error) the last save, close the rest."""
        self.watchdog.stop()
        self.snapshotter.close(wait=wait)
        self.metrics.close()
        self.parallel.close()
        self.data.corpus.close()
        if self.replicas:
            self.replicas.close()

    def save_snapshot(self) -> None:
        """Every rank writes its share of the state; the first commits it."""
        p = self.progress
        manifest = {**self.meta, "tokens_seen": p.tokens_seen, "world_size": self.info.world_size,
                    "parallel": self.parallel.name, "aliases": self.parallel.aliases()}
        extra = self._state_json()
        with self.ledger.during("snapshot"):
            self.policy.saved()
            if self.replicas and not self.replicas.saves:  # one member (sharded: one group) saves for the job
                return
            self.snapshotter.save(p.step, self.parallel.slots(self.optimizer), extra, manifest)

    def load_state(self, extra: dict) -> None:
        """The registered parts' state from a snapshot (the tensors are loaded in place already)."""
        for name, part in self.stateful.items():
            if extra.get(name):  # a disabled GradScaler saves nothing
                part.load_state_dict(extra[name])

    def _log_train(self, stats: StepStats, step_s: float) -> None:
        """The train record (collectives: the loss and every rank's compute time; sync: read on the host)."""
        with self.ledger.during("log"):
            # every process of a tensor-parallel group computed the same loss of the same share
            loss = all_reduce_sum(stats.loss_sum.clone()).item() / (stats.tokens * self.parallel.data_copies)
            compute = [c[0] for c in all_gather_floats([stats.compute_s], self.info.device)]
            if self.leads:
                p = self.progress
                step = {"step": p.step, "tokens_seen": p.tokens_seen, "tokens": stats.tokens, "lr": stats.lr,
                        "grad_norm": stats.grad_norm.item()}
                record = train_record(step, loss, step_s, compute, self.hosts,
                                      self.parallel.gpt.flops_per_token(self.data.train.block_size),
                                      peak_flops(self.cfg, self.info, self.device))
                world, shares = ((self.replicas.epoch.world, {"groups": self.replicas.epoch.groups(),
                                  "shares": self.replicas.shares_record}) if self.replicas else (self.info.world_size, {}))
                self.metrics.write({**record, "epoch": self.data.sampler.epoch, "world_size": world,
                                    **self.data.train.batch_stats(stats.split), **shares})


@torch.no_grad()
def validation_loss(model: nn.Module, data: TrainData, device: torch.device, amp_dtype) -> float:
    """Sum of token losses / token count over this rank's validation batches, summed across ranks."""
    model.eval()
    sums = torch.zeros(2, device=device, dtype=torch.float64)  # (loss sum, tokens)
    for batch in data.val_batches:
        # an empty batch (a rank with fewer batches) still runs a forward pass, whose loss is not counted
        x, y = (t.to(device, non_blocking=True) for t in data.val.batch(batch if len(batch) else np.zeros(1, int)))
        with _autocast(device.type, amp_dtype):
            _, loss = model(x, y, reduction="sum")
        if len(batch):
            sums[0] += loss.double()
            sums[1] += data.val.tokens_in(batch)
    all_reduce_sum(sums)
    model.train()
    return (sums[0] / sums[1]).item()


def _amp_dtype(precision: str, device_type: str) -> torch.dtype | None:
    if precision == "auto":
        return torch.bfloat16 if device_type == "cuda" else None
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def _autocast(device_type: str, dtype: torch.dtype | None):
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type=device_type, dtype=dtype)


def _weighted(mbs: list[np.ndarray], micro_batches: list[np.ndarray]) -> list[tuple[np.ndarray, float]]:
    """Micro-batches with weights; an empty one still runs (weight 0): every rank joins every reduction."""
    return [(mb, 1.0) if len(mb) else (micro_batches[0][:1], 0.0) for mb in mbs]
