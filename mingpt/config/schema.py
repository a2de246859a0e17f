"""Typed configuration: one frozen dataclass per component, validation only.

Hydra's DictConfig is turned into these once, by compose.py (`compose`, `from_dict`; `summary` says them
in a few lines), and never passed further.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from mingpt.model.gpt import GPTConfig

__all__ = ["GPTConfig", "TokenizerConfig", "DocumentsConfig", "DataConfig", "OptimConfig", "TrainerConfig", "SnapshotConfig",
           "DistConfig", "ReplicasConfig", "RunConfig", "ConfigError"]


class ConfigError(ValueError):
    """A configuration value is invalid; the message names it and says what to do."""


AUTO_MICRO_BATCH = 32  # trainer.micro_batch_size=0 (chosen): at most this many sequences a forward pass


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class TokenizerConfig:
    kind: str = "char"
    """"char" (vocabulary built from the corpus) or "bpe" (GPT-2 byte-level BPE via tiktoken)."""
    ranks_file: str | None = None
    """Local GPT-2 `.tiktoken` ranks file for machines without internet; checked by sha256."""

    def __post_init__(self) -> None:
        _check(self.kind in ("char", "bpe"), f"data.tokenizer.kind={self.kind!r}: use 'char' or 'bpe'")
        _check(self.kind == "bpe" or self.ranks_file is None,
               "data.tokenizer.ranks_file applies to data.tokenizer.kind=bpe only (the char tokenizer builds its "
               "vocabulary from the text): add data.tokenizer.kind=bpe (or data=shakespeare_bpe), or leave it out")


@dataclass(frozen=True)
class DocumentsConfig:
    """How documents are read and batched (data.kind=documents): by length, under a token budget."""

    format: str = "text"
    """"text" (one file split on `separator`), "jsonl" (one object per line), or "files" (every
    file of a directory or fsspec glob is one document)."""
    separator: str = "\n\n"
    """What separates documents in a text file (a blank line by default)."""
    text_field: str = "text"
    """The JSON field holding the text, for format=jsonl."""
    batching: str = "length_grouped"
    """"length_grouped" (similar lengths together, balanced ranks) or "random" (the baseline)."""
    token_budget: int = 4096
    """Padded tokens (B x T_max) per micro-batch at most."""
    micro_batches_per_step: int = 4
    """Micro-batches per global step (spread over ranks and accumulation steps)."""
    pool_size: int = 4096
    """Pieces sorted by length together (larger: less padding, less randomness)."""

    def __post_init__(self) -> None:
        _check(self.format in ("text", "jsonl", "files"),
               f"data.documents.format={self.format!r}: use text, jsonl or files")
        _check(self.batching in ("length_grouped", "random"),
               f"data.documents.batching={self.batching!r}: use length_grouped or random")
        _check(self.micro_batches_per_step > 0 and self.pool_size > 0 and self.token_budget > 0,
               "data.documents.token_budget, micro_batches_per_step and pool_size must be positive")
        # A setting of another format would be ignored: refuse it, naming the format it belongs to.
        for key, fmt in (("separator", "text"), ("text_field", "jsonl")):
            _check(self.format == fmt or getattr(self, key) == getattr(DocumentsConfig, key),
                   f"data.documents.{key} applies to data.documents.format={fmt} only (it is {self.format}): "
                   "leave it out, or set the format")


@dataclass(frozen=True)
class DataConfig:
    path: str = "data/input.txt"
    """A raw corpus (a local path, s3://bucket/key or https:// URL, read through fsspec; prepared
    into cache_dir on first use) or a dataset made by mingpt-prepare (its directory or s3:// prefix)."""
    fetch_default: bool = True
    """If path is the default data/input.txt and missing, download tiny Shakespeare (without internet:
    one line that says how to supply it; never another corpus)."""
    block_size: int = 128
    """Context length in tokens: what the model is trained with and sampled at (the model's
    position embedding has exactly this many rows). The one place this value is set."""
    val_fraction: float = 0.1
    """The last fraction of the tokens (stream) or of the documents held out for validation."""
    cache_dir: str = "~/.cache/mingpt"
    """Node-local directory: raw corpora prepared on first use, and copies of remote shards."""
    shard_cache_gb: float = 50.0
    """At most this much of a prepared dataset on S3 is kept in cache_dir (least recently used
    shards go first); the whole dataset when it fits, so that steps never wait on S3."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    kind: str = "stream"
    """"stream": fixed blocks of one token stream (classic minGPT), batched by trainer.batch_size;
    "documents": variable-length documents with an end-of-text token between them, batched by
    length under data.documents."""
    documents: DocumentsConfig = field(default_factory=DocumentsConfig)
    """Reading and batching documents; only for kind=documents."""

    def __post_init__(self) -> None:
        _check(self.block_size > 0, f"data.block_size must be positive, got {self.block_size}")
        _check(self.kind in ("stream", "documents"), f"data.kind={self.kind!r}: use stream or documents")
        _check(self.kind == "documents" or self.documents == DocumentsConfig(),
               "data.documents.* settings apply to data.kind=documents only; set data.kind=documents (or "
               "data=shakespeare_speeches), or leave them out")
        _check(self.kind == "stream" or self.documents.token_budget >= self.block_size,
               f"data.documents.token_budget={self.documents.token_budget} is below data.block_size="
               f"{self.block_size}: a piece of a full block must fit in a micro-batch; raise it")
        _check(0.0 < self.val_fraction < 1.0, f"data.val_fraction must be in (0, 1), got {self.val_fraction}")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate, reached after warmup_steps."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay (max_steps)."""
    warmup_steps: int = 100
    """Linear warmup from 0 to lr."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to 2-D weights only (not biases, LayerNorms)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables."""

    def __post_init__(self) -> None:
        _check(self.lr > 0, f"optim.lr must be positive, got {self.lr}")
        _check(0 <= self.min_lr <= self.lr, f"optim.min_lr must be in [0, lr], got {self.min_lr}")
        _check(self.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"optim.betas invalid: {self.betas}")
        _check(self.weight_decay >= 0 and self.grad_clip >= 0, "optim.weight_decay and optim.grad_clip must be >= 0")


@dataclass(frozen=True)
class TrainerConfig:
    max_steps: int = 2000
    """Optimizer steps to train for (the LR schedule ends here)."""
    batch_size: int = 32
    """Fixed blocks (data.kind=stream): the global batch in sequences per optimizer step, whatever
    the world size. Documents are batched by data.documents instead."""
    micro_batch_size: int = 0
    """Fixed blocks: sequences per forward pass on one rank at most (accumulation steps follow from
    it); a batch_size below it is one micro-batch. 0 = chosen: 32, and under `pipeline_parallel` few
    enough that each pipeline has a micro-batch per stage (the settings screen says what was chosen)."""
    eval_every: int = 250
    """Evaluate on the validation split every N steps (and at the end); 0 disables."""
    eval_iters: int = 20
    """Validation batches per evaluation (each the size of one global batch of training)."""
    log_every: int = 10
    """Log a line (and a metrics record) every N steps."""
    precision: str = "auto"
    """"auto" (bf16 autocast on CUDA, fp32 on CPU), "fp32", "bf16" or "fp16" (with GradScaler)."""
    compile: bool = False
    """torch.compile the model."""
    optimizer: str = "adamw"
    """"adamw", or "muon": torch's Muon (momentum 0.95, Nesterov, its update scaled to AdamW's size so
    optim.lr and its schedule serve both) for the blocks' matrices, AdamW for embeddings, norms and
    biases. A snapshot continues with the optimizer it was trained with."""
    activation_checkpointing: bool = False
    """Keep only each block's input for the backward and recompute the rest there: the blocks'
    activations no longer held (the largest part of memory at long contexts and big micro-batches),
    for about a third more compute; the same gradients. `python -m benchmarks memory --ac` measures it."""
    deterministic: bool = False
    """Deterministic GPU kernels (torch.use_deterministic_algorithms, a fixed cuBLAS workspace): two
    runs of one config, and a run resumed after a fault, end bitwise equal on GPUs too, at some speed
    (docs/performance.md). CPU runs are deterministic either way."""
    threads: int = 0
    """Intra-op CPU threads per process; 0 = the cores this process may use / local world size."""
    seed: int = 1337
    """Seeds initialisation, data order and dropout."""
    cpu_peak_flops: float = 220e9
    """Peak FLOP/s of one CPU machine for MFU (this repo's reference: 2-core fp32 matmul)."""
    gpu_peak_flops: float = 0.0
    """Peak FLOP/s of one GPU for MFU; 0 = look up by device name."""
    tensorboard: bool = False
    """Also write metrics to TensorBoard in run_dir/tb."""
    tracker: str = "none"
    """Also send the metrics to an experiment tracker from the first rank: "none", "wandb" (Weights &
    Biases; WANDB_MODE=offline writes files to `wandb sync` later) or "mlflow" (at MLFLOW_TRACKING_URI).
    A resumed or restarted run continues the same tracked run (its id in run_dir/tracker.json)."""
    tracker_project: str = "mingpt"
    """The wandb project, or the MLflow experiment, that the tracked run goes into."""
    progress: bool = True
    """Show a progress bar on the first rank when stderr is a terminal."""
    run_dir: str = "runs/default"
    """Where metrics, the tokenizer and (by default) snapshots go."""
    readable_by: str = "user"
    """Who may read what the run writes on this node (run_dir, snapshots on a file system, metrics,
    data.cache_dir): "user" (folders 0700, files 0600: the process's umask 077), "group" (027) or
    "all" (022, most shells' default). A node's other users read no weights by default."""
    watchdog_s: float = 900.0
    """Exit (for torchrun to restart) when a step makes no progress for this long; 0 = off."""
    parallel: str = "ddp"
    """How the model is spread over the ranks: "ddp" (every rank holds all of it and the optimizer
    state), "fsdp" (FSDP2: each rank holds 1/world of weights, gradients and optimizer state) or
    "hsdp" (FSDP2 within each node, replicated across nodes: only gradient shards cross between
    nodes; every node must run the same number of processes)."""
    tensor_parallel: int = 1
    """Tensor parallelism: each block (heads, MLP columns), the sequence between blocks and the vocabulary
    split over this many processes of one node, with `parallel` across the groups; 1 = off. Must divide
    the processes per node, model.n_head, data.block_size and the vocabulary padded to a multiple of 64."""
    pipeline_parallel: int = 1
    """Pipeline parallelism: the blocks split into this many stages, one per process (the embedding on the
    first, the final norm and head on the last; the tied matrix held by both), the processes numbered
    stage by stage, with `parallel` (ddp; fsdp: each stage sharded over its copies; hsdp: sharded within a
    node, replicated across the stage's nodes) across the pipelines and `tensor_parallel` inside each
    stage; 1 = off. At most model.n_layer; must divide the world
    size. docs/pipeline.md."""
    pipeline_schedule: str = "1f1b"
    """The schedule of a step's micro-batches through the stages: "1f1b" (one forward, one backward: at most
    `pipeline_parallel` micro-batches' activations held; needs that many micro-batches per data rank),
    "gpipe" (every forward, then every backward; the same bubble) or "interleaved" (1F1B with two stages on
    each process, stage s on process s % pipeline_parallel: a smaller bubble for more sends; needs
    2 x pipeline_parallel blocks). docs/pipeline.md."""

    def __post_init__(self) -> None:
        _check(self.max_steps > 0, f"trainer.max_steps must be positive, got {self.max_steps}")
        _check(self.batch_size > 0 and self.micro_batch_size >= 0,
               "trainer.batch_size must be positive and micro_batch_size >= 0 (0 = chosen)")
        _check(self.precision in ("auto", "fp32", "bf16", "fp16"),
               f"trainer.precision={self.precision!r}: use auto, fp32, bf16 or fp16")
        _check(self.log_every > 0, f"trainer.log_every must be positive, got {self.log_every}")
        _check(self.parallel in ("ddp", "fsdp", "hsdp"), f"trainer.parallel={self.parallel!r}: use ddp, fsdp or hsdp")
        _check(self.optimizer in ("adamw", "muon"), f"trainer.optimizer={self.optimizer!r}: use adamw or muon")
        _check(self.readable_by in ("user", "group", "all"),
               f"trainer.readable_by={self.readable_by!r}: use user, group or all")
        _check(self.optimizer != "muon" or self.precision != "fp16",
               "trainer.optimizer=muon with trainer.precision=fp16 is not supported: use bf16 (or fp32)")
        _check(self.tensor_parallel >= 1, f"trainer.tensor_parallel must be >= 1 (1 = off), got {self.tensor_parallel}")
        _check(self.pipeline_parallel >= 1,
               f"trainer.pipeline_parallel must be >= 1 (1 = off), got {self.pipeline_parallel}")
        _check(self.pipeline_schedule in ("1f1b", "gpipe", "interleaved"),
               f"trainer.pipeline_schedule={self.pipeline_schedule!r}: use 1f1b, gpipe or interleaved")
        _check(self.eval_every >= 0 and self.eval_iters > 0, "trainer.eval_every must be >= 0 and eval_iters > 0")
        _check(self.threads >= 0, f"trainer.threads must be >= 0, got {self.threads}")
        _check(self.tracker in ("none", "wandb", "mlflow"), f"trainer.tracker={self.tracker!r}: use none, wandb or mlflow")


    @property
    def micro_batch(self) -> int:
        """Sequences per forward pass (fixed blocks)."""
        return min(self.micro_batch_size or AUTO_MICRO_BATCH, self.batch_size)


@dataclass(frozen=True)
class SnapshotConfig:
    dir: str | None = None
    """Snapshot store: a local directory or s3://bucket/prefix; None = run_dir/snapshots."""
    every_steps: int = 500
    """Save every N steps (and always at the end and on preemption); 0 = off."""
    every_seconds: float = 0.0
    """Also save when this many seconds passed since the last save; 0 = off."""
    keep_last: int = 3
    """Committed snapshots kept; older ones are deleted after a newer one commits."""
    keep_every: int = 0
    """Also keep every snapshot whose step is a multiple of this, forever; 0 = off."""
    retries: int = 3
    """Retries of a failed save (with exponential backoff from 1 s) before reporting it."""
    resume: str = "latest"
    """"latest" (default: continue from the newest good snapshot), "never" (a new run), or the path
    of one snapshot folder. A restart of the same torchrun job always continues its own newest
    snapshot, and a new run never shares a store with another one (see move_aside)."""
    move_aside: bool = False
    """Starting a new run (resume=never, or from an explicit snapshot) where another run left
    snapshots or metrics is refused; true moves them aside to `<dir>.aside-<time>` instead."""
    endpoint_url: str | None = None
    """S3-compatible endpoint (e.g. MinIO); None uses the standard AWS configuration."""
    uploader: str = "s3fs"
    """How a shard goes to an object store: "s3fs" or "boto3" (multipart uploads, 8 parts in flight)."""
    load_layout: str = "exchange"
    """How ranks that each hold all the weights (DDP) load them: "exchange" (each reads 1/world of
    the snapshot and the ranks broadcast their parts) or "direct" (every rank reads all of it)."""
    node_cache: str = "auto"
    """Keep a copy of what each node wrote of the two newest snapshots in node-local memory, so that a
    restart on the same node loads from RAM: "on", "off", or "auto" (on for object stores: a local
    disk is served from the page cache already)."""
    node_cache_dir: str = "/dev/shm"
    """Where the node cache lives: a tmpfs (memory). Copies go into mingpt-<uid>/job-<key>/ there,
    private to the user; a failed job's are reclaimed by the user's next start on the node, or by
    `mingpt-snapshot clean-cache`."""
    lease_s: float = 30.0
    """One live job per store: the first rank holds a lease in the store, renewed every lease_s / 4
    seconds; another job's start is refused until it is released, or has not been renewed for
    lease_s (a dead job's)."""

    def __post_init__(self) -> None:
        _check(self.lease_s > 0, f"snapshot.lease_s must be positive, got {self.lease_s}")
        _check(self.uploader in ("s3fs", "boto3"), f"snapshot.uploader={self.uploader!r}: use s3fs or boto3")
        _check(self.load_layout in ("exchange", "direct"),
               f"snapshot.load_layout={self.load_layout!r}: use exchange or direct")
        _check(self.node_cache in ("auto", "on", "off"), f"snapshot.node_cache={self.node_cache!r}: use auto, on or off")
        _check(self.every_steps >= 0, f"snapshot.every_steps must be >= 0, got {self.every_steps}")
        _check(self.keep_last >= 1, f"snapshot.keep_last must be >= 1, got {self.keep_last}")
        _check(self.every_seconds >= 0 and self.keep_every >= 0 and self.retries >= 0,
               "snapshot.every_seconds, keep_every and retries must be >= 0")
        _check(self.resume in ("latest", "never") or "/" in self.resume,
               f"snapshot.resume={self.resume!r}: use latest, never, or the path of a snapshot folder "
               "(e.g. runs/default/snapshots/step_000001000)")


@dataclass(frozen=True)
class DistConfig:
    timeout_s: float = 600.0
    """Process-group timeout: longer than the longest gap between collectives (eval, snapshot)."""

    def __post_init__(self) -> None:
        _check(self.timeout_s > 0, f"dist.timeout_s must be positive, got {self.timeout_s}")


@dataclass(frozen=True)
class ReplicasConfig:
    """Replica groups (docs/replicas.md): the job is len(peers) groups, each its own torchrun, data
    parallel across the groups; when a group is lost the others go on training."""
    peers: list[str] = field(default_factory=list)
    """HOST:PORT of every group's beacon, in group order, the same list for every group; empty: off."""
    group: int = -1
    """This group's place in `peers` (the launch gives it: it does not change when torchrun restarts
    the group, unlike RANK)."""
    min_groups: int = 0
    """Groups that must be alive to train; 0: a majority of them (two sides of a cut network never
    both train)."""
    heartbeat_s: float = 0.1
    """Seconds between heartbeats at least (a member's to the coordinator and its successor, theirs
    back): what changed goes at once; with nothing new, a beat every lost_after_s / 4 if longer."""
    lost_after_s: float = 1.0
    """A group silent this long is lost (a killed process is noticed at once: its connection breaks;
    one whose heartbeats come late is given up to 4 x as long)."""
    timeout_s: float = 30.0
    """How long forming an epoch's process group, or one collective, may take at most."""
    quorum_wait_s: float = 600.0
    """How long a group waits to form an epoch while fewer than min_groups groups are heard from at all
    (the others exited, or never started); then it exits 2, naming them. A group heard from (starting,
    or waiting for its port) is waited for as long as it takes."""
    shares_per_group: int = 0
    """Every global step is cut into len(peers) x this many shares, each group training its own;
    a lost group's shares are dealt out among the survivors. 0: N x min(groups - 1, 4) for groups of N
    processes, min(groups - 1, 4) each (with trainer.parallel=fsdp, whose processes train each share
    together, a part each: min(groups - 1, 4)); a lost owner's shares go one to each of up to 4 others."""
    fan_out: int = 32
    """Members (processes) below each relay in a job of more than fan_out + 1 members: the beacons hear
    each other through a tree, each member holding a channel to its parent and to its fan_out children
    at most (the root, the coordinator, hears every member through them). Up to fan_out + 1 members,
    every member hears the coordinator and its successor directly."""

    def __post_init__(self) -> None:
        n = len(self.peers)
        _check(n == 0 or 0 <= self.group < n,
               f"replicas.group={self.group}: give each group its place in replicas.peers (0 to {n - 1})")
        _check(n != 1, "replicas.peers lists one group: list every group's HOST:PORT, or leave it empty")
        _check(0 <= self.min_groups <= n, f"replicas.min_groups={self.min_groups} must be 0 (a majority) to {n}")
        _check(0 < self.heartbeat_s < self.lost_after_s,
               f"replicas.heartbeat_s ({self.heartbeat_s}) must be positive and below lost_after_s ({self.lost_after_s})")
        _check(self.quorum_wait_s > 0, f"replicas.quorum_wait_s={self.quorum_wait_s} must be positive")
        _check(self.shares_per_group >= 0, f"replicas.shares_per_group={self.shares_per_group} must be 0 "
                                           "(the default: min(groups - 1, 4) per process) or more")
        _check(len(set(self.peers)) == n, "replicas.peers lists an address twice: give each group its own HOST:PORT")
        _check(self.fan_out >= 1, f"replicas.fan_out={self.fan_out} must be 1 or more (members below each relay)")

    @property
    def enabled(self) -> bool:
        return bool(self.peers)


@dataclass(frozen=True)
class RunConfig:
    model: GPTConfig = field(default_factory=GPTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    replicas: ReplicasConfig = field(default_factory=ReplicasConfig)

    def __post_init__(self) -> None:
        # One context length, so that a model is never sampled at positions it was not trained on.
        _check(self.model.block_size in (0, self.data.block_size),
               f"model.block_size={self.model.block_size} cannot be set on its own: the context length is "
               f"data.block_size (now {self.data.block_size}), used for training and sampling alike; "
               f"set data.block_size={self.model.block_size} instead")
        _check(self.model.init_from is None or self.data.tokenizer.kind == "bpe",
               f"model.init_from={self.model.init_from} starts from GPT-2's weights, which read GPT-2's BPE tokens: "
               "set data.tokenizer.kind=bpe (e.g. data=shakespeare_bpe)")
        tp = self.trainer.tensor_parallel
        _check(tp == 1 or self.model.init_from is None,
               f"model.init_from with trainer.tensor_parallel={tp} is not supported: start from GPT-2's weights "
               "without it, and continue that run's snapshot with tensor_parallel (snapshots load under any layout)")
        _check(tp == 1 or not self.trainer.compile,
               f"trainer.compile with trainer.tensor_parallel={tp} is not supported: torch.compile fails on the split "
               "model (torch 2.13: its split embedding); set trainer.compile=false")
        _check(self.trainer.parallel != "hsdp" or not self.replicas.enabled,
               "trainer.parallel=hsdp inside replica groups (replicas.peers) is not supported: a group is one node; "
               "use trainer.parallel=fsdp (sharded inside each group, replicated across the groups: a "
               "fault-tolerant HSDP)")
        pp, t = self.trainer.pipeline_parallel, self.trainer
        if pp > 1:
            _check(not t.compile, f"trainer.compile with trainer.pipeline_parallel={pp} is not supported: set "
                   "trainer.compile=false")
            _check(self.model.dropout == 0, f"model.dropout with trainer.pipeline_parallel={pp} is not supported (the "
                   "schedule's order would change the dropout noise): set model.dropout=0")
            _check(t.precision != "fp16", f"trainer.precision=fp16 with trainer.pipeline_parallel={pp} is not "
                   "supported (each stage's GradScaler would skip steps on its own): use bf16 or fp32")
            _check(self.model.init_from is None, f"model.init_from with trainer.pipeline_parallel={pp} is not "
                   "supported: start from GPT-2's weights without it, and continue that run's snapshot with "
                   "pipeline_parallel (snapshots load under any layout)")
            _check(not self.replicas.enabled, f"trainer.pipeline_parallel={pp} inside replica groups (replicas.peers) "
                   "is not supported: use replica groups without a pipeline")
        fixed = (TrainerConfig.batch_size, TrainerConfig.micro_batch_size)  # the defaults: not set
        _check(self.data.kind == "stream" or (self.trainer.batch_size, self.trainer.micro_batch_size) == fixed,
               "trainer.batch_size and trainer.micro_batch_size size batches of fixed blocks; documents are "
               "batched by data.documents.token_budget and data.documents.micro_batches_per_step")

    def for_world(self, world_size: int) -> RunConfig:
        """This config on `world_size` processes: under a pipeline, a chosen micro_batch_size (0) gives each
        pipeline at least a micro-batch per stage, which 1F1B needs (smaller ones also shrink the bubble)."""
        t = self.trainer
        if t.micro_batch_size or t.pipeline_parallel == 1 or self.data.kind != "stream":
            return self
        pipelines = max(1, world_size // (t.pipeline_parallel * t.tensor_parallel))
        per_pipeline = -(-t.batch_size // pipelines)
        chosen = max(1, min(AUTO_MICRO_BATCH, per_pipeline // t.pipeline_parallel))
        return dataclasses.replace(self, trainer=dataclasses.replace(t, micro_batch_size=chosen))

    def to_dict(self) -> dict:
        """Plain containers (no tensors), for manifests and snapshots."""
        return dataclasses.asdict(self)

    @property
    def snapshot_store(self) -> str:
        """Where snapshots go: snapshot.dir, or run_dir/snapshots."""
        return self.snapshot.dir or os.path.join(self.trainer.run_dir, "snapshots")
