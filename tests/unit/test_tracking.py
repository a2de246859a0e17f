"""trainer.tracker: real short runs (python -m mingpt.main, one process) tracked by wandb in offline
mode and by a live MLflow server on loopback, each started and then resumed; a server that is down."""

import glob
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO, free_port

from mingpt.config.compose import compose
from mingpt.config.schema import ConfigError

# a few seconds of training: a log line every step, an evaluation and a snapshot every 2 steps
RUN = ["model=gpt-nano", "data.block_size=16", "trainer.batch_size=4", "trainer.log_every=1", "trainer.eval_every=2",
       "trainer.eval_iters=2", "snapshot.every_steps=2", "trainer.progress=false"]


def train(tmp_path: Path, corpus: Path, steps: int, *extra: str, env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "mingpt.main", *RUN, f"trainer.max_steps={steps}", f"data.path={corpus}",
                           f"data.cache_dir={tmp_path / 'cache'}", f"trainer.run_dir={tmp_path / 'run'}", *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on 127.0.0.1 (a free port), its store in the test's tmp dir; stopped at the end."""
    home = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1", "--backend-store-uri", f"sqlite:///{home / 'mlflow.db'}",
                             "--default-artifact-root", str(home / "artifacts")],
                            stdout=open(home / "server.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=5):
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (home / "server.log").read_text()[-3000:]
                time.sleep(0.5)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its workers: a session of their own
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # still draining its connections
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def test_an_mlflow_run_resumed_is_one_tracked_run_with_both_starts(mlflow_server, corpus_file, tmp_path):
    from mlflow.tracking import MlflowClient

    env = {"MLFLOW_TRACKING_URI": mlflow_server}
    track = ["trainer.tracker=mlflow", "trainer.tracker_project=resumed"]
    first = train(tmp_path, corpus_file, 4, *track, env=env)
    assert "settings: run" in first.stderr and "tracked by mlflow (resumed)" in first.stderr
    train(tmp_path, corpus_file, 6, *track, env=env)  # the same command further: a resume from step 4
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("resumed")
    runs = client.search_runs([experiment.experiment_id])
    run_id = json.loads((tmp_path / "run" / "tracker.json").read_text())["mlflow"]
    assert [r.info.run_id for r in runs] == [run_id]  # one tracked run for both starts
    run = client.get_run(run_id)
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    params = run.data.params  # the resolved config, once: as the first start had it
    assert params["trainer.max_steps"] == "4" and params["model.preset"] == "gpt-nano"
    assert params["trainer.tracker"] == "mlflow" and params["data.block_size"] == "16"

    def history(key: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))

    assert {s for s, _ in history("train/loss")} == {1, 2, 3, 4, 5, 6}
    assert all(v > 0 for _, v in history("train/loss") + history("train/tokens_per_s"))
    assert [s for s, _ in history("eval/val_loss")] == [2, 4, 6]
    assert [v for _, v in history("snapshot/step")] == [2, 4, 6]
    goodput = history("goodput/goodput")  # at the end of each start, over the job so far
    assert [s for s, _ in goodput] == [4, 6] and all(0 < v <= 1 for _, v in goodput)
    assert [s for s, _ in history("goodput/wall_s")] == [4, 6]


def wandb_records(path: str):
    """The records of a wandb offline file (run-ID.wandb): a 7-byte header, then LevelDB-log records in
    32 KiB blocks (crc, length, type; a record may span blocks), each a wandb Record protobuf."""
    from wandb.proto import wandb_internal_pb2

    data, pos, part = Path(path).read_bytes(), 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last part of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            part = b""
            yield record


def items(updates) -> dict:
    return {u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in updates}


def test_a_wandb_offline_run_resumed_continues_the_same_run_id(corpus_file, tmp_path):
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path / "wandb"),
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
           "WANDB_DATA_DIR": str(tmp_path / "wandb-data")}
    track = ["trainer.tracker=wandb", "trainer.tracker_project=offline"]
    train(tmp_path, corpus_file, 4, *track, env=env)
    train(tmp_path, corpus_file, 6, *track, env=env)
    run_id = json.loads((tmp_path / "run" / "tracker.json").read_text())["wandb"]
    starts = sorted(glob.glob(str(tmp_path / "wandb" / "wandb" / "offline-run-*")))
    assert [re.sub(r".*-", "", s) for s in starts] == [run_id, run_id]  # two starts' files, one run to sync
    steps, configs, summaries = [], [], []
    for start in starts:
        records = list(wandb_records(f"{start}/run-{run_id}.wandb"))
        runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        assert [r.run_id for r in runs] == [run_id] and runs[0].project == "offline"
        configs.append(items(runs[0].config.update))
        history = [items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
        steps.append(sorted({h["step"] for h in history if "train/loss" in h}))
        assert {h["step"] for h in history if "eval/val_loss" in h} == {2, 4, 6} & set(steps[-1])
        assert {h["snapshot/step"] for h in history if "snapshot/step" in h} == {2, 4, 6} & set(steps[-1])
        summaries.append({k: v for r in records if r.WhichOneof("record_type") == "summary"
                          for k, v in items(r.summary.update).items()})
    assert steps == [[1, 2, 3, 4], [5, 6]]
    assert configs[0]["trainer"]["max_steps"] == 4 and configs[0]["model"]["preset"] == "gpt-nano"
    assert "trainer" not in configs[1]  # the config went in once, with the new run
    assert all(0 < s["goodput/goodput"] <= 1 and s["goodput/wall_s"] > 0 for s in summaries)


def test_a_tracker_whose_server_is_down_is_one_warning_and_the_run_finishes(corpus_file, tmp_path):
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    # its client still retries (twice, our default), without the 2 s backoff between the tries
    proc = train(tmp_path, corpus_file, 3, "trainer.tracker=mlflow",
                 env={"MLFLOW_TRACKING_URI": closed, "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0"})
    warnings = [line for line in proc.stderr.splitlines() if " WARNING " in line]  # its HTTP client's retries: none
    assert len(warnings) == 1 and "mlflow tracker" in warnings[0], proc.stderr[-3000:]
    assert "opening the tracked run failed" in warnings[0] and "the run goes on" in warnings[0]
    assert "Traceback" not in proc.stderr and "finished: step 3" in proc.stderr


def test_a_tracker_must_be_known():
    """(Installed: tests/unit/test_config.py checks every optional extra, the trackers' too.)"""
    assert compose(["trainer.tracker=mlflow"]).trainer.tracker == "mlflow"
    with pytest.raises(ConfigError, match="trainer.tracker='comet': use none, wandb or mlflow"):
        compose(["trainer.tracker=comet"])
