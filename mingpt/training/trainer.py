"""The training loop: train(), train_step(), evaluate(); everything that must survive a restart
is reachable from Trainer.state_dict()."""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from mingpt.config import OptimConfig, TrainerConfig
from mingpt.data.datasets import DocumentDataset, StreamDataset
from mingpt.data.samplers import LengthGroupedSampler, StreamSampler
from mingpt.distributed import DistInfo, PreemptionFlag, all_gather_floats, all_gather_objects, all_reduce_sum
from mingpt.model import GPT
from mingpt.snapshot import Snapshotter
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


class Trainer:
    """Owns the training state; main.py builds every part and hands it in.

    Args:
        model: what the loop calls (DDP and/or compiled wrapper around `raw_model`).
        raw_model: the plain GPT, whose state_dict has no wrapper prefixes.
        val_batches: this rank's micro-batches of the fixed validation subset.
        metrics, snapshotter: where records and snapshots go; the trainer closes them.
        snapshot_every, snapshot_every_s: save every N steps and/or every T seconds (0 = off).
        preempt: set by a signal; the ranks agree on it at a step boundary, save and stop.
        snapshot_meta: plain data recorded in every snapshot manifest (config, tokenizer, run id).
        watchdog: notices a rank that stops making progress.
    """

    def __init__(self, cfg: TrainerConfig, optim_cfg: OptimConfig, model: nn.Module, raw_model: GPT,
                 optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                 train_data: StreamDataset | DocumentDataset, val_data: StreamDataset | DocumentDataset,
                 sampler: StreamSampler | LengthGroupedSampler, val_batches: list[np.ndarray], dist: DistInfo,
                 metrics: MetricsWriter, snapshotter: Snapshotter, snapshot_every: int, snapshot_every_s: float,
                 preempt: PreemptionFlag, snapshot_meta: dict, watchdog: Watchdog | None = None):
        self.cfg, self.optim_cfg = cfg, optim_cfg
        self.model, self.raw_model, self.optimizer, self.scaler = model, raw_model, optimizer, scaler
        self.train_data, self.val_data, self.sampler, self.val_batches = train_data, val_data, sampler, val_batches
        self.dist, self.metrics, self.snapshotter, self.preempt = dist, metrics, snapshotter, preempt
        self.snapshot_every, self.snapshot_every_s, self.snapshot_meta = snapshot_every, snapshot_every_s, snapshot_meta
        self._last_save_t = time.monotonic()
        self.watchdog = watchdog or Watchdog(0, "")
        self.hosts = [f"{h}:{lr}" for h, lr in all_gather_objects((dist.hostname, dist.local_rank))]
        # This rank's own compute time per step ends when its last gradient is accumulated:
        # the gradient all-reduce that follows makes every rank look as slow as the slowest.
        # A plain autograd hook, not a DDP comm hook: a Python comm hook leaves a Python callback
        # on the process group's C++ threads, which abort the process if they drop it while the
        # interpreter shuts down ("terminate called without an active exception").
        self._grads_ready_t = 0.0
        self._grad_hooks = [p.register_post_accumulate_grad_hook(self._note_grad_ready)
                            for p in raw_model.parameters() if p.requires_grad]
        self.device = torch.device(dist.device)
        self.amp_dtype = _amp_dtype(cfg.precision, self.device.type)
        # Counters that survive a restart (state_dict below).
        self.step = 0
        self.tokens_seen = 0
        self.best_val_loss = math.inf
        block = train_data.block_size
        self.flops_per_token = raw_model.flops_per_token(block)
        nodes = max(1, dist.world_size // dist.local_world_size)
        self.peak_flops = (cfg.cpu_peak_flops * nodes if self.device.type == "cpu"
                           else _gpu_peak(cfg.gpu_peak_flops, self.device) * dist.world_size)

    # ---------------------------------------------------------------- the loop
    def train(self) -> bool:
        """Train to max_steps; False when stopped early by a preemption signal (after saving)."""
        cfg = self.cfg
        if self.step >= cfg.max_steps:
            log.info("already at step %d of %d; nothing to train", self.step, cfg.max_steps)
            return True
        log.info("training from step %d to %d on %d rank%s, precision %s", self.step, cfg.max_steps,
                 self.dist.world_size, "" if self.dist.world_size == 1 else "s", self.amp_dtype or "fp32")
        if self._agree_at_boundary()[0]:  # a stop requested during start-up: nothing new to save
            if self.dist.is_rank0:
                log.warning("%s before the first step", self.preempt.describe())
            return False
        self.watchdog.start()
        try:
            with _progress(self.dist.is_rank0 and cfg.progress, self.step, cfg.max_steps) as bar:
                return self._loop(bar)
        finally:
            self.watchdog.stop()  # on every exit path, errors included

    def _loop(self, bar) -> bool:
        cfg = self.cfg
        t_last, steps_since = time.perf_counter(), 0
        while self.step < cfg.max_steps:
            stats = self.train_step()
            self.step += 1
            self.watchdog.beat(self.step)
            self.tokens_seen += stats.tokens
            steps_since += 1
            if bar is not None:
                bar.update(1)
            if self.step % cfg.log_every == 0 or self.step == cfg.max_steps:
                now = time.perf_counter()
                self._log_train(stats, (now - t_last) / steps_since)
                t_last, steps_since = now, 0
            untimed = False
            if cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == cfg.max_steps):
                self.evaluate()
                untimed = True
            stop, timed = self._agree_at_boundary()
            due = self.snapshot_every and self.step % self.snapshot_every == 0
            if (stop or timed or due) and self.step < cfg.max_steps:
                self.save_snapshot()
                untimed = True
            self.watchdog.beat(self.step)
            if stop and self.step < cfg.max_steps:  # at max_steps the final save below does it
                self.watchdog.stop()
                self.snapshotter.wait()
                if self.dist.is_rank0:  # every rank stops; one says so
                    log.warning("%s: snapshot of step %d saved; the same command resumes from it",
                                self.preempt.describe(), self.step)
                return False
            if untimed:  # keep evaluation and saving out of the step-time figures
                t_last, steps_since = time.perf_counter(), 0
        self.watchdog.stop()
        self.save_snapshot()
        self.snapshotter.wait()
        return True

    def _agree_at_boundary(self) -> tuple[bool, bool]:
        """(stop, save now): any rank's preemption signal, or the save interval having passed.

        One tiny all-reduce per step, so that every rank takes the same decision at the same step.
        """
        timed = self.snapshot_every_s > 0 and time.monotonic() - self._last_save_t >= self.snapshot_every_s
        flags = torch.tensor([float(self.preempt.requested), float(timed)], device=self.device)
        all_reduce_sum(flags)
        stop, timed = (flags > 0).tolist()
        return stop, timed

    def train_step(self) -> StepStats:
        """One optimizer step over the next global batch, split over ranks and micro-batches."""
        t0 = time.perf_counter()
        dist, data = self.dist, self.train_data
        micro_batches = self.sampler.next_step()  # the global step's, the same for any world size
        # The global count of real target tokens comes from the plan itself, which every rank
        # knows: no collective is needed to normalise the loss exactly.
        global_tokens = data.tokens_in(np.concatenate(micro_batches))
        split = self.sampler.split(micro_batches, dist.world_size)
        mine = split[dist.rank]
        lr = lr_at(self.step, self.optim_cfg.lr, self.optim_cfg.min_lr, self.optim_cfg.warmup_steps,
                   self.cfg.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        for i, mb in enumerate(mine):
            # A rank with no samples in this micro-step still runs one (weight 0) so that every
            # rank joins the same gradient all-reduces.
            weight = 1.0 if len(mb) else 0.0
            x, y = data.batch(mb if len(mb) else micro_batches[0][:1])
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            if self.raw_model.config.dropout > 0:
                # Dropout noise as a function of (seed, step, first sample): identical after a
                # resume and independent of which rank draws the micro-batch.
                torch.manual_seed(hash((self.cfg.seed, self.step, int(mb[0]) if len(mb) else -1)) & 0x7FFF_FFFF_FFFF)
            last = i == len(mine) - 1
            sync = contextlib.nullcontext() if last or not dist.distributed else self.model.no_sync()
            with sync:
                with _autocast(self.device.type, self.amp_dtype):
                    _, loss = self.model(x, y, reduction="sum")
                # DDP averages gradients over ranks; scaling by world_size / global tokens makes
                # the result the gradient of the mean token loss of the whole global batch,
                # however unevenly the samples were split.
                self.scaler.scale(loss * (weight * dist.world_size / global_tokens)).backward()
            loss_sum += loss.detach().float() * weight
        compute_s = self._grads_ready_t - t0
        # nanoGPT's order: unscale before clipping, so the threshold applies to true gradients.
        self.scaler.unscale_(self.optimizer)
        clip = self.optim_cfg.grad_clip if self.optim_cfg.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return StepStats(loss_sum, global_tokens, float(grad_norm), lr, compute_s, split)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Validation loss over the fixed subset: sum of token losses / token count, across ranks."""
        model, dist = self.raw_model, self.dist
        model.eval()
        sums = torch.zeros(2, device=self.device, dtype=torch.float64)  # (loss sum, tokens)
        for batch in self.val_batches:
            x, y = (t.to(self.device, non_blocking=True) for t in self.val_data.batch(batch))
            with _autocast(self.device.type, self.amp_dtype):
                _, loss = model(x, y, reduction="sum")
            sums[0] += loss.double()
            sums[1] += self.val_data.tokens_in(batch)
        all_reduce_sum(sums)
        model.train()
        val_loss = (sums[0] / sums[1]).item()
        self.best_val_loss = min(self.best_val_loss, val_loss)
        if dist.is_rank0:
            log.info("step %d | val loss %.4f | best %.4f", self.step, val_loss, self.best_val_loss)
        self.metrics.write({"kind": "eval", "step": self.step, "val_loss": val_loss})
        return val_loss

    def _note_grad_ready(self, param: torch.Tensor) -> None:  # noqa: ARG002 - hook signature
        self._grads_ready_t = time.perf_counter()

    def close(self) -> None:
        """Stop the watchdog, wait for the last save, close the metrics, remove the hooks."""
        self.watchdog.stop()
        self.snapshotter.close()
        self.metrics.close()
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks = []

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {
            "model": self.raw_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "trainer": {"step": self.step, "tokens_seen": self.tokens_seen, "best_val_loss": self.best_val_loss},
        }

    def load_state_dict(self, state: dict) -> None:
        self.raw_model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.sampler.load_state_dict(state["sampler"])
        t = state["trainer"]
        self.step, self.tokens_seen, self.best_val_loss = int(t["step"]), int(t["tokens_seen"]), float(t["best_val_loss"])

    def save_snapshot(self) -> None:
        """Only the current global rank 0 writes: one writer per job, whichever node it is on."""
        self._last_save_t = time.monotonic()
        if not self.dist.is_rank0:
            return
        manifest = {**self.snapshot_meta, "tokens_seen": self.tokens_seen, "world_size": self.dist.world_size}
        self.snapshotter.save(self.step, self.state_dict(), manifest)

    # ---------------------------------------------------------------- logging
    def _log_train(self, stats: StepStats, step_s: float) -> None:
        loss = all_reduce_sum(stats.loss_sum.clone()).item() / stats.tokens
        compute = [c[0] for c in all_gather_floats([stats.compute_s], self.dist.device)]
        if not self.dist.is_rank0:
            return
        tok_s = stats.tokens / step_s
        mfu = tok_s * self.flops_per_token / self.peak_flops
        slowest = max(range(len(compute)), key=compute.__getitem__)
        ratio = compute[slowest] / max(float(np.median(compute)), 1e-9)
        log.info("step %d | loss %.4f | lr %.2e | grad norm %.3f | %.0f tok/s | mfu %.1f%% | %.1f ms/step"
                 "%s", self.step, loss, stats.lr, stats.grad_norm, tok_s, 100 * mfu, 1000 * step_s,
                 f" | compute max/median {ratio:.2f} (slowest {self.hosts[slowest]}, rank {slowest})"
                 if len(compute) > 1 else "")
        self.metrics.write({"kind": "train", "step": self.step, "loss": loss, "lr": stats.lr,
                            "grad_norm": stats.grad_norm, "tokens_per_s": tok_s, "mfu": mfu,
                            "step_ms": 1000 * step_s, "tokens_seen": self.tokens_seen,
                            "epoch": self.sampler.epoch, "world_size": self.dist.world_size,
                            "compute_ms": [round(1000 * c, 2) for c in compute], **self.train_data.batch_stats(stats.split),
                            "compute_max_median": ratio, "slowest": self.hosts[slowest]})


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
    """A progress bar on a terminal (else None). While it is shown, log lines are written through
    it, so that a line never lands in the middle of the bar."""
    if not (enabled and sys.stderr.isatty()):
        yield None
        return
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(), tqdm(total=total, initial=start, unit="step", dynamic_ncols=True) as bar:
        yield bar
