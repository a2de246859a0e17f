"""The Hydra entry point, and the only place where the run's objects are assembled.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 mingpt/main.py trainer.max_steps=200 model=gpt-micro
    python -m mingpt.main
"""

from __future__ import annotations

import json
import logging
import sys
import time
import traceback
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from mingpt import distributed as D
from mingpt.compose import compose, config_dir
from mingpt.config import ConfigError, RunConfig, SnapshotConfig, from_dict
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


def setup_logging(info: D.DistInfo) -> None:
    """One format naming host, local rank and current rank; INFO from the first rank only, plus
    one line from the first process of every other node (that it joined)."""
    fmt = (f"%(asctime)s {info.hostname}:{info.local_rank} [rank {info.rank}/{info.world_size}] "
           "%(levelname)s %(name)s: %(message)s")
    logging.basicConfig(level=logging.INFO if info.is_first else logging.WARNING, format=fmt,
                        datefmt="%H:%M:%S", stream=sys.stderr, force=True)
    if info.local_rank == 0:
        logging.getLogger("mingpt.node").setLevel(logging.INFO)


class MismatchError(SnapshotError):
    pass


# Where each shape field is set: the advice in a mismatch names the key to change.
_SHAPE_KEYS = {"n_layer": "model.n_layer", "n_head": "model.n_head", "n_embd": "model.n_embd",
               "block_size": "data.block_size", "bias": "model.bias"}


def check_compatible(cfg: RunConfig, manifest: dict) -> None:
    """Refuse a snapshot of another model shape or tokenizer (before any data is read); log the
    other config changes."""
    saved_shape = manifest["model_shape"]
    current = replace(cfg.model, block_size=cfg.data.block_size).shape_dict()
    diff = [f"{key}: snapshot {saved_shape.get(k)!r} vs config {current[k]!r}" for k, key in _SHAPE_KEYS.items()
            if saved_shape.get(k) != current[k]]
    saved_tok = manifest.get("tokenizer", {}).get("kind")
    if saved_tok != cfg.data.tokenizer.kind:
        diff.append(f"data.tokenizer.kind: snapshot {saved_tok!r} vs config {cfg.data.tokenizer.kind!r}")
    if diff:
        raise MismatchError(
            "the snapshot to resume has another model shape or tokenizer (" + "; ".join(diff) + "). Use the "
            "snapshot's settings to continue it, or start a new run in its own directory: trainer.run_dir=runs/NEW"
        )
    # Compare as JSON sees them, so that a tuple and the list it was saved as are equal.
    old, now = manifest["config"], json.loads(json.dumps(cfg.to_dict()))
    for section in ("data", "optim", "trainer"):
        for k, v in now[section].items():
            if old.get(section, {}).get(k) != v and not isinstance(v, dict):
                log.info("config changed since the snapshot: %s.%s %r -> %r", section, k,
                         old.get(section, {}).get(k), v)


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def choose_start(store: SnapshotStore, scfg: SnapshotConfig, job_id: str | None):
    """(state, manifest, run id, other run's snapshots) this start continues from; a fresh run has
    no state.

    Two runs never share a store: starting afresh (resume=never) or from an explicit snapshot in a
    store that holds other snapshots is refused, unless `move_aside` allows moving them aside.
    A restart of the same torchrun job (same rendezvous id) always resumes its own newest
    snapshot, whatever `resume` says: torchrun restarts workers with the same arguments.
    """
    resume = scfg.resume
    committed = [s for s in store.list() if s.committed]
    if resume != "latest" and committed and job_id:
        try:
            newest = store.read_manifest(committed[-1].path)
        except Exception:  # noqa: BLE001 - an unreadable manifest is no snapshot of this job
            newest = {}
        if newest.get("job_id") == job_id:
            log.info("this job (rendezvous id %s) saved step %d already: resuming from its own newest snapshot",
                     job_id, newest["step"])
            resume = "latest"
    if resume == "latest":
        found = store.load_latest()
        if found is None:
            return None, None, new_run_id(), []
        return found[0], found[1], found[1].get("run_id") or new_run_id(), []
    if resume == "never":
        state, manifest, run_id, start_step = None, None, new_run_id(), 0
        what = "snapshot.resume=never starts a new run"
    else:
        state, manifest = load_snapshot_path(resume, store)
        run_id, start_step = manifest.get("run_id") or new_run_id(), manifest["step"]
        what = f"resuming from {resume} (step {start_step}) would mix them with this run's"
    others = [s for s in committed if s.step > start_step or resume == "never"
              or store.run_id_of(s) not in (run_id, None)]
    if others and not scfg.move_aside:
        elsewhere = ("trainer.run_dir=runs/NEW" if scfg.dir is None
                     else "a new snapshot.dir and trainer.run_dir=runs/NEW")
        raise SnapshotError(
            f"snapshot store {store.url} holds snapshots of another run ({_steps(others)}); {what}. Give this run "
            f"its own directory ({elsewhere}), or add snapshot.move_aside=true to move them aside (nothing is deleted)")
    return state, manifest, run_id, others


def set_aside(store: SnapshotStore, others: list, run_dir: Path, job_id: str | None, fresh: bool) -> None:
    """Move another run's snapshots (`others`) and metrics out of the way, saying where to."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved = [store.move_aside(others, stamp)] if others else []
    foreign_metrics = MetricsWriter.existing(run_dir, job_id) if fresh else None
    if others or foreign_metrics:  # metrics describe the run whose snapshots moved, or an earlier one
        moved += MetricsWriter.move_aside(run_dir, stamp)
    if moved:
        log.warning("moved an earlier run's files aside (nothing deleted): %s", ", ".join(moved))


def _steps(snaps) -> str:
    steps = [s.step for s in snaps]
    return f"step {steps[0]}" if len(steps) == 1 else f"{len(steps)} snapshots, steps {steps[0]}-{steps[-1]}"


def load_snapshot_path(path: str, store: SnapshotStore) -> tuple[dict, dict]:
    """One snapshot named by its folder (local or s3://), in this store or another."""
    path = path.rstrip("/")
    parent, _, name = path.rpartition("/")
    other = SnapshotStore(parent or ".", store.storage_options)
    return other.load(f"{other.root}/{name}")


@dataclass
class Run:
    trainer: Trainer
    metrics: MetricsWriter
    snapshotter: Snapshotter

    def close(self) -> None:
        self.trainer.close()
        self.snapshotter.close()  # waits for the last save
        self.metrics.close()


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


def assemble(cfg: RunConfig, info: D.DistInfo, preempt: D.PreemptionFlag | None = None) -> Run:
    """Build every object of the run from the typed config; resume if a snapshot exists."""
    tcfg = cfg.trainer
    torch.set_num_threads(tcfg.threads or D.default_threads(info.local_world_size))
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    run_dir = Path(tcfg.run_dir)
    store = open_store(cfg.snapshot.dir or str(run_dir / "snapshots"), cfg.snapshot.endpoint_url)
    # The first rank decides; every rank gets the same start. Nothing is moved before the
    # snapshot to continue is known to fit this config.
    state, manifest, run_id, others = D.on_first_rank(lambda: choose_start(store, cfg.snapshot, info.job_id))
    if manifest:
        check_compatible(cfg, manifest)
    if info.is_first:
        set_aside(store, others, run_dir, info.job_id, fresh=state is None)

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
    model_cfg = replace(cfg.model, vocab_size=corpus.tokenizer.vocab_size, block_size=d.block_size)
    cfg = replace(cfg, model=model_cfg)
    if manifest and manifest["model_shape"]["vocab_size"] != model_cfg.vocab_size:
        raise MismatchError(f"the snapshot's vocabulary has {manifest['model_shape']['vocab_size']} tokens, this "
                            f"corpus and tokenizer give {model_cfg.vocab_size}: resume with the snapshot's data, or "
                            "start a new run in its own directory: trainer.run_dir=runs/NEW")

    torch.manual_seed(tcfg.seed)  # same initial weights on every rank
    raw = GPT(model_cfg).to(info.device)
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
    run_meta = {"run_id": run_id, "job_id": info.job_id, "config": cfg.to_dict(), "model_shape": model_cfg.shape_dict(),
                "tokenizer": corpus.tokenizer.state_dict(), "corpus": corpus.source}
    if info.is_first:
        write_json_atomic(run_dir / "tokenizer.json", corpus.tokenizer.state_dict())
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
    metrics.write({"kind": "start", "run_id": run_id, "job_id": info.job_id, "step": trainer.step,
                   "world_size": info.world_size, "restart": info.restart_count})
    return Run(trainer, metrics, snapshotter)


def run(dcfg: DictConfig) -> int:
    """The whole job of one process; returns its exit code. Every error ends here, as one line."""
    D.die_with_parent()
    info = D.DistInfo.from_env()
    setup_logging(info)
    preempt = D.PreemptionFlag(announce=info.is_first).install()
    run_obj = None
    try:
        cfg = from_dict(OmegaConf.to_container(dcfg, resolve=True))
        D.init(info, cfg.dist.timeout_s)
        logging.getLogger("mingpt.node").info(
            "%s joined: %d process(es) here, global ranks from %d, world size %d, torchrun restart %d",
            info.hostname, info.local_world_size, info.rank, info.world_size, info.restart_count)
        run_obj = assemble(cfg, info, preempt)
        if run_obj.trainer.train():
            return 0
        return D.EXIT_INTERRUPTED if preempt.interrupted else D.EXIT_PREEMPTED
    except USER_ERRORS as e:
        return D.report_error(info, str(e), code=2)
    except Exception as e:  # noqa: BLE001 - every other failure: one report, an error file, a non-zero exit
        if D.is_peer_failure(e):
            first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
            return D.report_error(info, f"lost contact with a peer ({first[:300]}); exiting so that torchrun "
                                  "restarts the workers from the latest snapshot", code=1, each_node=True,
                                  level=logging.WARNING)
        return D.report_error(info, f"{e.__class__.__name__}: {e}", code=1, detail=traceback.format_exc(),
                              each_node=True)
    finally:
        if run_obj is not None:
            run_obj.close()  # the objects themselves live on until the process exits
        D.shutdown()


@record
def main() -> None:
    code = 0
    overrides = sys.argv[1:]
    if not any(a.startswith("-") for a in overrides):  # Hydra's own flags (--cfg, --help, -m) go to Hydra
        # Compose once before Hydra does, so that a mistyped override is one line from the first
        # rank (and torchrun's error file) rather than Hydra's message from every rank.
        try:
            compose(overrides)
        except ConfigError as e:
            info = D.DistInfo.from_env(cuda=False)
            setup_logging(info)
            sys.exit(D.report_error(info, str(e), code=2))

    @hydra.main(config_path=config_dir(), config_name="config", version_base="1.3")
    def _hydra_entry(dcfg: DictConfig) -> None:
        nonlocal code
        code = run(dcfg)

    _hydra_entry()
    D.exit_process(code, had_process_group=D.DistInfo.from_env(cuda=False).distributed)


if __name__ == "__main__":
    main()
