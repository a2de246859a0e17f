"""Pipeline parallelism: the blocks split into `stages` consecutive groups, one per process of a
pipeline, driven by a schedule of torch.distributed.pipelining (GPipe, 1F1B, or interleaved 1F1B
with two stages on each process) over the step's micro-batches; docs/pipeline.md.

The processes are numbered stage-major: rank = stage * data_world + data_rank, so the processes of
one stage (the data-parallel copies, which average their gradients, as DDP or each holding a shard
of the stage under FSDP) are consecutive, on one node where they fit, and only activations and
their gradients cross between the stages (between nodes).

Stage 0 holds the token and position embeddings, the last stage the final norm and the head. The
head is tied to the token embedding: both stages hold a copy of the one matrix, and after the
backward they add their two gradients (one all-reduce between the first and the last stage of each
pipeline), so both copies take the same optimizer update from the same state and stay bitwise
equal; the snapshot writes the matrix once, from stage 0, and loads it into both.

A snapshot of a pipeline is the same whole tensors by name as under every other layout: each stage's
processes write their stage's tensors (cut into their rows by `snapshot.layout.cut` with the
tensor's stage), one manifest. A process holds the other stages' tensors as placeholders on the meta
device: named and shaped for the layout, never written or read.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from mingpt.model.gpt import GPT, GPTConfig
from mingpt.parallel.shards import own_part
from mingpt.snapshot.layout import Slot, dtype_name, dtype_of

CHUNKS = 2  # stages per process under the interleaved schedule


def stage_layers(n_layer: int, stages: int, stage: int) -> range:
    """The blocks of `stage`: n_layer cut into `stages` consecutive runs, the first ones a block longer
    where they do not divide."""
    base, extra = divmod(n_layer, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def stage_of(name: str, n_layer: int, stages: int, chunks: int = 1) -> int:
    """The process of a pipeline (of `stages` processes, each running `chunks` stages: stage s on
    process s % stages) that holds and writes parameter `name` of the GPT (also
    `optim.<name>.<state>`)."""
    name = name.removeprefix("model.").removeprefix("optim.")
    if name.startswith(("wte.", "wpe.")):
        return 0
    if name.startswith("blocks."):
        layer, total = int(name.split(".")[1]), stages * chunks
        return next(s for s in range(total) if layer in stage_layers(n_layer, total, s)) % stages
    return stages - 1  # ln_f, lm_head (tied to wte: written as wte, by stage 0)


def problem(model: GPTConfig, stages: int, world: int, schedule: str, micro_batches: int) -> str | None:
    """Why `stages` pipeline stages cannot run this model on `world` processes with `micro_batches`
    micro-batches per data rank a step (one line), or None."""
    n_layer = model.shape[0]
    if stages > n_layer:
        return (f"trainer.pipeline_parallel={stages} needs at least one block per stage, the model has {n_layer}: "
                f"use at most {n_layer} stages")
    if schedule == "interleaved" and CHUNKS * stages > n_layer:
        return (f"trainer.pipeline_schedule=interleaved runs {CHUNKS} stages on each of the {stages} processes, the "
                f"model has {n_layer} blocks for {CHUNKS * stages}: use pipeline_parallel={n_layer // CHUNKS} or less, "
                "or pipeline_schedule=1f1b")
    if world % stages:
        return (f"trainer.pipeline_parallel={stages} needs a multiple of {stages} processes, this start has {world}: "
                f"launch {world - world % stages or stages} (or another multiple), or use pipeline_parallel that "
                f"divides {world}")
    if schedule == "1f1b" and micro_batches < stages:
        return (f"trainer.pipeline_schedule=1f1b over {stages} stages needs at least {stages} micro-batches per data "
                f"rank a step, this step has {micro_batches}: lower trainer.micro_batch_size (or raise "
                "data.documents.micro_batches_per_step), or use pipeline_schedule=gpipe")
    return None


class Stage(nn.Module):
    """The part of a GPT that one stage runs, by the GPT's own modules and names (`blocks.<i>` keeps
    its layer number): token ids in on the first stage, logits out of the last, the residual stream
    (B, T, C) between."""

    def __init__(self, gpt: GPT, layers: range, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in layers})
        if last:
            self.ln_f, self.lm_head, self.real_vocab = gpt.ln_f, gpt.lm_head, gpt.real_vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.size(1), device=x.device)  # (T,)
            x = self.drop(self.wte(x) + self.wpe(pos))  # (B, T, C)
        for layer, block in self.blocks.items():
            x = block(x, None, int(layer))  # (B, T, C)
        if self.last:
            x = self.real_vocab(self.lm_head(self.ln_f(x)))  # (B, T, V)
        return x


def padded(batches: list[tuple[torch.Tensor, torch.Tensor, float]], at_least: int, multiple: int = 1
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's micro-batches as one (M * B, T) input and target, every micro-batch padded to the
    step's largest B and T (a pipeline stage receives one shape): padded rows and positions have
    target -100, so they count in neither the loss nor the gradients; a micro-batch of weight 0 (a
    rank's empty one) is all padding. Micro-batches of padding are added up to `at_least` (what the
    schedule needs), and T up to a `multiple` (tensor parallelism splits the stream evenly by tokens:
    attention is causal, the earlier positions never see the padding). Each micro-batch keeps its
    samples: the sampler's balance holds."""
    B = max(x.size(0) for x, _, _ in batches)
    T = -(-max(x.size(1) for x, _, _ in batches) // multiple) * multiple
    xs, ys = [], []
    for x, y, weight in batches:
        px = torch.zeros((B, T), dtype=x.dtype, device=x.device)  # (B, T)
        py = torch.full((B, T), -100, dtype=y.dtype, device=y.device)  # (B, T)
        px[: x.size(0), : x.size(1)] = x
        if weight:
            py[: y.size(0), : y.size(1)] = y
        xs.append(px)
        ys.append(py)
    while len(xs) < at_least:
        xs.append(torch.zeros_like(xs[0]))
        ys.append(torch.full_like(ys[0], -100))
    return torch.cat(xs), torch.cat(ys)  # (M * B, T), (M * B, T)


class Pipeline:
    """One process's stage of a pipeline and the groups it talks to; see the module docstring.

    `pp_group`: the stages of this process's pipeline (one data rank); `dp_group`: the copies of
    this stage (one per data rank; None where FSDP reduces them); `tied_group`: the first and last
    stage of this pipeline. Under tensor parallelism (`tp`) a stage's processes each hold their
    part of its blocks, and the stream between stages is split by tokens: each process sends and
    receives its own tokens, to and from the process of the same place in the neighbouring stage."""

    def __init__(self, gpt: GPT, stage: int, stages: int, schedule: str, device: torch.device,
                 pp_group, dp_group, tied_group, per_stage: int, tp=None):
        self.gpt, self.stage, self.stages, self.schedule_name = gpt, stage, stages, schedule
        self.first, self.last = stage == 0, stage == stages - 1  # the embedding's process, the head's
        self.chunks = CHUNKS if schedule == "interleaved" else 1
        total = stages * self.chunks  # stage s on process s % stages (torch's loop order)
        self.stage_ids = [stage + k * stages for k in range(self.chunks)]
        self.device, self.per_stage, self.tp = device, per_stage, tp  # tp: the stage's TensorParallel, or None
        self.pp_group, self.dp_group, self.tied_group = pp_group, dp_group, tied_group
        self.n_layer = gpt.config.n_layer
        parts = [Stage(gpt, stage_layers(self.n_layer, total, s), s == 0, s == total - 1) for s in self.stage_ids]
        self.module = parts[0] if len(parts) == 1 else nn.ModuleList(parts)
        self.parts = parts
        self._schedules: dict[tuple, object] = {}  # (micro-batches, B, T, dtype) -> a schedule of that shape
        self._token_losses: list[torch.Tensor] = []
        self._scale = None
        self._specs: list[tuple[str, tuple, str, int]] | None = None
        self.sent_bytes = 0  # activations and gradients this stage sent to its neighbours so far
        self.sharded = False  # each stage's parts sharded over its data ranks by FSDP2 (set by layouts)

    def __str__(self) -> str:
        return f"pipeline {self.stages} ({self.schedule_name})"

    @property
    def tp_size(self) -> int:
        return self.tp.size if self.tp else 1

    # --- training ---------------------------------------------------------------------------------
    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss of one micro-batch (last stage): the summed token loss, scaled as the
        Trainer scales it; the sums are kept for the step's loss."""
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),  # (B*T, V)
                               target.reshape(-1), ignore_index=-100, reduction="sum")  # (B*T,)
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss  # split logits: the parts' sum
        if loss.device.type != "meta":
            self._token_losses.append(loss.detach())
        return self._scale(loss)

    def _schedule(self, micro_batches: int, B: int, T: int):
        """A schedule (and its stage) for micro-batches of one shape, kept for the next step of that
        shape: the stage's receive buffers are made for one shape (documents' steps vary)."""
        dtype = torch.get_autocast_dtype(self.device.type) if torch.is_autocast_enabled(self.device.type) else None
        key = (micro_batches, B, T, dtype)
        if key not in self._schedules:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

            C, V, total = self.gpt.config.n_embd, self.gpt.config.vocab_size, self.stages * self.chunks
            # (B, T, C): the residual stream between stages, with a gradient back (what STATIC mode's buffers copy)
            stream = torch.empty((B, T // self.tp_size, C), device="meta", requires_grad=True)
            stages = [PipelineStage(part, s, total, self.device, group=self.pp_group,
                                    input_args=torch.empty((B, T), dtype=torch.long, device="meta") if s == 0 else stream,
                                    output_args=torch.empty((B, T, V), dtype=dtype or torch.float32, device="meta")
                                    if s == total - 1 else stream)
                      for part, s in zip(self.parts, self.stage_ids)]
            if len(self._schedules) >= 8:  # documents: a few shapes recur; forget the oldest
                self._schedules.pop(next(iter(self._schedules)))
            if self.chunks > 1:
                self._schedules[key] = ScheduleInterleaved1F1B(stages, micro_batches, loss_fn=self._loss,
                                                               scale_grads=False)
            else:
                kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[self.schedule_name]
                self._schedules[key] = kind(stages[0], micro_batches, loss_fn=self._loss, scale_grads=False)
        return self._schedules[key]

    def run(self, batches: list[tuple[torch.Tensor, torch.Tensor, float]], scale) -> torch.Tensor:
        """Forward and backward of the step's micro-batches through the schedule, the gradients then
        summed between the tied copies and averaged over the data ranks; the summed token loss of
        this data rank (the same on every stage)."""
        micro = max(len(batches), self.stages if self.schedule_name == "1f1b" else 1)
        while self.chunks > 1 and micro % max(1, micro // self.stages):  # interleaved: whole rounds
            micro += 1
        x, y = padded(batches, micro, self.tp_size)
        B, T = x.size(0) // micro, x.size(1)
        schedule = self._schedule(micro, B, T)
        self._token_losses, self._scale = [], scale
        args = (x,) if self.first else ()
        if self.last:
            schedule.step(*args, target=y, return_outputs=False)
        else:
            schedule.step(*args, return_outputs=False)
        C = self.gpt.config.n_embd
        total = self.stages * self.chunks  # fp32 activations forward, their gradients back
        self.sent_bytes += micro * B * T // self.tp_size * C * 4 * sum((s < total - 1) + (s > 0) for s in self.stage_ids)
        loss = torch.stack(self._token_losses).sum() if self.last else torch.zeros((), device=self.device)
        self._token_losses = []
        if self.stages > 1:
            dist.broadcast(loss, group_src=self.stages - 1, group=self.pp_group)
        self.reduce_grads()
        return loss

    def reduce_grads(self) -> None:
        """The tied matrix's two gradients added (first and last stage), then every gradient averaged
        over the data ranks, as DDP does (FSDP's reduce-scatter averaged each stage's shards already,
        at the schedule's last backward: the tied matrix's two shards of the same rows are added)."""
        tied = self.gpt.wte.weight
        if self.stages > 1 and (self.first or self.last):
            if tied.grad is None:
                tied.grad = torch.zeros_like(tied)
            dist.all_reduce(own_part(tied.grad), group=self.tied_group)
        if self.per_stage > 1 and not self.sharded:  # one flat all-reduce (a transient copy of the stage's gradients)
            for p in self.module.parameters():
                if p.grad is None:  # every copy sends the same tensors, in one order
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in self.module.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.dp_group)
            flat /= self.per_stage
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm (every stage's own parameters, the tied matrix once), every
        gradient clipped to max_norm by it (0: not clipped)."""
        own = [p for p in self._own_params() if p.grad is not None]
        if self.tp:  # each process's parts, weighted by the processes holding them, summed over the world
            squares, group = self.tp.squares(own).to(self.device).reshape(1), None
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in own]) if own else torch.zeros((), device=self.device)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP: over the stage's shards
            squares, group = (norm.float() ** 2).reshape(1), self.pp_group
        if self.stages > 1 or self.tp:
            dist.all_reduce(squares, group=group)
        total = squares[0].sqrt()
        if max_norm > 0:  # torch's clip_grads_with_norm_, on each shard (it takes no DTensor with a plain norm)
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            grads = [own_part(p.grad) for p in self.module.parameters() if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, coef.to(grads[0].device))
        return total

    def reshard(self) -> None:
        """FSDP: each part's own parameters sharded again, as every step leaves them. After a forward
        without backward (evaluation) a part's root keeps them whole, registered in place of the
        shards: the slots would hold whole tensors, and the tied matrix's two names would no longer
        be one parameter (a snapshot without the alias, which no other layout could load)."""
        if self.sharded:
            for m in self.module.modules():
                if hasattr(m, "reshard"):
                    m.reshard()

    def _own_params(self) -> list[nn.Parameter]:
        """This stage's parameters but the last stage's copy of the tied matrix (stage 0's)."""
        tied = self.gpt.wte.weight
        return [p for p in self.module.parameters() if not (self.last and not self.first and p is tied)]

    # --- evaluation -------------------------------------------------------------------------------
    def evaluator(self) -> PipelineForward:
        return PipelineForward(self)

    # --- snapshots --------------------------------------------------------------------------------
    def slots(self, optimizer: torch.optim.Optimizer, slot) -> list[Slot]:
        """Every tensor of the whole model and optimizer, in one order on every process: this
        process's as `slot(name, tensor)` gives them (its stage's, and the tied copy; under FSDP its
        rows), the others' as placeholders on the meta device. Each names the stage that writes it."""
        held = self._tensors(optimizer)
        if self._specs is None:  # the other stages' names and shapes, gathered once
            mine = [(n, tuple(t.shape), dtype_name(t.dtype), s) for n, t in held.items()
                    for s in [stage_of(n, self.n_layer, self.stages, self.chunks)] if s == self.stage]
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            self._specs = [spec for s in range(self.stages) for spec in every[s * self.per_stage]]
        out = []
        for name, shape, dtype, stage in self._specs:
            t = held.get(name)
            if t is None:
                out.append(Slot(name, torch.empty(shape, dtype=dtype_of(dtype), device="meta"), shape, stage=stage))
            else:
                out.append(replace(slot(name, t), stage=stage))
        return out

    def _tensors(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        names = {p: n for n, p in self.gpt.named_parameters()}  # the tied matrix: wte.weight
        out = {}
        with torch.no_grad():
            for p in self.module.parameters():
                out[f"model.{names[p]}"] = p.detach()
            for group in optimizer.param_groups:
                for p in group["params"]:
                    out.update((f"optim.{names[p]}.{k}", v.detach()) for k, v in optimizer.state[p].items())
        return out

    def close(self) -> None:
        self._schedules.clear()


class PipelineForward:
    """The whole model's forward for evaluation, called alike on every stage of a pipeline: the
    activations sent from stage to stage, the loss (last stage) given to every stage."""

    def __init__(self, pipeline: Pipeline):
        self.pp = pipeline

    def eval(self) -> None:
        self.pp.module.eval()

    def train(self) -> None:
        self.pp.module.train()
        self.pp.reshard()

    def __call__(self, x: torch.Tensor, y: torch.Tensor, reduction: str = "sum") -> tuple[None, torch.Tensor]:
        pp, total = self.pp, self.pp.stages * self.pp.chunks
        if x.size(1) % pp.tp_size:  # the stream split evenly by tokens: padding at the end counts nowhere
            x, y = padded([(x, y, 1.0)], 1, pp.tp_size)
        loss = torch.zeros((), device=pp.device)
        for part, s in zip(pp.parts, pp.stage_ids):  # stage s on process s % stages, in order
            h = x
            if s > 0:  # (B, T, C), or this process's tokens of it under tensor parallelism
                h = torch.empty((x.size(0), x.size(1) // pp.tp_size, pp.gpt.config.n_embd), device=pp.device)
                dist.recv(h, group_src=(s - 1) % pp.stages, group=pp.pp_group)
            h = part(h)
            if s < total - 1:
                dist.send(h.float().contiguous(), group_dst=(s + 1) % pp.stages, group=pp.pp_group)
            else:
                loss = F.cross_entropy(h.reshape(-1, h.size(-1)).float(), y.reshape(-1),  # (B*T, V)
                                       ignore_index=-100, reduction=reduction)
                loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss  # split logits: summed
        if pp.stages > 1:
            dist.broadcast(loss, group_src=pp.stages - 1, group=pp.pp_group)
        return None, loss
