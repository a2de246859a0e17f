"""The Hydra entry point, and the only place where the run's objects are assembled.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 mingpt/main.py trainer.max_steps=200 model=gpt-micro
    python -m mingpt.main
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from mingpt import distributed as D
from mingpt.config import ConfigError, RunConfig, from_dict
from mingpt.data import Corpus, DataError, load_corpus, load_documents, write_json_atomic
from mingpt.metrics import MetricsWriter
from mingpt.model import GPT
from mingpt.optim import build_optimizer
from mingpt.sampler import LengthGroupedSampler, StreamSampler
from mingpt.snapshot import SnapshotError, Snapshotter, SnapshotStore
from mingpt.tokenizer import TokenizerError
from mingpt.trainer import Trainer
from mingpt.watchdog import Watchdog

log = logging.getLogger("mingpt")

USER_ERRORS = (ConfigError, DataError, SnapshotError, TokenizerError)
# Exit code of a run stopped by a preemption signal after saving (EX_TEMPFAIL: try again later).
# Non-zero, so schedulers count the attempt as failed and torchrun / SLURM can restart it.
EXIT_PREEMPTED = 75


def config_dir() -> str:
    """conf/ of a source checkout, else the copy installed inside the package."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "conf", here / "conf"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError("mingpt's conf/ directory is missing from this installation")


def setup_logging(info: D.DistInfo) -> None:
    """One format naming host, local rank and current rank; INFO from the first rank only."""
    fmt = (f"%(asctime)s {info.hostname}:{info.local_rank} [rank {info.rank}/{info.world_size}] "
           "%(levelname)s %(name)s: %(message)s")
    logging.basicConfig(level=logging.INFO if info.is_first else logging.WARNING, format=fmt,
                        datefmt="%H:%M:%S", stream=sys.stderr, force=True)


class MismatchError(SnapshotError):
    pass


def check_compatible(cfg: RunConfig, manifest: dict) -> None:
    """Refuse a snapshot of another model shape; log the other config changes."""
    old = manifest["config"]
    current_shape = cfg.model.shape_dict()
    saved_shape = manifest["model_shape"]
    diff = [f"{k}: snapshot {saved_shape.get(k)!r} vs config {v!r}" for k, v in current_shape.items()
            if saved_shape.get(k) != v]
    if diff:
        raise MismatchError(
            "the snapshot to resume has another model shape (" + "; ".join(diff) + "). Use the snapshot's "
            "model settings, another snapshot.dir, or snapshot.resume=never"
        )
    now = cfg.to_dict()
    for section in ("data", "optim", "trainer"):
        for k, v in now[section].items():
            if old.get(section, {}).get(k) != v and not isinstance(v, dict):
                log.info("config changed since the snapshot: %s.%s %r -> %r", section, k,
                         old.get(section, {}).get(k), v)


def load_resume_state(store: SnapshotStore | None, resume: str, info: D.DistInfo) -> tuple[dict, dict] | None:
    """The first rank finds and verifies the snapshot; every rank gets the same one."""
    if store is None or resume == "never":
        return None
    result, error = None, None
    if info.is_first:
        try:
            if resume == "latest":
                result = store.load_latest()
            else:
                result = store.load(resume.rstrip("/"))
        except Exception as e:  # noqa: BLE001 - forwarded to every rank below, then raised
            error = e
    result, error = D.broadcast_object((result, error))
    if error is not None:
        raise error
    return result


@dataclass
class Run:
    trainer: Trainer
    metrics: MetricsWriter
    snapshotter: Snapshotter

    def close(self) -> None:
        self.snapshotter.close()  # waits for the last save
        self.metrics.close()


def open_store(url: str, endpoint_url: str | None) -> SnapshotStore:
    """The snapshot store, checked to be reachable now rather than at the first save."""
    storage_options = {"endpoint_url": endpoint_url} if endpoint_url else {}
    try:
        store = SnapshotStore(url, storage_options)
        store.check()
    except Exception as e:  # noqa: BLE001 - any backend's connection or permission error
        raise SnapshotError(
            f"cannot reach snapshot store {url} ({e.__class__.__name__}: {e}); check snapshot.dir, "
            "snapshot.endpoint_url and the AWS credentials / region in the environment"
        ) from None
    return store


def assemble(cfg: RunConfig, info: D.DistInfo, preempt: D.PreemptionFlag | None = None) -> Run:
    """Build every object of the run from the typed config; resume if a snapshot exists."""
    tcfg = cfg.trainer
    torch.set_num_threads(tcfg.threads or D.default_threads(info.local_world_size))
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    store = open_store(cfg.snapshot.dir or os.path.join(tcfg.run_dir, "snapshots"), cfg.snapshot.endpoint_url)
    resumed = load_resume_state(store, cfg.snapshot.resume, info)
    state, manifest = resumed if resumed else (None, None)

    d = cfg.data
    tok_state = manifest["tokenizer"] if manifest else None
    if d.kind == "documents":
        corpus: Corpus = load_documents(d.path, d.format, d.separator, d.text_field, d.fetch_default,
                                        d.tokenizer.kind, d.tokenizer.ranks_file, d.cache_dir, d.block_size,
                                        d.val_fraction, tok_state)
    else:
        corpus = load_corpus(d.path, d.fetch_default, d.tokenizer.kind, d.tokenizer.ranks_file, d.cache_dir,
                             d.block_size, d.val_fraction, tok_state)
    log.info("corpus %s (%s): %d train / %d val %s of up to %d tokens, vocabulary %d (%s)", corpus.source, d.kind,
             len(corpus.train), len(corpus.val), "pieces" if d.kind == "documents" else "blocks", d.block_size,
             corpus.tokenizer.vocab_size, d.tokenizer.kind)
    model_cfg = replace(cfg.model, vocab_size=corpus.tokenizer.vocab_size)
    cfg = replace(cfg, model=model_cfg)
    if manifest:
        check_compatible(cfg, manifest)

    torch.manual_seed(tcfg.seed)  # same initial weights on every rank
    raw = GPT(model_cfg).to(info.device)
    log.info("model %s: %.2fM parameters", model_cfg.preset or "custom", raw.num_params() / 1e6)
    model: torch.nn.Module = raw
    if tcfg.compile:
        model = torch.compile(model)
    if info.distributed:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[info.local_rank] if info.device.startswith("cuda") else None,
            gradient_as_bucket_view=True)
    optimizer = build_optimizer(raw, cfg.optim.lr, cfg.optim.betas, cfg.optim.weight_decay)
    scaler = torch.amp.GradScaler(torch.device(info.device).type, enabled=tcfg.precision == "fp16")
    if d.kind == "documents":
        c = model_cfg.resolved()
        attn_coeff = 12 * c.n_layer * c.n_embd / (6 * raw.num_params())  # attention's T^2 term vs 6N per token
        sampler = LengthGroupedSampler(corpus.train.seq_lengths, d.token_budget, d.micro_batches_per_step, tcfg.seed,
                                       d.batching, d.pool_size, attn_coeff)
        log.info("%s batching: %d global steps per epoch of %d micro-batches <= %d padded tokens",
                 d.batching, sampler.steps_per_epoch, d.micro_batches_per_step, d.token_budget)
    else:
        sampler = StreamSampler(len(corpus.train), tcfg.batch_size, tcfg.seed, tcfg.micro_batch_size)
    metrics = MetricsWriter(tcfg.run_dir, enabled=info.is_first, tensorboard=tcfg.tensorboard)
    run_meta = {"config": cfg.to_dict(), "model_shape": model_cfg.shape_dict(),
                "tokenizer": corpus.tokenizer.state_dict(), "corpus": corpus.source}
    if info.is_first:
        write_json_atomic(Path(tcfg.run_dir) / "tokenizer.json", corpus.tokenizer.state_dict())
    sc = cfg.snapshot
    snapshotter = Snapshotter(store, sc.keep_last, sc.keep_every, sc.retries, enabled=info.is_first)
    trainer = Trainer(tcfg, cfg.optim, model, raw, optimizer, scaler, corpus.train, corpus.val, sampler, info,
                      metrics, snapshotter, sc.every_steps, sc.every_seconds, preempt or D.PreemptionFlag(), run_meta,
                      Watchdog(tcfg.watchdog_s, f"rank {info.rank} ({info.hostname}:{info.local_rank})"))
    if state is not None:
        trainer.load_state_dict(state)
        log.info("resumed from snapshot step %d (saved at world size %d, now %d; torchrun restart %d here)",
                 trainer.step, manifest["world_size"], info.world_size, info.restart_count)
        metrics.write({"kind": "resume", "step": trainer.step, "world_size": info.world_size})
    return Run(trainer, metrics, snapshotter)


def run(dcfg: DictConfig) -> int:
    D.die_with_parent()
    info = D.DistInfo.from_env()
    setup_logging(info)
    preempt = D.PreemptionFlag().install()
    run_obj = None
    try:
        cfg = from_dict(OmegaConf.to_container(dcfg, resolve=True))
        D.init(info, cfg.dist.timeout_s)
        run_obj = assemble(cfg, info, preempt)
        finished = run_obj.trainer.train()
        return 0 if finished else EXIT_PREEMPTED
    except USER_ERRORS as e:
        log.error("%s", e)
        return 2
    finally:
        if run_obj is not None:
            run_obj.close()
        D.shutdown()


@record
def main() -> None:
    code = 0

    @hydra.main(config_path=config_dir(), config_name="config", version_base="1.3")
    def _hydra_entry(dcfg: DictConfig) -> None:
        nonlocal code
        code = run(dcfg)

    _hydra_entry()
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
