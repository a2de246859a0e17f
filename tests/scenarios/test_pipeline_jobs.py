"""Pipeline parallelism under real torchrun jobs (gloo on CPU): gradients against one process, the tied
matrix kept tied, snapshots across layouts, refusals."""

import subprocess
import sys

import pytest
import torch
from conftest import REPO, make_corpus, torchrun_cmd, torchrun_env

from mingpt.snapshot import SnapshotStore
from mingpt.snapshot.restore import read_whole

pytestmark = pytest.mark.slow

# 4 blocks: pipelines of 2 and 4 stages; 4 heads
TINY = ["model=custom", "model.n_layer=4", "model.n_head=4", "model.n_embd=32", "data.block_size=32",
        "optim.warmup_steps=5", "trainer.log_every=5", "trainer.progress=false"]


def run(cmd, timeout=240, code=0) -> str:
    proc = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == code, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout + proc.stderr


def stage_files(out, nproc: int) -> list[dict]:
    return [torch.load(f"{out}.{r}") for r in range(nproc)]


@pytest.fixture(scope="module")
def one_process_grads(tmp_path_factory):
    """One process's gradients after one step of 6 sequences in micro-batches of 2, and its corpus."""
    tmp = tmp_path_factory.mktemp("one")
    corpus_file = make_corpus(tmp)
    run([sys.executable, "tests/scenarios/grad_worker.py", str(tmp / "g.pt"), *TINY, f"data.path={corpus_file}",
         f"data.cache_dir={tmp / 'cache'}", "trainer.batch_size=6", "trainer.micro_batch_size=2",
         "snapshot.resume=never", f"trainer.run_dir={tmp / 'run'}"])
    return torch.load(tmp / "g.pt"), corpus_file


# CI: gpipe over two data ranks, and interleaved stages sharded and split; the rest -m long (1F1B's
# gradients: test_documents_through_a_pipeline_..., which trains as one process does)
@pytest.mark.parametrize("nproc, stages, schedule, data, tp", [
    pytest.param(2, 2, "1f1b", "ddp", 1, marks=pytest.mark.long), (4, 2, "gpipe", "ddp", 1),
    pytest.param(2, 2, "interleaved", "ddp", 1, marks=pytest.mark.long),
    pytest.param(4, 2, "interleaved", "fsdp", 1, marks=pytest.mark.long),
    pytest.param(4, 2, "1f1b", "ddp", 2, marks=pytest.mark.long), (8, 2, "interleaved", "fsdp", 2)],
    ids=["pp2-1f1b", "pp2-ddp2-gpipe", "pp2-interleaved", "pp2-fsdp2-interleaved", "pp2-tp2-1f1b",
         "pp2-fsdp2-tp2-interleaved"])
def test_pipeline_gradients_equal_one_process_and_the_tied_matrix_stays_tied(tmp_path, one_process_grads, nproc,
                                                                             stages, schedule, data, tp):
    """One step (6 sequences, micro-batches of 2: 3 micro-batches, over 2 data ranks uneven; interleaved:
    4 stages of one block, two on each process; fsdp: each stage's parts sharded over its 2 processes,
    their gradients reduce-scattered), clipped:
    every gradient, from the stage that holds it, equals one process's within float32 rounding
    (rtol 1e-4, atol 1e-6, as for DDP against one process: the tied matrix's two parts are added in
    another order, the norm is summed by stage). The tied matrix: its gradient and its updated
    values are bitwise the same on the first and the last stage."""
    one, corpus_file = one_process_grads
    out = tmp_path / "g.pt"
    log = run(torchrun_cmd(nproc, "tests/scenarios/grad_worker.py", str(out), *TINY, f"data.path={corpus_file}",
                           f"data.cache_dir={tmp_path / 'cache'}", "trainer.batch_size=6", "trainer.micro_batch_size=2",
                           "snapshot.resume=never", f"trainer.pipeline_parallel={stages}",
                           f"trainer.pipeline_schedule={schedule}", f"trainer.parallel={data}",
                           f"trainer.tensor_parallel={tp}", f"trainer.run_dir={tmp_path / 'run'}",
                           f"trainer.activation_checkpointing={schedule == 'interleaved'}"))
    assert f"{data}{f' x tensor parallel {tp}' * (tp > 1)} x pipeline {stages} ({schedule})" in log
    assert (schedule == "interleaved") == ("activation checkpointing" in log)  # (against one process without)
    ranks = stage_files(out, nproc)
    first = assert_one_process_grads(ranks, one, stages)
    for r in ranks[1:nproc // stages]:  # data-parallel copies of stage 0 hold the same gradients (FSDP's gathered)
        assert torch.equal(r["wte.weight"], first["wte.weight"])
    assert max(g.abs().max().item() for g in one.values()) > 1e-3  # real, non-zero gradients


def assert_one_process_grads(ranks: list[dict], one: dict, stages: int) -> dict:
    """Every gradient, from the stage that holds it, equals one process's within float32 rounding; the
    tied matrix's gradient and updated weights are bitwise the same on the first and the last stage.
    The first process's tensors."""
    first, last = ranks[0], ranks[(stages - 1) * (len(ranks) // stages)]
    assert torch.equal(first["wte.weight"], last["wte.weight"])  # the gradients of the two copies, summed
    assert torch.equal(first["param.wte.weight"], last["param.wte.weight"])  # and the weights after the step
    mine = {}
    for r in ranks:
        mine |= {k: v for k, v in r.items() if not k.startswith("param.")}
    assert mine.keys() == one.keys()
    for name in one:
        torch.testing.assert_close(mine[name], one[name], rtol=1e-4, atol=1e-6, msg=name)
    return first


def held_state(out, nproc: int) -> dict:
    """The union of what every process of a pipeline holds (the tied copies equal: checked)."""
    merged = {}
    for r in stage_files(out, nproc):
        for k, v in r.items():
            if k in merged:
                assert torch.equal(merged[k], v), k
            merged[k] = v
    return merged


@pytest.mark.long  # (CI: a pipeline's snapshot both ways in test_documents_through_a_pipeline_...; every
# layout from one writer in test_tp_jobs)
def test_a_pipeline_snapshot_loads_bitwise_under_every_layout_and_back(tmp_path):
    """Written by a pipeline of 2 stages x 2 data ranks (each stage's processes write its tensors),
    the snapshot holds the whole tensors once: one process (as DDP: every tensor whole), FSDP over 2,
    tensor parallelism over 2, a pipeline of 4 stages (a world the 4 processes of 2 x 2 fit again),
    the same pipeline with each stage sharded over its 2 processes by FSDP, and with each stage's
    blocks split over its 2 processes by tensor parallelism start from exactly the stored weights
    and optimizer state. (A snapshot of one process into a pipeline:
    test_documents_through_a_pipeline_...; one written by a pipeline of FSDP stages:
    test_fault_tolerance.py::test_a_split_model_sigkill_recovery_is_exact_too)"""
    corpus_file = make_corpus(tmp_path)
    data = [*TINY, f"data.path={corpus_file}", f"data.cache_dir={tmp_path / 'cache'}", "trainer.batch_size=8",
            "trainer.micro_batch_size=2", f"trainer.run_dir={tmp_path / 'run'}"]
    run(torchrun_cmd(4, "mingpt/main.py", *data, "trainer.max_steps=4", "snapshot.every_steps=4",
                     "trainer.pipeline_parallel=2"))
    store = SnapshotStore(str(tmp_path / "run" / "snapshots"))
    state, manifest = read_whole(store, store.list()[-1].path)
    assert manifest["step"] == 4 and manifest["stages"] == 2 and manifest["format_version"] == 4
    shown = run([sys.executable, "-m", "mingpt.cli.snapshot", "show", str(tmp_path / "run")])
    assert "by 4 rank(s) (ddp x pipeline 2), 4 writer(s), format 4" in shown, shown  # the layout said whole
    stored = {f"model.{k}": v for k, v in state["model"].items() if k != "lm_head.weight"}  # tied to wte
    stored |= {f"optim.{p}.{k}": v for p, moments in state["optimizer"].items() for k, v in moments.items()}
    tensor_bytes = sum(v.numel() * v.element_size() for v in stored.values())  # every byte written once
    assert sum(f["size"] for name, f in manifest["files"].items() if name.startswith("shard-")) == tensor_bytes
    for nproc, layout in [(1, []), (2, ["trainer.parallel=fsdp"]), (2, ["trainer.tensor_parallel=2"])]:
        out = tmp_path / f"{nproc}-{layout}.pt"
        cmd = ["tests/scenarios/grad_worker.py", str(out), "--state", *data, *layout]
        run([sys.executable, *cmd] if nproc == 1 else torchrun_cmd(nproc, *cmd))
        loaded = torch.load(out)  # whole tensors (FSDP's and TP's gathered)
        assert loaded.keys() == stored.keys(), (nproc, layout)
        for name, t in stored.items():
            assert torch.equal(loaded[name], t), (nproc, layout, name)
    for name, layout in [("pp4", ["trainer.pipeline_parallel=4"]),  # another degree
                         ("pp2-fsdp2", ["trainer.pipeline_parallel=2", "trainer.parallel=fsdp"]),  # sharded stages
                         ("pp2-tp2", ["trainer.pipeline_parallel=2", "trainer.tensor_parallel=2"])]:  # split blocks
        out = tmp_path / f"{name}.pt"
        run(torchrun_cmd(4, "tests/scenarios/grad_worker.py", str(out), "--state", *data, *layout))
        assert_same(held_state(out, 4), stored)


def stored_state(run_dir) -> dict:
    """The newest snapshot's tensors by the names slots give them (the tied head is the embedding)."""
    store = SnapshotStore(str(run_dir / "snapshots"))
    state, _ = read_whole(store, store.list()[-1].path)
    out = {f"model.{k}": v for k, v in state["model"].items() if k != "lm_head.weight"}
    return out | {f"optim.{p}.{k}": v for p, moments in state["optimizer"].items() for k, v in moments.items()}


def assert_same(loaded: dict, stored: dict) -> None:
    assert loaded.keys() == stored.keys()
    for name, t in stored.items():
        assert torch.equal(loaded[name], t), name


@pytest.mark.parametrize("nproc, layout, said", [
    (2, ["trainer.pipeline_parallel=2"], "ddp x pipeline 2"),
    pytest.param(4, ["trainer.pipeline_parallel=2", "trainer.tensor_parallel=2"], "ddp x tensor parallel 2 x pipeline 2",
                 marks=pytest.mark.long)],  # (CI: split blocks in stages above, pp2-fsdp2-tp2-interleaved)
    ids=["pp2", "pp2-tp2"])
def test_documents_through_a_pipeline_train_and_evaluate_as_one_process_and_snapshots_go_both_ways(tmp_path, nproc,
                                                                                                 layout, said):
    """Length-grouped document batches (3 micro-batches a step of varying B and T, so the stages meet a
    new shape at most steps) through 2 stages: the loss curve of 4 steps and the validation loss (the
    activations sent through the stages, the loss back to every stage) are one process's, to float32
    rounding (each step's micro-batches are padded to one shape; the padding counts nothing). The
    pipeline's snapshot samples text with mingpt-generate (one process), and one process's snapshot
    loads into a pipeline of 2 stages bitwise. Under tensor parallelism inside the stages (pp2-tp2)
    each stage's 2 processes split its blocks and the stream between the stages by tokens (a
    sequence of odd length padded at its end)."""
    from conftest import make_docs_corpus, read_metrics

    corpus = make_docs_corpus(tmp_path)
    args = [*TINY, f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}", "data=shakespeare_speeches",
            "data.block_size=32", "data.documents.token_budget=128", "data.documents.micro_batches_per_step=3",
            "trainer.max_steps=4", "trainer.log_every=1", "trainer.eval_every=4", "trainer.eval_iters=2"]
    run([sys.executable, "mingpt/main.py", *args, f"trainer.run_dir={tmp_path / 'one'}"])
    log = run(torchrun_cmd(nproc, "mingpt/main.py", *args, *layout, f"trainer.run_dir={tmp_path / 'pp'}"))
    assert "length_grouped batching" in log
    for kind, key in [("train", "loss"), ("eval", "val_loss")]:
        one = read_metrics(tmp_path / "one" / "metrics.jsonl", kind)
        pp = read_metrics(tmp_path / "pp" / "metrics.jsonl", kind)
        assert sorted(one) == sorted(pp) == ([1, 2, 3, 4] if kind == "train" else [4])
        for step in one:
            assert pp[step][key] == pytest.approx(one[step][key], rel=1e-5), (kind, step)
    out = run([sys.executable, "-m", "mingpt.cli.generate", str(tmp_path / "pp"), "--max-new-tokens", "20",
               "--temperature", "0"])
    assert len(out.strip()) >= 20, out
    out = tmp_path / "into-pp.pt"
    log = run(torchrun_cmd(nproc, "tests/scenarios/grad_worker.py", str(out), "--state", *args,
                           f"trainer.run_dir={tmp_path / 'one'}", *layout))
    assert_same(held_state(out, nproc), stored_state(tmp_path / "one"))
    assert f"(saved by 1 rank with single, now {nproc} with {said};" in log, log[-3000:]  # the resume line names it


@pytest.mark.long  # (CI: HSDP in test_hsdp, sharded pipeline stages above)
def test_hsdp_inside_the_stages_of_a_pipeline_over_four_nodes(tmp_path, one_process_grads):
    """Four nodes (network namespaces on one bridge) of 2 processes, a pipeline of 2 stages: each stage
    holds 2 whole nodes, its parts sharded within a node and replicated across its two (HSDP), only
    activations crossing between the stages. One step's gradients equal one process's (rtol 1e-4,
    atol 1e-6), the tied matrix's copies on the first and last stage bitwise equal. Then 4 steps
    with a snapshot: the 8 processes write every byte of it once (each stage's tensors cut among its
    2 shards x 2 copies), and it reads back whole."""
    from conftest import free_port

    from benchmarks.netns import NoNamespaces, agent_cmd, bridged_nodes

    one, corpus_file = one_process_grads
    out = tmp_path / "g.pt"
    data = [*TINY, f"data.path={corpus_file}", f"data.cache_dir={tmp_path / 'cache'}", "trainer.batch_size=6",
            "trainer.micro_batch_size=2", "trainer.pipeline_parallel=2", "trainer.pipeline_schedule=gpipe",
            "trainer.parallel=hsdp", f"trainer.run_dir={tmp_path / 'run'}"]

    def on_four_nodes(nodes, name: str, *args: str) -> str:
        port, procs = free_port(), []
        try:
            for i, node in enumerate(nodes):
                procs.append(subprocess.Popen(
                    agent_cmd(node, nodes[0], port, 2, *args, nnodes="4", max_restarts=0, run_id=f"pp{name}{port}"),
                    cwd=REPO, env=torchrun_env(GLOO_SOCKET_IFNAME=node.veth),
                    stdout=open(tmp_path / f"{name}{i}.log", "w"), stderr=subprocess.STDOUT))
            for p in procs:
                assert p.wait(timeout=240) == 0, (tmp_path / f"{name}0.log").read_text()[-4000:]
        finally:
            for p in procs:
                p.kill()
        return (tmp_path / f"{name}0.log").read_text()

    try:
        with bridged_nodes(4, subnet=235) as bridge:
            log = on_four_nodes(bridge.nodes, "grad", "tests/scenarios/grad_worker.py", str(out), *data,
                                "snapshot.resume=never")
            on_four_nodes(bridge.nodes, "train", "mingpt/main.py", *data, "trainer.max_steps=4", "snapshot.every_steps=4")
    except NoNamespaces as e:
        pytest.skip(str(e))
    assert "hsdp (2 nodes x 2 processes x pipeline 2 (gpipe))" in log, log[-3000:]
    assert_one_process_grads(stage_files(out, 8), one, stages=2)
    store = SnapshotStore(str(tmp_path / "run" / "snapshots"))
    state, manifest = read_whole(store, store.list()[-1].path)
    assert manifest["step"] == 4 and manifest["stages"] == 2 and manifest["copies"] == 2
    stored = stored_state(tmp_path / "run")
    assert {k for k in stored if k.startswith("model.")} == {f"model.{k}" for k in one}  # the tied head once
    assert {k.rsplit(".", 1)[0] for k in stored if k.startswith("optim.")} == {f"optim.{k}" for k in one}
    tensor_bytes = sum(v.numel() * v.element_size() for v in stored.values())
    assert sum(f["size"] for name, f in manifest["files"].items() if name.startswith("shard-")) == tensor_bytes
