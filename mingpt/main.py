"""The torchrun entry point, and the only place where a run's objects are assembled.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 mingpt/main.py model=gpt-micro
    python -m mingpt.main            # the same job, one process (also installed as mingpt-train)
"""

from __future__ import annotations

import logging
import sys
import traceback
from dataclasses import replace
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from mingpt import distributed
from mingpt.compose import compose, config_dir, register
from mingpt.config import ConfigError, RunConfig, from_dict
from mingpt.data import Corpus, DataError, load_corpus
from mingpt.data.samplers import LengthGroupedSampler, StreamSampler, validation_batches
from mingpt.distributed import DistInfo, PreemptionFlag
from mingpt.model import GPT
from mingpt.preflight import PreflightError, run_checks
from mingpt.pretrained import PretrainedError, load_into, locate, read_config
from mingpt.snapshot import SnapshotError, Snapshotter, SnapshotStore
from mingpt.snapshot.resume import MismatchError, check_compatible, choose_start, set_aside
from mingpt.storage import write_json_atomic
from mingpt.tokenizer import TokenizerError
from mingpt.training.metrics import MetricsWriter
from mingpt.training.optim import build_optimizer
from mingpt.training.trainer import Trainer
from mingpt.training.watchdog import Watchdog

log = logging.getLogger("mingpt")

USER_ERRORS = (ConfigError, DataError, distributed.ProcessGroupError, PreflightError, PretrainedError, SnapshotError,
               TokenizerError)


def setup_logging(info: DistInfo) -> None:
    """One format naming host, local rank and current rank; INFO from rank 0 only, plus one line
    from the first process of every other node (that it joined)."""
    fmt = (f"%(asctime)s {info.hostname}:{info.local_rank} [rank {info.rank}/{info.world_size}] "
           "%(levelname)s %(name)s: %(message)s")
    logging.basicConfig(level=logging.INFO if info.is_rank0 else logging.WARNING, format=fmt,
                        datefmt="%H:%M:%S", stream=sys.stderr, force=True)
    if info.local_rank == 0:
        logging.getLogger("mingpt.node").setLevel(logging.INFO)


def open_store(url: str, endpoint_url: str | None) -> SnapshotStore:
    """The snapshot store, checked to be reachable now rather than at the first save."""
    storage_options = {"endpoint_url": endpoint_url} if endpoint_url else {}
    store = None
    try:
        store = SnapshotStore(url, storage_options)
        store.check()
    except Exception as e:  # noqa: BLE001 - any backend's connection or permission error
        if store is not None and store.local:
            raise SnapshotError(f"cannot use snapshot store {url} ({e.__class__.__name__}: {e}); point "
                                "snapshot.dir (or trainer.run_dir) at a directory you can write to") from None
        raise SnapshotError(
            f"cannot reach snapshot store {url} ({e.__class__.__name__}: {e}); check snapshot.dir, "
            "snapshot.endpoint_url and the AWS credentials / region in the environment"
        ) from None
    return store


def build_samplers(cfg: RunConfig, corpus: Corpus, model: GPT):
    """(training sampler, sampler over the validation split) of the data's kind."""
    d, seed = cfg.data, cfg.trainer.seed
    if d.kind == "stream":
        batch, micro = cfg.trainer.global_batch, cfg.trainer.micro_batch
        return (StreamSampler(len(corpus.train), batch, seed, micro), StreamSampler(len(corpus.val), batch, seed, micro))
    c = model.config
    attn_coeff = 12 * c.n_layer * c.n_embd / (6 * model.num_params())  # attention's T^2 term vs 6N per token
    docs = d.documents
    train, val = (LengthGroupedSampler(split.seq_lengths, docs.token_budget, docs.micro_batches_per_step, seed,
                                       docs.batching, docs.pool_size, attn_coeff) for split in (corpus.train, corpus.val))
    log.info("%s batching: %d global steps per epoch of %d micro-batches <= %d padded tokens", docs.batching,
             train.steps_per_epoch, docs.micro_batches_per_step, docs.token_budget)
    return train, val


def pretrained_checkpoint(name: str, info: DistInfo) -> Path:
    """The checkpoint's directory: the first process of each node downloads it (once, into the hub's
    cache); the others wait for it, then read the same files."""
    path, error = None, None
    if info.local_rank == 0:
        try:
            path = locate(name, download=True)
        except PretrainedError as e:
            error = e
    distributed.barrier()
    if error is not None:
        raise error
    return path if path is not None else locate(name, download=False)


def with_pretrained_shape(cfg: RunConfig, directory: Path) -> RunConfig:
    """The run's config with the model shape of a GPT-2 checkpoint."""
    hf = read_config(directory)
    if cfg.data.block_size > hf["n_positions"]:
        raise ConfigError(f"data.block_size={cfg.data.block_size} is longer than the context of "
                          f"{cfg.model.init_from} ({hf['n_positions']}); lower data.block_size")
    log.info("model shape from %s: %d layers, %d heads, %d wide", cfg.model.init_from, hf["n_layer"], hf["n_head"],
             hf["n_embd"])
    return replace(cfg, model=replace(cfg.model, preset=None, n_layer=hf["n_layer"], n_head=hf["n_head"],
                                      n_embd=hf["n_embd"], bias=True))


def assemble(cfg: RunConfig, info: DistInfo, preempt: PreemptionFlag | None = None) -> Trainer:
    """Build every object of the run from the typed config; resume if a snapshot exists."""
    tcfg = cfg.trainer
    torch.set_num_threads(tcfg.threads or distributed.default_threads(info.local_world_size))
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    run_dir = Path(tcfg.run_dir)
    store = open_store(cfg.snapshot_store, cfg.snapshot.endpoint_url)
    # Rank 0 decides; every rank gets the same start. Nothing is moved before the snapshot to
    # continue is known to fit this config.
    state, manifest, run_id, others = distributed.on_rank0(lambda: choose_start(store, cfg.snapshot, info.job_id))
    pretrained = pretrained_checkpoint(cfg.model.init_from, info) if cfg.model.init_from else None
    if pretrained is not None:
        cfg = with_pretrained_shape(cfg, pretrained)
    if manifest:
        check_compatible(cfg, manifest)
    if info.is_rank0:
        set_aside(store, others, run_dir, info.job_id, fresh=state is None)

    try:
        corpus = load_corpus(cfg.data, manifest["tokenizer"] if manifest else None)
    except TokenizerError as e:
        if not manifest:
            raise
        # the resumed snapshot's characters cannot spell this corpus: the corpus is another one
        raise MismatchError(f"this corpus does not fit the snapshot to resume ({e}): the snapshot was trained on "
                            f"{manifest.get('corpus', 'another corpus')}. Resume with that corpus (data.path=...), or "
                            "start a new run in its own directory: trainer.run_dir=runs/NEW") from None
    log.info("corpus %s (%s): %d train / %d val %s of up to %d tokens, vocabulary %d (%s)", corpus.source,
             cfg.data.kind, len(corpus.train), len(corpus.val), "pieces" if cfg.data.kind == "documents" else "blocks",
             cfg.data.block_size, corpus.tokenizer.vocab_size, cfg.data.tokenizer.kind)
    if cfg.model.vocab_size not in (0, corpus.tokenizer.vocab_size):
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} cannot be set: it is the tokenizer's "
                          f"({corpus.tokenizer.vocab_size}); leave it out")
    model_cfg = replace(cfg.model, vocab_size=corpus.tokenizer.vocab_size, block_size=cfg.data.block_size)
    cfg = replace(cfg, model=model_cfg)
    if manifest and manifest["model_shape"]["vocab_size"] != model_cfg.vocab_size:
        raise MismatchError(f"the snapshot's vocabulary has {manifest['model_shape']['vocab_size']} tokens, this "
                            f"corpus and tokenizer give {model_cfg.vocab_size}: resume with the snapshot's data, or "
                            "start a new run in its own directory: trainer.run_dir=runs/NEW")

    torch.manual_seed(tcfg.seed)  # same initial weights on every rank
    raw = GPT(model_cfg)
    if pretrained is not None and state is None:  # a snapshot to resume wins over the starting weights
        checkpoint_vocab = read_config(pretrained)["vocab_size"]
        if checkpoint_vocab != model_cfg.vocab_size:
            raise PretrainedError(f"{cfg.model.init_from} has a vocabulary of {checkpoint_vocab} tokens, the "
                                  f"tokenizer {model_cfg.vocab_size}: use GPT-2's BPE ranks")
        load_into(raw, pretrained)
        log.info("initialised from %s (%s)", cfg.model.init_from, pretrained)
    raw = raw.to(info.device)
    log.info("model %s: %.2fM parameters, context %d", model_cfg.preset or "custom", raw.num_params() / 1e6,
             model_cfg.block_size)
    model: torch.nn.Module = raw
    if tcfg.compile:
        model = torch.compile(model)
    if info.distributed:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[info.local_rank] if info.device.startswith("cuda") else None,
            gradient_as_bucket_view=True)
    optimizer = build_optimizer(raw, cfg.optim.lr, cfg.optim.betas, cfg.optim.weight_decay)
    scaler = torch.amp.GradScaler(torch.device(info.device).type, enabled=tcfg.precision == "fp16")
    sampler, val_sampler = build_samplers(cfg, corpus, raw)
    val_batches = validation_batches(val_sampler, info.world_size, info.rank, tcfg.eval_iters)
    metrics = MetricsWriter(tcfg.run_dir, enabled=info.is_rank0, tensorboard=tcfg.tensorboard)
    snapshot_meta = {"run_id": run_id, "job_id": info.job_id, "config": cfg.to_dict(),
                     "model_shape": model_cfg.shape_dict(), "tokenizer": corpus.tokenizer.state_dict(),
                     "corpus": corpus.source}
    if info.is_rank0:
        write_json_atomic(run_dir / "tokenizer.json", corpus.tokenizer.state_dict())
    sc = cfg.snapshot
    snapshotter = Snapshotter(store, sc.keep_last, sc.keep_every, sc.retries, enabled=info.is_rank0)
    trainer = Trainer(tcfg, cfg.optim, model, raw, optimizer, scaler, corpus.train, corpus.val, sampler, val_batches,
                      info, metrics, snapshotter, sc.every_steps, sc.every_seconds, preempt or PreemptionFlag(),
                      snapshot_meta, Watchdog(tcfg.watchdog_s, f"rank {info.rank} ({info.hostname}:{info.local_rank})"))
    if state is not None:
        trainer.load_state_dict(state)
        log.info("resumed from snapshot step %d (saved at world size %d, now %d; torchrun restart %d here)",
                 trainer.step, manifest["world_size"], info.world_size, info.restart_count)
        metrics.write({"kind": "resume", "step": trainer.step, "world_size": info.world_size})
    metrics.write({"kind": "start", "run_id": run_id, "job_id": info.job_id, "step": trainer.step,
                   "world_size": info.world_size, "restart": info.restart_count})
    return trainer


def preflight(cfg: RunConfig, info: DistInfo) -> None:
    """The multi-node checks (code, versions, config, corpus, one snapshot store, devices), before any work."""
    _, _, seconds = run_checks(info, cfg.to_dict(), cfg.data.path, cfg.snapshot_store)
    log.info("preflight checks passed on %d rank%s in %.3f s", info.world_size,
             "" if info.world_size == 1 else "s", seconds)


def train_process(dcfg: DictConfig) -> int:
    """The whole job of one process; returns its exit code. Every error ends here, as one line."""
    distributed.die_with_parent()
    info = DistInfo.from_env()
    setup_logging(info)
    preempt = PreemptionFlag(announce=info.is_rank0).install()
    trainer = None
    try:
        cfg = from_dict(OmegaConf.to_container(dcfg, resolve=True))
        distributed.init(info, cfg.dist.timeout_s)
        logging.getLogger("mingpt.node").info(
            "%s joined: %d process(es) here, global ranks from %d, world size %d, torchrun restart %d",
            info.hostname, info.local_world_size, info.rank, info.world_size, info.restart_count)
        preflight(cfg, info)
        trainer = assemble(cfg, info, preempt)
        if trainer.train():
            return 0
        return distributed.EXIT_INTERRUPTED if preempt.interrupted else distributed.EXIT_PREEMPTED
    except USER_ERRORS as e:
        return distributed.report_error(info, str(e), code=2, let_rank0_report=True)
    except Exception as e:  # noqa: BLE001 - every other failure: one report, an error file, a non-zero exit
        if distributed.is_peer_failure(e):
            return distributed.report_error(
                info, f"lost contact with a peer ({distributed.first_line(e)[:300]}); exiting so that torchrun restarts the workers "
                "from the latest snapshot", code=1, each_node=True, level=logging.WARNING)
        return distributed.report_error(info, f"{e.__class__.__name__}: {e}", code=1,
                                        detail=traceback.format_exc(), each_node=True)
    finally:
        if trainer is not None:
            trainer.close()  # the objects themselves live on until the process exits
        distributed.shutdown()


@record
def main() -> None:
    register()
    code = 0
    overrides = sys.argv[1:]
    if not any(a.startswith("-") for a in overrides):  # Hydra's own flags (--cfg, --help, -m) go to Hydra
        # Compose once before Hydra does, so that a mistyped override is one line from rank 0
        # (and torchrun's error file) rather than Hydra's message from every rank.
        try:
            compose(overrides)
        except ConfigError as e:
            info = DistInfo.from_env(cuda=False)
            setup_logging(info)
            sys.exit(distributed.report_error(info, str(e), code=2, let_rank0_report=True))

    @hydra.main(config_path=config_dir(), config_name="config", version_base="1.3")
    def _hydra_entry(dcfg: DictConfig) -> None:
        nonlocal code
        code = train_process(dcfg)

    _hydra_entry()
    distributed.exit_process(code, had_process_group=DistInfo.from_env(cuda=False).distributed)


if __name__ == "__main__":
    main()
