from conftest import read_metrics
from mingpt.training.metrics import MetricsWriter


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
