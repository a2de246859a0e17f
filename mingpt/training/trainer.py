"""The training loop: train(), train_step(), evaluate(); what must survive a restart is registered
with the Trainer (the parallel strategy's tensors and the `stateful` parts)."""

from __future__ import annotations

import contextlib
import logging
import time

import numpy as np
import torch
import torch.nn as nn

from mingpt.config.schema import OptimConfig, TrainerConfig
from mingpt.parallel.layouts import Parallel
from mingpt.runtime.distributed import DistInfo, all_gather_floats, all_reduce_sum
from mingpt.snapshot import SaveFailedError, Snapshotter
from mingpt.training.ledger import Ledger
from mingpt.training.metrics import MetricsWriter, StepTimer, duration, peak_flops, progress_bar, train_record
from mingpt.training.optim import lr_at
from mingpt.training.policy import SavePolicy
from mingpt.training.state import Progress, Role, StepStats, Todo, TrainData
from mingpt.training.watchdog import Watchdog

log = logging.getLogger(__name__)


class StopTraining(Exception):
    """Raised by a layer's seam to end the run where it is: `finished` is what train() returns."""

    def __init__(self, finished: bool):
        super().__init__(finished)
        self.finished = finished


class Trainer:
    """The training loop over parts that main.py builds (constructing it runs no collective). It does
    not know the parallel strategy: `parallel` answers for it, and gives the tensors a snapshot holds;
    the `stateful` parts' state_dict() make the rest. `policy` decides when to save and stop, the
    `snapshotter` saves."""

    def __init__(self, *, cfg: TrainerConfig, optim_cfg: OptimConfig, parallel: Parallel,
                 optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, data: TrainData,
                 snapshotter: Snapshotter, policy: SavePolicy, meta: dict, metrics: MetricsWriter, info: DistInfo,
                 hosts: list[str], ledger: Ledger):
        self.cfg, self.optim_cfg, self.parallel, self.optimizer, self.scaler = cfg, optim_cfg, parallel, optimizer, scaler
        self.data, self.snapshotter, self.policy, self.meta = data, snapshotter, policy, meta
        self.metrics, self.info, self.hosts, self.progress = metrics, info, hosts, Progress()
        self.ledger = ledger  # where this process's time goes (records: "time")
        self.watchdog = Watchdog(cfg.watchdog_s, f"rank {info.rank} ({info.hostname}:{info.local_rank})")
        self.stateful = {"scaler": scaler, "sampler": data.sampler, "trainer": self.progress}
        self.device = torch.device(info.device)
        self.amp_dtype = _amp_dtype(cfg.precision, self.device.type)
        self.pin = self.device.type == "cuda"  # pinned host memory: the copy to the GPU overlaps compute
        # what this process does for the job (a layer sets its own): rank 0 leads, every rank saves its share
        self.role = Role(leads=info.is_rank0, saves=True,
                         name=f"{info.world_size} rank{'' if info.world_size == 1 else 's'}")

    # --- the seams a layer over the loop overrides, train_step() too (a subclass: the loop stays as it is)
    def begin(self) -> None:
        """Before the first step (raise StopTraining to end the run here)."""

    def compute(self, step: int, micro_batches: list, global_tokens: int) -> tuple[torch.Tensor, list]:
        """This rank's part of the step's forward and backward, its gradients reduced: the summed token
        loss, and the step's split (every data rank's micro-batches)."""
        world = self.parallel.data_world
        split = self.data.sampler.split(micro_batches, world)
        return self.forward_backward(step, split[self.parallel.data_rank], micro_batches, global_tokens, world), split

    def after_step(self) -> bool:
        """After a step's work, unless the run ends there; True when the state changed under the step
        timer (it restarts)."""
        return False

    def record_extra(self) -> dict:
        """What a train record adds: the world size (and a layer's own fields)."""
        return {"world_size": self.info.world_size}

    def peak(self) -> float:
        """The peak FLOP/s of the hardware that trains the step, for MFU: the job's ranks'."""
        return peak_flops(self.cfg, self.info, self.device)

    def train(self) -> bool:
        """Train to max_steps; False when stopped early by a preemption signal (after saving)."""
        p, cfg = self.progress, self.cfg
        if p.step >= cfg.max_steps:
            log.info("already at step %d of %d; nothing to train", p.step, cfg.max_steps)
            return True
        self.watchdog.start()
        self.ledger.switch("first_step")
        self._t0 = time.monotonic()
        try:
            self.begin()  # (a replica group's member learns its step here: healed from the others, or loaded)
            log.info("training from step %d to %d on %s (%s), precision %s%s", p.step, cfg.max_steps, self.role.name,
                     self.parallel, self.amp_dtype or "fp32", ", deterministic kernels" if cfg.deterministic else "")
            if self.policy.stop_requested():
                if self.role.leads:
                    log.warning("%s before the first step", self.policy.preempt.describe())
                return False
            # the bar is the terminal's: its torchrun's first process shows it (a replica group's, its own)
            with progress_bar(self.info.is_rank0 and cfg.progress, p.step, cfg.max_steps) as bar:
                finished = self._loop(bar)
        except StopTraining as e:
            finished = e.finished
        finally:
            self.watchdog.stop()  # on every exit path, errors included
        if finished and self.role.leads and p.step >= cfg.max_steps:
            val = f", best val loss {p.best_val_loss:.4f}" if p.best_val_loss < float("inf") else ""
            log.info("finished: step %d in %s%s; snapshot in %s (sample: mingpt-generate %s)", p.step,
                     duration(time.monotonic() - self._t0), val, self.snapshotter.store.url, cfg.run_dir)
        return finished

    def _loop(self, bar) -> bool:
        """nanoGPT's loop: a step; then what to do after it, decided once; then that, in order. The
        step time logged is the ledger's (the seconds in its step states), so evaluating and saving
        never count as steps."""
        p, cfg = self.progress, self.cfg
        timer, shown = StepTimer(self.ledger.step_seconds, p.step), p.step
        while p.step < cfg.max_steps:
            stats = self.train_step()
            if stats is None:  # dropped: trained again from the state now held
                timer.restart(p.step)
                continue
            p.step, p.tokens_seen = p.step + 1, p.tokens_seen + stats.tokens
            self.watchdog.beat(p.step)
            # the bar shows the job's step: a heal moves it without training here (its rate is the job's too)
            bar.update(p.step - shown)
            shown = p.step
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
            if not todo.stop and p.step < cfg.max_steps and self.after_step():
                timer.restart(p.step)
            if todo.stop:
                self.finish_saving(self.policy.preempt.describe())
                if self.role.leads and self.policy.preempt.restarting:  # nobody need act: say so, quietly
                    log.info("torchrun restarts the workers: snapshot of step %d saved; they resume from it", p.step)
                elif self.role.leads and self.says_stop():  # every rank stops; one says so
                    log.warning("%s: snapshot of step %d saved; the same command resumes from it",
                                self.policy.preempt.describe(), p.step)
                return False
        self.finish_saving(f"the run reached step {p.step}")
        return True

    def says_stop(self) -> bool:
        """Whether the leader's line says the job stopped on a preemption signal and resumes from its snapshot
        (a replica group that leaves while the others train on has said what it does instead)."""
        return True

    def state_json(self) -> dict:
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

    def train_step(self) -> StepStats | None:
        """One optimizer step over the next global batch, split over ranks and micro-batches (a layer's:
        None when the step was dropped, to be trained again from the state then held). No host sync:
        the loss and the gradient norm stay on the device."""
        t0 = time.perf_counter()
        self.ledger.switch("step_data")
        step = self.progress.step
        micro_batches = self.data.sampler.next_step()  # the global step's, the same for any world size
        # every rank knows the global token count from the plan: no collective normalises the loss
        global_tokens = self.data.train.tokens_in(np.concatenate(micro_batches))
        lr = lr_at(step, self.optim_cfg.lr, self.optim_cfg.min_lr, self.optim_cfg.warmup_steps, self.cfg.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.parallel.model.train()
        loss_sum, split = self.compute(step, micro_batches, global_tokens)
        compute_s = max(0.0, self.parallel.grads_ready_t - t0)
        self.scaler.unscale_(self.optimizer)  # nanoGPT's order: clip the true gradients
        grad_norm = self.parallel.clip_grad_norm(self.optim_cfg.grad_clip)
        self.scaler.step(self.optimizer)  # fp16 only: a sync (the scaler reads whether a gradient overflowed)
        self.scaler.update()
        return StepStats(loss_sum, global_tokens, grad_norm, lr, compute_s, split)

    def forward_backward(self, step: int, part: list[np.ndarray], micro_batches: list[np.ndarray], global_tokens: int,
                         world: int) -> torch.Tensor:
        """Forward and backward over one part of the step's micro-batches into zeroed gradients, which
        the backward's reduction averages over `world` parts; their summed token loss, on the device.
        An empty micro-batch still runs (weight 0, not counted): every rank joins every reduction."""
        self.optimizer.zero_grad(set_to_none=True)
        model = self.parallel.model
        micro_here = [(mb, 1.0) if len(mb) else (micro_batches[0][:1], 0.0) for mb in part]
        if self.parallel.orders_micro_batches:  # the strategy runs them in its own order (a pipeline's schedule)
            batches = [(*self._fetch(mb), weight) for mb, weight in micro_here]
            with _autocast(self.device.type, self.amp_dtype):
                return self.parallel.accumulate(batches, lambda loss: self.scaler.scale(loss * (world / global_tokens)))
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
            val_loss = validation_loss(self.parallel.evaluator, self.data, self.device, self.amp_dtype)
        p.best_val_loss = min(p.best_val_loss, val_loss)
        if not self.role.leads:
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

    def save_snapshot(self) -> None:
        """Every rank writes its share of the state; the first commits it."""
        p = self.progress
        manifest = {**self.meta, "tokens_seen": p.tokens_seen, "world_size": self.info.world_size,
                    **self.parallel.layout(), "aliases": self.parallel.aliases()}
        extra = self.state_json()
        with self.ledger.during("snapshot"):
            self.policy.saved()
            if not self.role.saves:
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
            if self.role.leads:
                p = self.progress
                step = {"step": p.step, "tokens_seen": p.tokens_seen, "tokens": stats.tokens, "lr": stats.lr,
                        "grad_norm": stats.grad_norm.item()}
                record = train_record(step, loss, step_s, compute, self.hosts,
                                      self.parallel.gpt.flops_per_token(self.data.train.block_size),
                                      self.peak())
                self.metrics.write({**record, "epoch": self.data.sampler.epoch, **self.record_extra(),
                                    **self.data.train.batch_stats(stats.split)})


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

