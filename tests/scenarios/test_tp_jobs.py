"""Tensor parallelism under real torchrun jobs (gloo on CPU): gradients against one process, snapshots
across layouts."""

import subprocess
import sys

import pytest
import torch
from conftest import REPO, make_corpus, torchrun_cmd, torchrun_env

from mingpt.snapshot import SnapshotStore
from mingpt.snapshot.restore import read_whole

pytestmark = pytest.mark.slow

# 4 heads: tensor-parallel degrees 1, 2 and 4 all divide them
TINY = ["model=custom", "model.n_layer=2", "model.n_head=4", "model.n_embd=32", "data.block_size=32",
        "optim.warmup_steps=5", "trainer.log_every=5", "trainer.progress=false"]


def run(cmd, timeout=240) -> str:
    proc = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def one_process_grads(tmp_path_factory):
    """One process's gradients after one step (for every layout compared with it), and its corpus."""
    tmp = tmp_path_factory.mktemp("one")
    corpus_file = make_corpus(tmp)
    run([sys.executable, "tests/scenarios/grad_worker.py", str(tmp / "g.pt"), *TINY, f"data.path={corpus_file}",
         f"data.cache_dir={tmp / 'cache'}", "trainer.batch_size=5", "trainer.micro_batch_size=2",
         "snapshot.resume=never", f"trainer.run_dir={tmp / 'run'}"])
    return torch.load(tmp / "g.pt"), corpus_file


@pytest.mark.parametrize("nproc, parallel, tp", [(2, "ddp", 2), (4, "fsdp", 2)], ids=["tp2", "tp2-fsdp2"])
def test_tensor_parallel_gradients_equal_one_process(tmp_path, one_process_grads, nproc, parallel, tp):
    """TP alone, and TP with FSDP (with HSDP across two nodes: tests/scenarios/test_hsdp.py). One
    step of 5 sequences in micro-batches of 2 (uneven over the data ranks), clipped: each
    gradient, gathered whole, equals one process's. The sums inside a split layer run in another
    order (a row-parallel layer adds its parts after an all-reduce), so equal within float32
    rounding: rtol 1e-4, atol 1e-6, as for DDP against one process."""
    one, corpus_file = one_process_grads
    log = run(torchrun_cmd(nproc, "tests/scenarios/grad_worker.py", str(tmp_path / "g.pt"), *TINY,
                           f"data.path={corpus_file}", f"data.cache_dir={tmp_path / 'cache'}", "trainer.batch_size=5",
                           "trainer.micro_batch_size=2", "snapshot.resume=never", f"trainer.parallel={parallel}",
                           f"trainer.tensor_parallel={tp}", f"trainer.run_dir={tmp_path / 'run'}"))
    assert f"{parallel} x tensor parallel {tp}" in log
    mine = torch.load(tmp_path / "g.pt")
    assert mine.keys() == one.keys()
    for name in one:
        torch.testing.assert_close(mine[name], one[name], rtol=1e-4, atol=1e-6, msg=name)
    assert max(g.abs().max().item() for g in one.values()) > 1e-3  # real, non-zero gradients


def test_a_snapshot_written_under_tp_and_fsdp_loads_bitwise_under_every_layout(corpus_file, tmp_path):
    """Written by TP2 x FSDP2 (4 processes; each tensor split by heads and by rows), the snapshot holds
    the whole tensors once, in the layout every other strategy reads: one process, FSDP over 2,
    TP4 (another degree) and TP2 x FSDP2 again (each process's rows split back out) all start from
    exactly the weights and optimizer state stored."""
    data = [*TINY, f"data.path={corpus_file}", f"data.cache_dir={tmp_path / 'cache'}", "trainer.batch_size=8",
            "trainer.micro_batch_size=2", f"trainer.run_dir={tmp_path / 'run'}"]
    run(torchrun_cmd(4, "mingpt/main.py", *data, "trainer.max_steps=4", "snapshot.every_steps=4",
                     "trainer.parallel=fsdp", "trainer.tensor_parallel=2"))
    store = SnapshotStore(str(tmp_path / "run" / "snapshots"))
    state, manifest = read_whole(store, store.list()[-1].path)
    assert manifest["step"] == 4 and manifest["world_size"] == 4
    stored = {f"model.{k}": v for k, v in state["model"].items() if k != "lm_head.weight"}  # tied to wte
    stored |= {f"optim.{p}.{k}": v for p, moments in state["optimizer"].items() for k, v in moments.items()}
    # every byte written once: the shard files hold exactly the stored tensors
    tensor_bytes = sum(v.numel() * v.element_size() for v in stored.values())
    assert sum(f["size"] for name, f in manifest["files"].items() if name.startswith("shard-")) == tensor_bytes
    for nproc, parallel, tp in [(1, "ddp", 1), (2, "fsdp", 1), (4, "ddp", 4), (4, "fsdp", 2)]:
        out = tmp_path / f"{nproc}-{parallel}-{tp}.pt"
        cmd = ["tests/scenarios/grad_worker.py", str(out), "--state", *data, f"trainer.parallel={parallel}",
               f"trainer.tensor_parallel={tp}"]
        run([sys.executable, *cmd] if nproc == 1 else torchrun_cmd(nproc, *cmd))
        loaded = torch.load(out)
        assert loaded.keys() == stored.keys(), (nproc, parallel, tp)
        for name, t in stored.items():
            assert torch.equal(loaded[name], t), (nproc, parallel, tp, name)

