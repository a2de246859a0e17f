"""mingpt-snapshot as a person uses it: given the run directory, a truncated snapshot is named as
one that does not load, `show` fits a screen, and a reader that stops early (`| head`) ends it quietly."""

import subprocess
import sys

import pytest
import torch
from conftest import REPO, save_state

from mingpt.cli.snapshot import main as snapshot_cli
from mingpt.cli.snapshot import weights_digest
from mingpt.model.gpt import GPT, GPTConfig
from mingpt.snapshot import SnapshotStore

SHAPE = GPTConfig(preset="gpt-nano", vocab_size=20, block_size=16)
MANIFEST = {"model_shape": SHAPE.shape_dict(), "tokenizer": {"kind": "char", "chars": "abcdefghijklmnopqrst"},
            "world_size": 1, "tokens_seen": 4096}


@pytest.fixture
def run_dir(tmp_path):
    """A run directory whose snapshots/ holds steps 1 and 2; step 2's shard is cut short."""
    store = SnapshotStore(str(tmp_path / "run" / "snapshots"))
    state = {"model": GPT(SHAPE).state_dict()}
    save_state(store, 1, state, MANIFEST)
    shard = next((tmp_path / "run" / "snapshots" / save_state(store, 2, state, MANIFEST).rsplit("/", 1)[1]).glob("*.bin"))
    shard.write_bytes(shard.read_bytes()[:1000])
    return tmp_path / "run"


def test_list_takes_the_run_directory_and_names_a_snapshot_that_does_not_load(run_dir, capsys):
    assert snapshot_cli(["list", str(run_dir)]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["1"].split()[1] == "committed" and "does not load" not in rows["1"]
    assert rows["2"].split()[1] == "damaged"
    assert "does not load: shard-00000-of-00001.bin has 1000 bytes, the manifest says" in rows["2"]


def test_show_is_a_summary_with_a_flag_for_every_tensor(run_dir, capsys):
    assert snapshot_cli(["show", str(run_dir), "--step", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) < 15 and out[0].startswith("snapshot step 1: ")
    assert any(line.split()[:2] == ["model", "3"] and "vocabulary 20" in line for line in out)
    assert any(line.split()[:3] == ["tensors", "model", f"{len(GPT(SHAPE).state_dict())}"] for line in out)
    assert snapshot_cli(["show", str(run_dir), "--step", "2"]) == 0  # the damaged one says so
    assert "does not load: shard-00000-of-00001.bin has 1000 bytes" in capsys.readouterr().out
    assert snapshot_cli(["show", str(run_dir), "--step", "1", "--full"]) == 0
    full = capsys.readouterr().out
    assert "model.wpe.weight  float32 (16, 48)" in full and "extra.pt" in full


def test_a_closed_pipe_ends_the_tool_quietly(tmp_path):
    deep = GPTConfig(preset=None, n_layer=400, n_head=1, n_embd=4, vocab_size=20, block_size=16)  # a long listing
    save_state(SnapshotStore(str(tmp_path)), 1, {"model": GPT(deep).state_dict()},
               {**MANIFEST, "model_shape": deep.shape_dict()})
    proc = subprocess.run(f"{sys.executable} -m mingpt.cli.snapshot show {tmp_path} --full | head -n 1",
                          shell=True, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.stdout.startswith("snapshot step 1: ") and proc.stderr == ""


def test_a_store_that_is_not_there_is_one_line(tmp_path, s3, capsys):
    assert snapshot_cli(["list", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'nowhere'} does not exist: give a run directory or a " \
                                      "snapshot store\n"
    assert snapshot_cli(["show", "s3://no-such-bucket/run"]) == 2
    assert capsys.readouterr().err == ("error: bucket no-such-bucket of s3://no-such-bucket/run does not exist or is not "
                                       f"reachable at {s3.env['AWS_ENDPOINT_URL']}\n")


def test_mingpt_snapshot_lists_and_aborts_uploads_that_dead_processes_left(s3, capsys):
    """A process killed during an upload leaves an unfinished multipart upload (its parts are billed
    until aborted): the tool lists them, and aborts them with --abort."""
    import s3fs

    from mingpt.cli.snapshot import main

    fs = s3fs.S3FileSystem()
    fs.mkdir("mpu-dead")
    mpu = fs.call_s3("create_multipart_upload", Bucket="mpu-dead", Key="run/step_000000010/shard-00000-of-00002.bin")
    fs.call_s3("upload_part", Bucket="mpu-dead", Key="run/step_000000010/shard-00000-of-00002.bin",
               UploadId=mpu["UploadId"], PartNumber=1, Body=b"x" * 1024)
    assert main(["uploads", "s3://mpu-dead/run", "--older-than", "0"]) == 0
    out = capsys.readouterr().out
    assert "unfinished: s3://mpu-dead/run/step_000000010/shard-00000-of-00002.bin" in out
    assert "1 unfinished multipart upload older than 0 h" in out and "--abort" in out
    assert main(["uploads", "s3://mpu-dead/run", "--older-than", "0", "--abort"]) == 0
    assert "aborted: s3://mpu-dead/run/step_000000010" in capsys.readouterr().out
    assert SnapshotStore("s3://mpu-dead/run").uploads() == []


def test_snapshot_cli_list_show_verify(tmp_path, capsys):
    store = SnapshotStore(str(tmp_path))
    save_state(store, 1, {"model": {"w": torch.ones(3)}}, {"world_size": 2})
    p2 = save_state(store, 2, {"model": {"w": torch.zeros(3)}}, {"world_size": 2})
    (tmp_path / "step_000000003").mkdir()
    assert snapshot_cli(["list", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "committed" in out and "incomplete" in out
    assert snapshot_cli(["verify", str(tmp_path)]) == 0
    assert weights_digest({"w": torch.zeros(3)}) in capsys.readouterr().out
    assert snapshot_cli(["show", str(tmp_path), "--step", "1", "--json"]) == 0
    assert '"step": 1' in capsys.readouterr().out
    listed = subprocess.run([sys.executable, "-m", "mingpt.cli.snapshot", "list", str(tmp_path)], capture_output=True,
                            text=True, check=True).stdout  # the installed tool is the same module
    assert "committed" in listed and "incomplete" in listed
    with open(f"{p2}/shard-00000-of-00001.bin", "r+b") as fh:
        fh.seek(-4, 2)
        fh.write(b"oops")
    assert snapshot_cli(["verify", str(tmp_path), "--json"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "shard-00000-of-00001.bin fails its checksum" in out
