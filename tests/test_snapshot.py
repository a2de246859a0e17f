import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import logging
from dataclasses import replace

from mingpt.config import DataConfig, OptimConfig, RunConfig, TokenizerConfig
from mingpt.snapshot.resume import MismatchError, check_compatible
from mingpt.model import GPTConfig
from mingpt.snapshot import SnapshotError, Snapshotter, SnapshotStore


def state(v: float) -> dict:
    return {"model": {"w": torch.full((4, 4), v)}, "trainer": {"step": int(v)}}


def test_round_trip_and_manifest(store_url):
    store = SnapshotStore(store_url)
    path = store.save(10, state(10), {"config": {"a": 1}})
    loaded, manifest = store.load(path)
    assert torch.equal(loaded["model"]["w"], torch.full((4, 4), 10.0))
    assert manifest["step"] == 10 and manifest["format_version"] == 1 and manifest["config"] == {"a": 1}
    assert manifest["files"]["state.pt"]["size"] == store.fs.size(f"{path}/state.pt")


def test_uncommitted_write_is_invisible(store_url):
    store = SnapshotStore(store_url)
    store.save(1, state(1), {})
    store.fs.makedirs(f"{store.root}/step_000000002", exist_ok=True)
    store.fs.pipe(f"{store.root}/step_000000002/state.pt", b"half a write")  # no manifest: not committed
    assert [s.step for s in store.list()] == [1, 2]
    assert [s.step for s in store.list() if s.committed] == [1]
    assert store.load_latest()[1]["step"] == 1


def test_writer_killed_mid_write_leaves_previous_snapshot_valid(store_url):
    """A real SIGKILL of a process in the middle of writing a large snapshot (a multipart upload on S3)."""
    store = SnapshotStore(store_url)
    store.save(1, state(1), {})
    code = textwrap.dedent(f"""
        import torch
        from mingpt.snapshot import SnapshotStore
        store = SnapshotStore({store_url!r}, {{"default_block_size": 5 * 2**20}} if {store_url!r}.startswith("s3") else None)
        big = {{"model": {{"w": torch.randn(64_000_000)}}}}
        print("writing", flush=True)
        store.save(2, big, {{}})
        print("done", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    time.sleep(0.5)  # 256 MB take seconds to write: this is mid-write
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert [s.step for s in store.list() if s.committed] == [1]
    assert store.load_latest()[1]["step"] == 1
    store.save(3, state(3), {})  # and the store goes on working
    assert store.load_latest()[1]["step"] == 3


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_latest_falls_back_with_warning(store_url, caplog, damage):
    store = SnapshotStore(store_url)
    store.save(1, state(1), {})
    p2 = store.save(2, state(2), {})
    f = f"{p2}/state.pt"
    data = store.fs.cat(f)
    store.fs.pipe(f, data[: len(data) // 2] if damage == "truncate" else data[:-8] + b"XXXXXXXX")
    loaded, manifest = store.load_latest()
    assert manifest["step"] == 1 and loaded["trainer"]["step"] == 1
    assert "falling back" in caplog.text


def test_all_snapshots_broken_is_an_error_not_a_fresh_start(tmp_path):
    store = SnapshotStore(str(tmp_path))
    p = store.save(1, state(1), {})
    open(f"{p}/state.pt", "wb").write(b"garbage")
    with pytest.raises(SnapshotError, match="snapshot.resume=never"):
        store.load_latest()


def test_format_version_is_checked(tmp_path):
    store = SnapshotStore(str(tmp_path))
    p = store.save(1, state(1), {})
    m = json.load(open(f"{p}/manifest.json"))
    m["format_version"] = 99
    json.dump(m, open(f"{p}/manifest.json", "w"))
    with pytest.raises(SnapshotError, match="format version 99"):
        store.load(p)


def test_retention_keeps_last_k_after_commit(store_url):
    store = SnapshotStore(store_url)
    for step in range(1, 8):
        store.save(step, state(step), {})
        store.prune(keep_last=2, keep_every=3)
    assert [s.step for s in store.list()] == [3, 6, 7]
    store.prune(keep_last=2)
    assert [s.step for s in store.list()] == [6, 7]


def test_only_the_first_rank_writes(tmp_path):
    """for rank in range(2), no process group: the Trainer's save is a no-op except on rank 0."""
    from mingpt.distributed import DistInfo
    from mingpt.training.trainer import Trainer

    written = []
    for rank in range(2):
        info = DistInfo(rank=rank, world_size=2)
        store = SnapshotStore(str(tmp_path / f"as_rank{rank}"))
        fake = Trainer.__new__(Trainer)  # only the parts save_snapshot uses
        fake.dist, fake.snapshotter = info, Snapshotter(store, keep_last=3, enabled=info.is_rank0)
        fake.state_dict = lambda: state(1)
        fake.step, fake.tokens_seen, fake.snapshot_meta = 1, 0, {}
        fake.save_snapshot()
        fake.snapshotter.close()
        written.append(bool(store.list()))
    assert written == [True, False]


def test_snapshot_of_another_model_shape_or_tokenizer_is_refused():
    def manifest_of(cfg: RunConfig, tokenizer: str = "char") -> dict:
        shape = replace(cfg.model, block_size=cfg.data.block_size).shape_dict()
        return {"config": cfg.to_dict(), "model_shape": shape, "tokenizer": {"kind": tokenizer}}

    cfg = RunConfig(model=GPTConfig(preset="gpt-micro", vocab_size=65))
    mini = RunConfig(model=GPTConfig(preset="gpt-mini", vocab_size=65))
    with pytest.raises(MismatchError, match=r"model.n_layer: snapshot 6 vs config 4.*model.n_embd: snapshot 192 vs "
                                            r"config 128.*trainer.run_dir=runs/NEW"):
        check_compatible(cfg, manifest_of(mini))
    # the context length is data.block_size, and the error names that key
    longer = RunConfig(model=GPTConfig(preset="gpt-micro", vocab_size=65), data=DataConfig(block_size=256))
    with pytest.raises(MismatchError, match=r"data.block_size: snapshot 256 vs config 128"):
        check_compatible(cfg, manifest_of(longer))
    # a char-level snapshot resumed with the BPE tokenizer is refused before any data is read
    with pytest.raises(MismatchError, match=r"data.tokenizer.kind: snapshot 'char' vs config 'bpe'"):
        check_compatible(replace(cfg, data=DataConfig(tokenizer=TokenizerConfig(kind="bpe"))), manifest_of(cfg))
    check_compatible(cfg, manifest_of(cfg))  # same shape and tokenizer: accepted


def test_config_changes_are_logged_only_when_real(caplog):
    cfg = RunConfig(model=GPTConfig(preset="gpt-micro", vocab_size=65))
    manifest = {"config": json.loads(json.dumps(cfg.to_dict())), "tokenizer": {"kind": "char"},
                "model_shape": replace(cfg.model, block_size=cfg.data.block_size).shape_dict()}
    with caplog.at_level(logging.INFO):
        check_compatible(cfg, manifest)  # betas saved as a JSON list, configured as a tuple: no change
        assert "config changed" not in caplog.text
        check_compatible(replace(cfg, optim=OptimConfig(lr=3e-4)), manifest)
    assert "config changed since the snapshot: optim.lr 0.001 -> 0.0003" in caplog.text
