"""Every benchmark runs, at a tiny size, as a user runs it from a checkout (`python -m benchmarks NAME`),
and prints its figures: none can rot unnoticed again. The two that take minutes even when small,
`internode` and `soak`, are not here: test_hsdp.py asserts the traffic between nodes, and
test_s3_server.py and test_fault_tolerance.py the orphans the soak looks for."""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO, SHARED_DATA

pytestmark = pytest.mark.slow

NANO = ["model=gpt-nano", "data.block_size=32"]


def bench(*args: str, timeout: int = 300) -> str:
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"python -m benchmarks {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_throughput(corpus_file, tmp_path):
    out = bench("throughput", "--steps", "3", "--warmup", "1", "--json", *NANO, "trainer.batch_size=4",
                f"data.path={corpus_file}", f"trainer.run_dir={tmp_path}")
    figures = json.loads(out.strip().splitlines()[-1])
    assert figures["tokens_per_s"] > 0 and 0 < figures["mfu"] < 1 and figures["ms_per_step"] > 0


def test_snapshot(corpus_file):
    """On local disk only, without the layouts' comparison: the S3 rows and the uploaders' and
    layouts' comparisons are the same loops over more torchrun jobs, too long for CI."""
    out = bench("snapshot", "--shapes", "gpt-nano", "--configs", "1:ddp", "2:fsdp", "--no-s3", "--layouts", "exchange",
                "--recovery-model", "gpt-nano", "--corpus", str(corpus_file))
    rows = [line for line in out.splitlines() if line.startswith("| gpt-nano |")]
    assert len(rows) == 2 and not any("failed" in r for r in rows), out  # 1 process DDP, 2 ranks FSDP
    m = re.search(r"([\d.]+) s to the first resumed step, resumed from step (\d+), (\d+) steps lost", out)
    assert m and float(m[1]) > 0 and int(m[2]) == 20, out


def test_batching(tmp_path):
    speeches = tmp_path / "speeches.txt"
    speeches.write_text("".join(f"SPEAKER{i % 3}:\n" + "word " * (5 + (i * 37) % 120) + "\n\n" for i in range(300)))
    out = bench("batching", "--steps", "8", "--corpus", str(speeches), "model=gpt-nano", "data.block_size=64",
                "data.documents.token_budget=256", "data.documents.micro_batches_per_step=2",
                "data.documents.pool_size=8")
    assert re.search(r"^random +[\d.]+%", out, re.M) and re.search(r"^length_grouped +[\d.]+%", out, re.M), out
    assert re.search(r"length_grouped vs random: waiting [\d.]+x lower, real-token throughput [\d.]+x", out), out


def test_generate():
    out = bench("generate", "--shape", "gpt-nano", "--new-tokens", "8", "--block-size", "64")
    assert re.search(r"[\d,.]+ tokens/s", out), out


def test_plan():
    out = bench("plan", "--pieces", "2000", "--tokens", "200000", "--block-size", "64", "--token-budget", "512")
    assert "length_grouped" in out and "fixed blocks" in out, out


def test_data(tmp_path):
    out = bench("data", "--ranks-file", str(SHARED_DATA / "r50k_base.tiktoken"), "--sizes", "200KB", "--s3-sizes", "200KB",
                "--prepare-mb", "1", "--repeats", "1", "--steps", "12", "--tmp", str(tmp_path),
                "--model", "model=gpt-nano", "data.block_size=64", "trainer.batch_size=2")
    assert re.search(r"200KB .* local .* MiB", out) and re.search(r"200KB .* s3 .* MiB", out), out
    assert re.search(r"S3 / local: [\d.]+", out), out


def test_goodput(corpus_file, tmp_path):
    # one SIGKILL, tried each second from 1 s after the start until a worker exists (a job lasts longer
    # than its workers' start-up; at 5 s it had once ended before), then the job finishes: the bench's
    # whole path (faults, restarts, the account, the bitwise check) at the least time
    out = bench("goodput", "--model", "gpt-nano", "--kill-every", "1", "--max-kills", "1", "--snapshot-every", "5",
                "--steps", "40", "--corpus", str(corpus_file), "--keep", str(tmp_path), timeout=600)
    faulted = [line for line in out.splitlines() if line.startswith("| 1 s |")]
    assert len(faulted) == 1 and "bitwise equal" in faulted[0], out
    assert int(faulted[0].split("|")[3]) == 1, out  # one SIGKILL, recovered from


def survivors(corpus_file, tmp_path, *only: str) -> list[dict]:
    # 3 replica groups, one SIGKILLed once (in training: the bench waits for a step), 300 steps so that it
    # rejoins before the end (the partition and today's single torchrun are the full bench's)
    out = bench("survivors", "--model", "gpt-nano", "--steps", "300", "--kill-every", "4", "--max-kills", "1",
                "--cut-s", "0", "--kinds", "--no-restart-baseline", "--corpus", str(corpus_file), "--keep", str(tmp_path),
                *only, timeout=600)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    # each group in its own CPU share where this machine lets the bench make cgroups (root), else said so
    shares = ("cgroup v1 cpu: ", "cgroup v2 cpu: ", "none (")
    assert all(r["isolation"].startswith(shares) for r in lines), out
    faulted = lines[1]
    assert faulted["faults"] == 1 and faulted["steps_lost_per_fault"]["max"] <= 1, out
    assert faulted["rejoin_s"] is not None and faulted["survivor_gap_s"]["max"] > 0, out
    assert 0 < faulted["goodput"] <= 1, out
    return lines


def test_survivors(corpus_file, tmp_path):
    """mingpt's replica groups: the survivors go on, the weights are bitwise the fault-free run's."""
    lines = survivors(corpus_file, tmp_path, "--no-torchft")
    assert [(r["mode"], r["fault"]) for r in lines] == [("replicas", "none"), ("replicas", "SIGKILL every 4 s")], lines
    assert lines[1]["batch_goodput"] == lines[1]["goodput"], lines  # every step trained the whole global batch
    assert lines[1]["final_max_abs_diff"] == 0.0, lines  # the shares summed in order: the fault-free run's weights


@pytest.mark.long
def test_survivors_with_a_warm_spare_per_group(corpus_file, tmp_path):
    """Each group's command twice: the SIGKILL takes the member (the lock's holder), its spare takes the place."""
    lines = survivors(corpus_file, tmp_path, "--no-torchft", "--spares")
    assert [(r["mode"], r["fault"]) for r in lines] == [("replicas", "none"), ("replicas", "SIGKILL every 4 s")], lines
    assert lines[1]["final_max_abs_diff"] == 0.0, lines
    # the returning member built nothing once it took the place: no config, data or model in its rejoin
    assert not {"config", "data_load", "model"} & set(lines[1]["rejoin_parts_s"]), lines


@pytest.mark.long
def test_survivors_through_torchft(corpus_file, tmp_path):
    """The same groups through torchft's Manager."""
    lines = survivors(corpus_file, tmp_path, "--no-replicas")
    assert [(r["mode"], r["fault"]) for r in lines] == [("torchft", "none"), ("torchft", "SIGKILL every 4 s")], lines
    assert 0 < lines[1]["batch_goodput"] < lines[1]["goodput"], lines  # torchft's steps without the lost group
    # torchft trains the survivors' batches only while a group is away: near the fault-free run, not equal
    assert 0 < lines[1]["final_max_abs_diff"] < 1, lines


def test_scale():
    out = bench("scale", "--ranks", "2", "3", "--shapes", "gpt-nano")
    rows = [line for line in out.splitlines() if line.startswith("| gpt-nano |")]
    assert len(rows) == 2, out
    assert re.search(r"gpt-nano restore_collectives: [\d.,]+ \+ [-\d.,]+ \* N", out), out


def test_s3tune():
    out = bench("s3tune", "--mb", "40", "--parts", "16", "--in-flight", "4", "--reads", "64", "--gets", "4",
                "--repeats", "1")
    assert re.search(r"disk \(dd.*\): [\d,]+ MB/s", out), out
    write, read = re.search(r"\| 16 \| ([\d,]+) \| ([\d,]+) \|", out), re.search(r"\| 64 \| ([\d,]+) \|", out)
    assert write and read and all(int(v.replace(",", "")) > 0 for v in (*write.groups(), *read.groups())), out



def test_memory(corpus_file):
    """Two processes: DDP holds every weight on each; TP2 half of each split one, and half of the
    split layers' activations."""
    out = bench("memory", "--model", "gpt-nano", "--nproc", "2", "--layouts", "ddp", "tp2-ddp", "--block", "32",
                "--data", str(corpus_file), "model.n_head=2")
    rows = {r.split("|")[1].strip(): [float(x) for x in r.split("|")[2:7]] for r in out.splitlines()
            if r.startswith(("| ddp ", "| tp2-ddp "))}
    assert rows.keys() == {"ddp", "tp2-ddp"}, out
    (p1, g1, o1, a1, _), (p2, g2, o2, a2, _) = rows["ddp"], rows["tp2-ddp"]
    assert p2 < p1 and g2 < g1 and o2 < o1 and 0 < a2 < a1, out


def test_pipeline(corpus_file):
    """Two stages against DDP, FSDP and TP2 over 2 processes: each schedule's bubble is measured and set
    beside its theory, 1/3 for 2 stages and 2 micro-batches; a stage sends less than DDP's all-reduce."""
    out = bench("pipeline", "--model", "gpt-nano", "--block", "32", "--micro", "2", "--steps", "1",
                "--data", str(corpus_file), "model.n_head=2")
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]] for r in out.splitlines()
            if r.startswith("| ") and not r.startswith(("| layout", "| ---"))}
    assert rows.keys() == {"ddp", "fsdp", "tp2", "pp2 gpipe", "pp2 1f1b"}, out
    for name in ("pp2 gpipe", "pp2 1f1b"):
        _, rate, _, bubble, theory, _, _, sent = rows[name]
        assert theory == "0.333" and 0 < float(bubble) < 1 and float(rate.replace(",", "")) > 0, out
        assert 0 < float(sent) < float(rows["ddp"][7]), out


def test_the_pipeline_bench_compares_sharded_stages_from_4_processes_and_skips_what_cannot_run():
    """The rows of `benchmarks pipeline --nproc 4`: pipelines of 4 stages (1F1B needs 4 micro-batches),
    and 2 stages each sharded over 2 processes by FSDP; none of 4 stages for a model of 3 blocks."""
    from benchmarks.pipeline import layouts

    names = [name for name, _, _ in layouts(4, [4], n_layer=4)]
    assert names == ["ddp", "fsdp", "tp4", "pp4 gpipe", "pp4 1f1b", "pp2 x fsdp2 1f1b", "pp2 x tp2 1f1b"], names
    sharded = dict((name, settings) for name, settings, _ in layouts(4, [4], n_layer=4))["pp2 x fsdp2 1f1b"]
    assert {"trainer.pipeline_parallel=2", "trainer.parallel=fsdp"} <= set(sharded)
    assert [name for name, _, _ in layouts(4, [4], n_layer=3)] == ["ddp", "fsdp", "tp4", "pp2 x fsdp2 1f1b",
                                                                  "pp2 x tp2 1f1b"]
    assert "pp2 x fsdp2 1f1b" not in [name for name, _, _ in layouts(2, [2], n_layer=4)]
