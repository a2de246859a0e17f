import json

from conftest import read_metrics

from mingpt.training.metrics import MetricsWriter, read_records


def test_metrics_jsonl_last_record_wins_and_tensorboard(tmp_path):
    w = MetricsWriter(str(tmp_path), enabled=True, tensorboard=True)
    w.write({"kind": "train", "step": 10, "loss": 2.0})
    w.write({"kind": "resume", "step": 5})
    w.write({"kind": "train", "step": 10, "loss": 1.5})  # trained again after a resume
    w.write({"kind": "eval", "step": 10, "val_loss": 1.7})
    w.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == {10: read_metrics(tmp_path / "metrics.jsonl")[10]}
    assert read_metrics(tmp_path / "metrics.jsonl")[10]["loss"] == 1.5
    assert read_metrics(tmp_path / "metrics.jsonl", "eval")[10]["val_loss"] == 1.7
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_other_ranks_write_nothing(tmp_path):
    w = MetricsWriter(str(tmp_path / "r1"), enabled=False, tensorboard=True)
    w.write({"kind": "train", "step": 1, "loss": 1.0})
    w.close()
    assert not (tmp_path / "r1").exists()


def test_a_record_after_a_line_cut_short_reads_back_and_the_run_keeps_its_metrics(tmp_path):
    """A process killed mid-line: the restart's `start` must not be glued to the cut line (and lost),
    and the launch's metrics must not then be moved aside as another launch's."""
    w = MetricsWriter(str(tmp_path), enabled=True)
    w.write({"kind": "start", "step": 0, "launch_id": "launch-a"})
    w.write({"kind": "train", "step": 1, "loss": 2.0})
    w.close()
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"time": 1.0, "kind": "train", "step": 2, "lo')  # the kill
    assert MetricsWriter.existing(tmp_path, "launch-a") is None
    restart = MetricsWriter(str(tmp_path), enabled=True)
    restart.write({"kind": "start", "step": 0, "launch_id": "launch-b"})
    restart.close()
    MetricsWriter.append(tmp_path, {"kind": "fault", "step": 0})
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"time": 2.0, "kind": "train"')  # killed again
    MetricsWriter.append(tmp_path, {"kind": "fault", "step": 1})
    kinds = [(r["kind"], r.get("launch_id")) for r in read_records(tmp_path / "metrics.jsonl")]
    assert kinds == [("start", "launch-a"), ("train", None), ("start", "launch-b"), ("fault", None), ("fault", None)]
    assert MetricsWriter.existing(tmp_path, "launch-b") is None  # its own: kept
    assert MetricsWriter.existing(tmp_path, "launch-c") == str(tmp_path / "metrics.jsonl")  # another launch's


def test_read_metrics_skips_a_line_cut_short_by_a_kill(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"kind": "train", "step": s, "loss": 1.0 / s}) for s in (1, 2, 3)]
    path.write_text("\n".join(rows[:2]) + "\n" + rows[2][:17] + "\n" + json.dumps({"kind": "train", "step": 3,
                                                                                      "loss": 0.3}) + "\n")
    assert {s: r["loss"] for s, r in read_metrics(path).items()} == {1: 1.0, 2: 0.5, 3: 0.3}


def test_the_train_record_figures_mfu_and_the_slowest_rank():
    import torch

    from mingpt.config.schema import TrainerConfig
    from mingpt.runtime.distributed import DistInfo
    from mingpt.training.metrics import peak_flops, train_record

    # CPU: the peak is per machine (2 nodes of 4 processes: twice the configured figure)
    two_nodes = DistInfo(world_size=8, local_world_size=4)
    assert peak_flops(TrainerConfig(cpu_peak_flops=1e11), two_nodes, torch.device("cpu")) == 2e11
    step = {"step": 7, "tokens_seen": 7000, "tokens": 1000, "lr": 1e-3, "grad_norm": 0.5}
    record = train_record(step, loss=2.0, step_s=0.5, compute=[0.1, 0.1, 0.3], hosts=["a:0", "a:1", "b:0"],
                          flops_per_token=1e6, peak=1e10)
    assert record["tokens_per_s"] == 2000 and record["mfu"] == 2000 * 1e6 / 1e10
    assert record["slowest"] == "b:0" and abs(record["compute_max_median"] - 3.0) < 1e-9
    assert record["compute_ms"] == [100.0, 100.0, 300.0] and record["grad_norm"] == 0.5


def test_without_a_terminal_a_plain_progress_line_says_the_time_left(caplog):
    """Piped (the README's `| tee -i`), under SLURM or `docker logs` there is no bar: a line a minute."""
    import logging

    from mingpt.training.metrics import PlainProgress, duration

    now = [0.0]
    bar = PlainProgress(100, 2000, every_s=60, clock=lambda: now[0])
    caplog.set_level(logging.INFO)
    for _ in range(300):  # 0.5 s a step
        now[0] += 0.5
        bar.update(1)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress:")]
    assert lines[0] == "progress: step 220 of 2000 (11%), 1 min 0 s elapsed, about 14 min 50 s left"
    assert len(lines) == 2  # every minute, not every step
    assert [duration(s) for s in (4.4, 725, 3780)] == ["4 s", "12 min 5 s", "1 h 3 min"]
