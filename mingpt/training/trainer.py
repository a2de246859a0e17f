"""The training loop: train(), train_step(), evaluate(); what must survive a restart is registered
with the Trainer (the parallel strategy's tensors and the `stateful` parts)."""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn as nn

from mingpt.config import OptimConfig, TrainerConfig
from mingpt.data.datasets import DocumentDataset, StreamDataset
from mingpt.data.samplers import LengthGroupedSampler, StreamSampler
from mingpt.distributed import DistInfo, PreemptionFlag, all_gather_floats, all_reduce_sum
from mingpt.parallel import Parallel
from mingpt.snapshot import SaveFailedError, Snapshotter
from mingpt.training.ledger import Ledger
from mingpt.training.metrics import MetricsWriter
from mingpt.training.optim import lr_at
from mingpt.training.watchdog import Watchdog

log = logging.getLogger(__name__)

# Dense bf16 peak FLOP/s per GPU, by a substring of the device name, for MFU.
GPU_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12,
                  "L4": 121e12, "V100": 125e12, "4090": 165e12}


@dataclass
class StepStats:
    loss_sum: torch.Tensor  # this rank's summed token loss (unreduced)
    tokens: int  # global target tokens of the step
    grad_norm: float
    lr: float
    compute_s: float
    split: list  # every rank's micro-batches; padding/balance figures are computed at log steps only


@dataclass
class TrainData:
    """The splits, the training sampler and this rank's fixed validation micro-batches (padded with
    empty ones to the same count on every rank: a sharded model runs collectives in its forward)."""
    train: StreamDataset | DocumentDataset
    val: StreamDataset | DocumentDataset
    sampler: StreamSampler | LengthGroupedSampler
    val_batches: list[np.ndarray]


@dataclass
class Progress:
    """The counters that survive a restart."""
    step: int = 0
    tokens_seen: int = 0
    best_val_loss: float = math.inf

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "best_val_loss": self.best_val_loss}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.best_val_loss = float(state["best_val_loss"])


class SavePolicy:
    """When the loop saves and when it stops, decided alike on every rank by one tiny all-reduce per
    step: every N steps and/or T seconds (0 = off), at the last step, and at a preemption signal
    (save, then stop). It owns the snapshotter, and makes the ranks agree whether the last save
    committed: a run must never stop as if saved when its last snapshot is not."""

    def __init__(self, snapshotter: Snapshotter, every_steps: int, every_s: float, preempt: PreemptionFlag,
                 device: torch.device):
        self.snapshotter, self.every_steps, self.every_s = snapshotter, every_steps, every_s
        self.preempt, self.device = preempt, device
        self._last_save_t = time.monotonic()

    def stop_requested(self) -> bool:
        """A preemption signal on any rank (checked before the first step: nothing new to save)."""
        return self._agree()[0]

    def after_step(self, step: int, last: bool) -> tuple[bool, bool]:
        """(save now, stop after saving)."""
        stop, timed = self._agree()
        return stop or timed or last or bool(self.every_steps and step % self.every_steps == 0), stop and not last

    def _agree(self) -> tuple[bool, bool]:
        timed = 0 < self.every_s <= time.monotonic() - self._last_save_t
        flags = torch.tensor([float(self.preempt.requested), float(timed)], device=self.device)
        return tuple((all_reduce_sum(flags) > 0).tolist())

    def save(self, step: int, slots, extra: dict, manifest: dict) -> None:
        self._last_save_t = time.monotonic()
        self.snapshotter.save(step, slots, extra, manifest)

    def finish(self, why: str, step: int) -> None:
        """Wait for the last save; raise SaveFailedError on every rank if it did not commit anywhere."""
        ok = self.snapshotter.wait() is not False
        if all_reduce_sum(torch.tensor([0.0 if ok else 1.0], device=self.device)).item() > 0:
            raise SaveFailedError(
                f"{why}, but the snapshot of step {step} could not be saved to {self.snapshotter.store.url} (the "
                "errors above say why): the previous snapshot stays the newest. Fix the store (permissions, space, "
                "credentials) and run the same command: it resumes from the newest snapshot")


class Trainer:
    """The training loop over parts that main.py builds (constructing it runs no collective). It does
    not know the parallel strategy: `parallel` answers for it, and gives the tensors a snapshot holds;
    the `stateful` parts' state_dict() make the rest. `saving` decides when to save and stop."""

    def __init__(self, *, cfg: TrainerConfig, optim_cfg: OptimConfig, parallel: Parallel,
                 optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, data: TrainData,
                 saving: SavePolicy, meta: dict, metrics: MetricsWriter, dist: DistInfo, hosts: list[str],
                 ledger: Ledger | None = None):
        self.cfg, self.optim_cfg, self.parallel, self.optimizer, self.scaler = cfg, optim_cfg, parallel, optimizer, scaler
        self.data, self.saving, self.meta, self.metrics, self.dist = data, saving, meta, metrics, dist
        self.hosts, self.progress = hosts, Progress()
        self.ledger = ledger or Ledger()  # where this process's time goes (records: "time")
        self.watchdog = Watchdog(cfg.watchdog_s, f"rank {dist.rank} ({dist.hostname}:{dist.local_rank})")
        self.stateful = {"scaler": scaler, "sampler": data.sampler, "trainer": self.progress}
        self.device = torch.device(dist.device)
        self.amp_dtype = _amp_dtype(cfg.precision, self.device.type)

    def train(self) -> bool:
        """Train to max_steps; False when stopped early by a preemption signal (after saving)."""
        p, cfg = self.progress, self.cfg
        if p.step >= cfg.max_steps:
            log.info("already at step %d of %d; nothing to train", p.step, cfg.max_steps)
            return True
        log.info("training from step %d to %d on %d rank%s (%s), precision %s", p.step, cfg.max_steps,
                 self.dist.world_size, "" if self.dist.world_size == 1 else "s", self.parallel.name,
                 self.amp_dtype or "fp32")
        if self.saving.stop_requested():
            if self.dist.is_rank0:
                log.warning("%s before the first step", self.saving.preempt.describe())
            return False
        self.watchdog.start()
        self.ledger.switch("first_step")
        try:
            with _progress(self.dist.is_rank0 and cfg.progress, p.step, cfg.max_steps) as bar:
                return self._loop(bar)
        finally:
            self.watchdog.stop()  # on every exit path, errors included

    def _loop(self, bar) -> bool:
        """nanoGPT's loop: data and step, log, evaluate, save. The step time logged is the ledger's
        (the seconds in its step states), so evaluating and saving never count as steps."""
        p, cfg = self.progress, self.cfg
        since = (p.step, self.ledger.step_seconds())
        while p.step < cfg.max_steps:
            stats = self.train_step()
            p.step, p.tokens_seen = p.step + 1, p.tokens_seen + stats.tokens
            self.watchdog.beat(p.step)
            bar.update(1)
            last, first = p.step == cfg.max_steps, not self.ledger.steady
            if logged := p.step % cfg.log_every == 0 or last:
                now = (p.step, self.ledger.step_seconds())
                self._log_train(stats, (now[1] - since[1]) / (now[0] - since[0]))
                since = now
            if evaluate := bool(cfg.eval_every and (p.step % cfg.eval_every == 0 or last)):
                self.evaluate()
            save, stop = self.saving.after_step(p.step, last)
            if save:
                self.save_snapshot()
                self.watchdog.beat(p.step)
            if first or logged or evaluate or save:
                self.record_time()
            if stop:
                self.finish_saving(self.saving.preempt.describe())
                if self.dist.is_rank0:  # every rank stops; one says so
                    log.warning("%s: snapshot of step %d saved; the same command resumes from it",
                                self.saving.preempt.describe(), p.step)
                return False
        self.finish_saving(f"the run reached step {p.step}")
        return True

    def finish_saving(self, why: str) -> None:
        with self.ledger.during("snapshot"):
            self.saving.finish(why, self.progress.step)
        self.record_time()

    def record_time(self) -> None:
        """The "time" record: every rank's seconds by state so far, averaged (a collective)."""
        if not self.ledger.steady:  # the first record ends the start-up
            self.ledger.started()
        with self.ledger.during("log"):
            self.ledger.record(self.metrics.write, self.progress.step,
                               lambda v: all_gather_floats(v, self.dist.device))

    def train_step(self) -> StepStats:
        """One optimizer step over the next global batch, split over ranks and micro-batches."""
        t0 = time.perf_counter()
        self.ledger.switch("step_data")
        dist, data, step = self.dist, self.data.train, self.progress.step
        micro_batches = self.data.sampler.next_step()  # the global step's, the same for any world size
        # every rank knows the global token count from the plan: no collective normalises the loss
        global_tokens = data.tokens_in(np.concatenate(micro_batches))
        split = self.data.sampler.split(micro_batches, dist.world_size)
        micro_here = split[dist.rank]
        lr = lr_at(step, self.optim_cfg.lr, self.optim_cfg.min_lr, self.optim_cfg.warmup_steps, self.cfg.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        model = self.parallel.model
        model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        for i, mb in enumerate(micro_here):
            # a rank with no samples here still runs one (weight 0): every rank joins every reduction
            weight = 1.0 if len(mb) else 0.0
            self.ledger.switch("step_data")
            x, y = (t.to(self.device, non_blocking=True) for t in data.batch(mb if len(mb) else micro_batches[0][:1]))
            self.ledger.switch("step_compute")
            if self.parallel.gpt.config.dropout > 0:
                # dropout noise of (seed, step, first sample): the same after a resume, on any rank
                torch.manual_seed(hash((self.cfg.seed, step, int(mb[0]) if len(mb) else -1)) & 0x7FFF_FFFF_FFFF)
            with self.parallel.sync(last=i == len(micro_here) - 1):
                with _autocast(self.device.type, self.amp_dtype):
                    _, loss = model(x, y, reduction="sum")
                # gradients are averaged over ranks: world_size / global tokens makes them those of the
                # mean token loss of the whole global batch, however unevenly the samples were split
                self.scaler.scale(loss * (weight * dist.world_size / global_tokens)).backward()
            loss_sum += loss.detach().float() * weight
        compute_s = self.parallel.grads_ready_t - t0
        self.scaler.unscale_(self.optimizer)  # nanoGPT's order: clip the true gradients
        grad_norm = self.parallel.clip_grad_norm(self.optim_cfg.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return StepStats(loss_sum, global_tokens, grad_norm, lr, compute_s, split)

    def evaluate(self) -> float:
        """Validation loss over the fixed subset, across ranks; the best one is kept."""
        p = self.progress
        with self.ledger.during("eval"):
            val_loss = validation_loss(self.parallel.gpt, self.data, self.device, self.amp_dtype)
        p.best_val_loss = min(p.best_val_loss, val_loss)
        log.info("step %d | val loss %.4f | best %.4f", p.step, val_loss, p.best_val_loss)
        self.metrics.write({"kind": "eval", "step": p.step, "val_loss": val_loss})
        return val_loss

    def close(self, wait: bool = True) -> None:
        """Stop the watchdog, finish (or abandon, after an error) the last save, close the metrics."""
        self.watchdog.stop()
        self.saving.snapshotter.close(wait=wait)
        self.metrics.close()
        self.parallel.close()

    def save_snapshot(self) -> None:
        """Every rank writes its share of the state; the first commits it."""
        p = self.progress
        manifest = {**self.meta, "tokens_seen": p.tokens_seen, "world_size": self.dist.world_size,
                    "parallel": self.parallel.name, "aliases": self.parallel.aliases()}
        extra = {name: part.state_dict() for name, part in self.stateful.items()}
        with self.ledger.during("snapshot"):
            self.saving.save(p.step, self.parallel.slots(self.optimizer), extra, manifest)

    def load_state(self, extra: dict) -> None:
        """The registered parts' state from a snapshot (the tensors are loaded in place already)."""
        for name, part in self.stateful.items():
            if extra.get(name):  # a disabled GradScaler saves nothing
                part.load_state_dict(extra[name])

    def _log_train(self, stats: StepStats, step_s: float) -> None:
        with self.ledger.during("log"):
            self._write_train(stats, step_s)

    def _write_train(self, stats: StepStats, step_s: float) -> None:
        loss = all_reduce_sum(stats.loss_sum.clone()).item() / stats.tokens
        compute = [c[0] for c in all_gather_floats([stats.compute_s], self.dist.device)]
        if self.dist.is_rank0:
            record = train_record(self.progress, stats, loss, step_s, compute, self.hosts,
                                  self.parallel.gpt.flops_per_token(self.data.train.block_size),
                                  peak_flops(self.cfg, self.dist, self.device))
            self.metrics.write({**record, "epoch": self.data.sampler.epoch, "world_size": self.dist.world_size,
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


def peak_flops(cfg: TrainerConfig, d: DistInfo, device: torch.device) -> float:
    """The job's peak FLOP/s for MFU: per machine on CPU, per GPU on GPUs."""
    if device.type == "cpu":
        return cfg.cpu_peak_flops * max(1, d.world_size // d.local_world_size)
    return _gpu_peak(cfg.gpu_peak_flops, device) * d.world_size


def train_record(p: Progress, stats: StepStats, loss: float, step_s: float, compute: list[float], hosts: list[str],
                 flops_per_token: float, peak_flops: float) -> dict:
    """The log line and metrics record of a step, from figures every rank contributed."""
    tok_s = stats.tokens / step_s
    mfu = tok_s * flops_per_token / peak_flops
    slowest = max(range(len(compute)), key=compute.__getitem__)
    ratio = compute[slowest] / max(float(np.median(compute)), 1e-9)
    log.info("step %d | loss %.4f | lr %.2e | grad norm %.3f | %.0f tok/s | mfu %.1f%% | %.1f ms/step%s", p.step, loss,
             stats.lr, stats.grad_norm, tok_s, 100 * mfu, 1000 * step_s,
             f" | compute max/median {ratio:.2f} (slowest {hosts[slowest]}, rank {slowest})" if len(compute) > 1 else "")
    return {"kind": "train", "step": p.step, "loss": loss, "lr": stats.lr, "grad_norm": stats.grad_norm,
            "tokens_per_s": tok_s, "mfu": mfu, "step_ms": 1000 * step_s, "tokens_seen": p.tokens_seen,
            "compute_ms": [round(1000 * c, 2) for c in compute], "compute_max_median": ratio,
            "slowest": hosts[slowest]}


def _amp_dtype(precision: str, device_type: str) -> torch.dtype | None:
    if precision == "auto":
        return torch.bfloat16 if device_type == "cuda" else None
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def _autocast(device_type: str, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def _gpu_peak(configured: float, device: torch.device) -> float:
    if configured > 0:
        return configured
    name = torch.cuda.get_device_name(device)
    for key, flops in GPU_PEAK_FLOPS.items():
        if key in name:
            return flops
    log.warning("unknown GPU %r: MFU assumes 312 TFLOP/s; set trainer.gpu_peak_flops", name)
    return 312e12


@contextlib.contextmanager
def _progress(enabled: bool, start: int, total: int):
    """A progress bar on a terminal (else a stand-in that shows nothing). While it is shown, log
    lines are written through it, so that a line never lands in the middle of the bar."""
    if not (enabled and sys.stderr.isatty()):
        yield SimpleNamespace(update=lambda n: None)
        return
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(), tqdm(total=total, initial=start, unit="step", dynamic_ncols=True) as bar:
        yield bar
