"""The torchrun entry point, and the only place where a run's objects are assembled.

    mingpt-torchrun --standalone --nproc_per_node=2 mingpt/main.py model=gpt-micro
    python -m mingpt.main            # the same job, one process (also installed as mingpt-train)
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
from dataclasses import replace
from functools import partial
from pathlib import Path

from mingpt.runtime.orphan import die_with_agent, quiet_ctrl_c_while_starting

die_with_agent()  # first: a worker whose agent dies must die with it
if __name__ in ("__main__", "__mp_main__"):  # run, not imported (a spawned pool's process re-runs it too)
    quiet_ctrl_c_while_starting()  # a Ctrl-C during the imports: one line, not a traceback a worker
import hydra
import numpy as np
import torch
from omegaconf import OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from mingpt.config.compose import compose, config_dir, dashed_settings, from_dict, register, summary
from mingpt.config.schema import ConfigError, RunConfig
from mingpt.data import Corpus, DataError, build_samplers, load_corpus
from mingpt.data.samplers import validation_batches
from mingpt.model.gpt import GPT
from mingpt.model.pretrained import PretrainedError, load_into, read_config
from mingpt.model.tokenizer import TokenizerError
from mingpt.parallel.layouts import Parallel, ParallelError, parallelize
from mingpt.replicas import ReplicaError, ReplicaExit
from mingpt.report import goodput
from mingpt.runtime import distributed
from mingpt.runtime.console import setup_logging
from mingpt.runtime.distributed import DistInfo
from mingpt.runtime.exits import Exit, PreemptionFlag, exit_process, report_error
from mingpt.runtime.preflight import PreflightError, run_checks
from mingpt.runtime.storage import set_umask, write_json_atomic
from mingpt.snapshot import SaveFailedError, SnapshotError
from mingpt.snapshot.lease import Lease
from mingpt.snapshot.start import MismatchError
from mingpt.training.ledger import Ledger
from mingpt.training.metrics import MetricsWriter
from mingpt.training.optim import build_optimizer, init_state
from mingpt.training.policy import SavePolicy
from mingpt.training.replica_launch import ReplicaLaunch, as_member
from mingpt.training.startup import (
    Start,
    build_snapshotter,
    load_snapshot,
    record_start,
    take_lease,
    where_to_start,
)
from mingpt.training.state import TrainData
from mingpt.training.tracking import open_tracker
from mingpt.training.trainer import Trainer

log = logging.getLogger("mingpt")

USER_ERRORS = (ConfigError, DataError, ParallelError, distributed.ProcessGroupError, distributed.SecretError,
               PreflightError, PretrainedError, ReplicaError, SnapshotError, TokenizerError)


def assemble(cfg: RunConfig, info: DistInfo, preempt: PreemptionFlag | None = None,
             ledger: Ledger | None = None, lease: Lease | None = None) -> Trainer:
    """Every object of the run from the typed config, continuing the snapshot it starts from (`ledger`: main()'s)."""
    ledger = ledger or Ledger()
    ledger.switch("data_load")
    launch = ReplicaLaunch(cfg, info) if cfg.replicas.enabled else None  # listening first: the others see it start
    cfg, start = where_to_start(cfg.for_world(info.world_size), info, lease)
    cfg, corpus = build_data(cfg, start, info)
    ledger.switch("model")
    parallel = build_model(cfg, info, start)
    optimizer = init_state(build_optimizer(parallel.local, cfg.optim.lr, cfg.optim.betas, cfg.optim.weight_decay,
                                           cfg.trainer.optimizer))
    metrics = build_metrics(cfg, info)
    hosts = distributed.rank_names(distributed.all_gather_objects((info.hostname, info.node, info.local_rank)))
    start = launch.stand_by(cfg, info, lease, start, ledger, preempt) if launch else start  # a spare waits its turn
    started = partial(record_start, ledger, info, start, parallel.name, hosts, cfg.replicas.group if launch else None)
    trainer = (launch.trainer(cfg, info, start, started) if launch else Trainer)(
        cfg=cfg.trainer, optim_cfg=cfg.optim, parallel=parallel, optimizer=optimizer, metrics=metrics, info=info, hosts=hosts,
        scaler=torch.amp.GradScaler(torch.device(info.device).type, enabled=cfg.trainer.precision == "fp16"), ledger=ledger,
        data=build_train_data(cfg, corpus, parallel), snapshotter=build_snapshotter(cfg, info, start, metrics, parallel, lease),
        policy=SavePolicy(cfg.snapshot.every_steps, cfg.snapshot.every_seconds, preempt or PreemptionFlag(),
                          torch.device(info.device)), meta=run_meta(cfg, info, start, corpus))
    if start.candidates and not (launch and launch.heals(cfg, start)):  # (replica groups: healed from a live peer)
        ledger.switch("restore")
        load_snapshot(cfg, trainer, start)
    if not launch:  # (replica groups: once joined, at the step healed to)
        started(metrics.write, trainer)
    return trainer


def build_metrics(cfg: RunConfig, info: DistInfo) -> MetricsWriter:
    """The run's records (rank 0 writes them), with TensorBoard and an experiment tracker if asked."""
    tracker = open_tracker(cfg.trainer.tracker, cfg.trainer.run_dir, cfg.trainer.tracker_project, cfg.to_dict(),
                           ends_with=partial(goodput.figures, cfg.trainer.run_dir))
    return MetricsWriter(cfg.trainer.run_dir, enabled=info.is_rank0, tensorboard=cfg.trainer.tensorboard, tracker=tracker)


def run_meta(cfg: RunConfig, info: DistInfo, start: Start, corpus: Corpus) -> dict:
    """What every snapshot's manifest says of the run beside its tensors."""
    return {"run_id": start.run_id, "job_id": info.job_id, "launch_id": info.launch_id, "config": cfg.to_dict(),
            "model_shape": cfg.model.shape_dict(), "tokenizer": corpus.tokenizer.state_dict(), "corpus": corpus.source}


def build_data(cfg: RunConfig, start: Start, info: DistInfo) -> tuple[RunConfig, Corpus]:
    """The corpus (tokenized with the snapshot's tokenizer when continuing one), and the config with
    the model's vocabulary and context set from it."""
    manifest = start.manifest
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
    vocab = corpus.tokenizer.vocab_size
    if cfg.model.vocab_size not in (0, vocab):
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} cannot be set: it is the tokenizer's "
                          f"({vocab}); leave it out")
    if manifest and manifest["model_shape"]["vocab_size"] != vocab:
        raise MismatchError(f"the snapshot's vocabulary has {manifest['model_shape']['vocab_size']} tokens, this "
                            f"corpus and tokenizer give {vocab}: resume with the snapshot's data, or "
                            "start a new run in its own directory: trainer.run_dir=runs/NEW")
    if info.is_rank0:
        write_json_atomic(Path(cfg.trainer.run_dir) / "tokenizer.json", corpus.tokenizer.state_dict())
    return replace(cfg, model=replace(cfg.model, vocab_size=vocab, block_size=cfg.data.block_size)), corpus


def build_model(cfg: RunConfig, info: DistInfo, start: Start) -> Parallel:
    """The GPT under its parallel strategy: built on the meta device, placed by the strategy, then
    initialised (a new run, or any replica group's process), given GPT-2's weights, or left for the
    snapshot to fill."""
    with torch.device("meta"):  # no memory and no initialisation until the strategy has placed it
        gpt = GPT(cfg.model)
    fresh = not start.candidates
    # A replica group's process is initialised even when a snapshot waits: it may heal from a peer
    # instead, and whatever goes wrong there must never spread uninitialised memory.
    seed = cfg.trainer.seed if fresh or cfg.replicas.enabled else None
    parallel = parallelize(gpt, cfg.trainer.parallel, info, seed=seed,
                           compile=cfg.trainer.compile,  # HSDP on one node only to carry on an HSDP run
                           one_node_ok=(start.manifest or {}).get("parallel") == "hsdp",
                           tensor_parallel=cfg.trainer.tensor_parallel,
                           pipeline_parallel=cfg.trainer.pipeline_parallel, schedule=cfg.trainer.pipeline_schedule,
                           micro_batches=partial(micro_batches_per_rank, cfg))
    gpt.checkpoint_activations(cfg.trainer.activation_checkpointing)
    if start.pretrained is not None and fresh:
        checkpoint_vocab = read_config(start.pretrained)["vocab_size"]
        if checkpoint_vocab != cfg.model.vocab_size:
            raise PretrainedError(f"{cfg.model.init_from} has a vocabulary of {checkpoint_vocab} tokens, the "
                                  f"tokenizer {cfg.model.vocab_size}: use GPT-2's BPE ranks")
        load_into(gpt, start.pretrained)
        log.info("initialised from %s (%s)", cfg.model.init_from, start.pretrained)
    log.info("model %s: %.2fM parameters, context %d, %s%s", cfg.model.preset or "custom", gpt.num_params() / 1e6,
             cfg.model.block_size, parallel, ", activation checkpointing" * cfg.trainer.activation_checkpointing)
    return parallel


def micro_batches_per_rank(cfg: RunConfig, data_world: int) -> int:
    """The micro-batches of one data rank in a full step (the sampler's split: samplers.split_evenly,
    LengthGroupedSampler.split)."""
    if cfg.data.kind == "stream":
        per_rank = -(-cfg.trainer.batch_size // data_world)
        return max(1, -(-per_rank // cfg.trainer.micro_batch))
    return -(-cfg.data.documents.micro_batches_per_step // data_world)


def build_train_data(cfg: RunConfig, corpus: Corpus, parallel: Parallel) -> TrainData:
    """The splits, the training sampler and this rank's validation batches (padded with empty ones
    to the same count on every rank: a sharded model runs collectives in its forward)."""
    sampler, val_sampler = build_samplers(cfg, corpus, parallel.gpt)
    rank, world = parallel.data_rank, parallel.data_world  # a tensor-parallel group reads as one rank
    val = [validation_batches(val_sampler, world, r, cfg.trainer.eval_iters) for r in range(world)]
    longest = max(map(len, val))
    return TrainData(corpus.train, corpus.val, sampler, val[rank] + [np.zeros(0, int)] * (longest - len(val[rank])), corpus)


def preflight(cfg: RunConfig, info: DistInfo) -> None:
    """The multi-node checks (code, versions, config, corpus, one snapshot store, devices), before any work."""
    _, _, seconds = run_checks(info, cfg.to_dict(), cfg.data.path, cfg.snapshot_store)
    log.info("preflight checks passed on %d rank%s in %.3f s", info.world_size,
             "" if info.world_size == 1 else "s", seconds)


def report_failure(e: Exception, info: DistInfo, trainer: Trainer | None, replicas: bool = False) -> int:
    """A lost peer (torchrun restarts the workers; `replicas`: the group's, which heal from a live
    group) or any other failure: one report, an error file."""
    if not distributed.is_peer_failure(e):
        return report_error(info, f"{e.__class__.__name__}: {e}", code=Exit.FAILED, detail=traceback.format_exc(),
                            each_node=True)
    if trainer is not None and info.rank < 2:  # where its time went up to the failure (rank 1 too, in case
        # rank 0 is the one lost); no collective can run now
        trainer.ledger.record(lambda rec: MetricsWriter.append(trainer.cfg.run_dir, rec), trainer.progress.step,
                              kind="fault", rank=info.rank, error=distributed.first_line(e)[:200])
    after = ("its torchrun restarts the group's processes, which rejoin and heal from a live group" if replicas
             else "torchrun restarts the workers from the latest snapshot")
    what = distributed.lost_peer(e, trainer.hosts if trainer is not None else [], info.rank)
    return report_error(info, f"lost contact with a peer: {what}; exiting so that {after}", code=Exit.FAILED,
                        each_node=True, level=logging.WARNING)


def start_process(cfg: RunConfig, info: DistInfo, ledger: Ledger) -> DistInfo:
    """The process's one setup (device, threads, process group), the preflight checks and the settings."""
    ledger.switch("process_group")
    threads = cfg.trainer.threads or distributed.default_threads(info.local_world_size)
    info = distributed.init(as_member(cfg, info), cfg.dist.timeout_s, threads, cfg.trainer.deterministic)
    ledger.switch("preflight")
    logging.getLogger("mingpt.node").info(
        "%s joined: %d process(es) here, global ranks from %d, world size %d, torchrun restart %d",
        info.hostname, info.local_world_size, info.rank, info.world_size, info.restart_count)
    preflight(cfg, info)
    if info.restart_count == 0:  # once per launch, on the first rank; a record per line (grep, and
        for line in summary(cfg, info.world_size):  # every line of the log starts alike)
            log.info("settings: %s", line)
    return info


def finish(finished: bool, cache, info: DistInfo) -> int:
    """The exit code of a training that returned: 0 when done (the node's snapshot cache given back),
    75 when it stopped early and saved, whatever the signal (130 means nothing was saved)."""
    if not finished:
        return Exit.PREEMPTED
    if cache is not None:
        distributed.barrier()
        cache.clear() if info.local_rank == 0 else cache.close()
    return 0


def train_process(cfg: RunConfig, info: DistInfo, ledger: Ledger) -> int:
    """The whole job of one process (`info`: its place in its torchrun); its exit code. Every error ends here, as one line."""
    set_umask(cfg.trainer.readable_by)  # first: the run's files are its user's alone unless it says otherwise
    setup_logging(info)
    # errors are reported by its place in its torchrun; a replica group's process reports its own (one may be its own: a port)
    env = replace(info, rank=0, world_size=1) if cfg.replicas.enabled else info
    preempt = PreemptionFlag(announce=info.is_rank0).install()
    trainer, lease, had_run_dir = None, None, os.path.isdir(cfg.trainer.run_dir)
    try:
        info = start_process(cfg, info, ledger)
        lease = take_lease(cfg, info)
        trainer = assemble(cfg, info, preempt, ledger, lease)
        finished = trainer.train()
        trainer.close()
        cache, trainer = trainer.snapshotter.cache, None
        return finish(finished, cache, info)
    except SaveFailedError as e:
        return report_error(env, str(e), code=Exit.SAVE_FAILED)
    except USER_ERRORS as e:
        return report_error(env, str(e), code=Exit.BAD_INPUT, let_rank0_report=True)
    except ReplicaExit as e:  # its group restarts, or a spare never took its member's place (0: the run finished)
        log.info("%s", e) if e.code == 0 else report_error(env, str(e), e.code, level=logging.WARNING)
        return e.code
    except Exception as e:  # noqa: BLE001 - every other failure: one report, an error file, a non-zero exit
        return report_failure(e, env, trainer, cfg.replicas.enabled)
    finally:
        if trainer is not None:  # an error: a save in flight cannot gather every rank's record now
            trainer.close(wait=False)
        if lease is not None:
            lease.release()
        with contextlib.suppress(OSError):  # a start that failed leaves no empty run directory behind
            if not had_run_dir and info.is_rank0:
                os.rmdir(cfg.trainer.run_dir)
        distributed.shutdown()


@record
def main() -> None:
    ledger = Ledger()  # the process's age so far (interpreter, imports) is its launch
    ledger.switch("config")
    info = DistInfo.from_env()  # its place in its torchrun, read once
    overrides = sys.argv[1:]
    if any(a.startswith("-") for a in overrides) and not dashed_settings(overrides):  # Hydra's own flags go to Hydra
        register()
        codes = []
        hydra.main(config_path=config_dir(), config_name="config", version_base="1.3")(
            lambda dcfg: codes.append(train_process(from_dict(OmegaConf.to_container(dcfg, resolve=True)),
                                                    DistInfo.from_env(), ledger)))()  # (each job a start of its own)
        exit_process(max(codes, default=0), had_process_group=info.distributed)
    try:  # composed once, here: a mistyped override is one line from rank 0 (and torchrun's error file)
        dashed_settings(overrides, refuse=True)
        cfg = compose(overrides)
    except ConfigError as e:
        setup_logging(info)
        sys.exit(report_error(info, str(e), code=Exit.BAD_INPUT, let_rank0_report=True))
    code = train_process(cfg, info, ledger)
    # replica groups keep every epoch's process group to the end (see mingpt.replicas): no interpreter shutdown
    exit_process(code, had_process_group=info.distributed or cfg.replicas.enabled)


if __name__ == "__main__":
    main()
