"""Preparing a dataset (mingpt/data/prepare.py): parallel equals serial byte for byte, a SIGKILLed
preparation continues to the same result, S3 in and out, and every bad input named."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import SMALL, dataset_files, gpt2_ranks, texts

from mingpt.config.schema import DataConfig, TokenizerConfig
from mingpt.data import DataError, load_corpus
from mingpt.data.prepare import Settings, prepare
from mingpt.data.prepared import PreparedData
from mingpt.model.tokenizer import TokenizerError, build_bpe


def test_parallel_prepare_writes_the_bytes_of_one_process(inputs, tmp_path):
    one = prepare([str(inputs)], str(tmp_path / "one"), SMALL, ranks_file=gpt2_ranks(), workers=1)
    two = prepare([str(inputs)], str(tmp_path / "two"), SMALL, ranks_file=gpt2_ranks(), workers=2)
    assert dataset_files(tmp_path / "one") == dataset_files(tmp_path / "two")
    assert len(one["shards"]) > 10 and one["dtype"] == "uint16"
    assert max(s["bytes"] for s in one["shards"]) <= SMALL.shard_bytes
    # 1 book + 3 x 300 JSON lines + 250 rows, each ending with end-of-text
    assert one["documents"] == 1 + 900 + 250 == two["documents"]
    tok = build_bpe(gpt2_ranks())
    data = PreparedData(str(tmp_path / "two"), str(tmp_path / "cache"), 1)
    ends = data.doc_ends()
    book = (inputs / "a_book.txt").read_text()
    assert data.tokens.read(0, int(ends[0])).tolist() == tok.encode(book) + [tok.eot_id]  # cut into units, same tokens
    last = texts(250, 3)[-1]
    assert data.tokens.read(int(ends[-2]), int(ends[-1])).tolist() == tok.encode(last) + [tok.eot_id]


def test_a_char_preparation_of_one_unit_starts_no_process(tmp_path, monkeypatch):
    """A small corpus is one unit: its vocabulary pass and its encoding run in this process (a spawned
    pool cost every small run seconds of start-up, to read one file)."""
    import mingpt.data.prepare as prepare_module

    def no_pool(*args):
        raise AssertionError("a process pool was started for one unit")

    monkeypatch.setattr(prepare_module.multiprocessing, "get_context", no_pool)
    (tmp_path / "a.txt").write_text("\n".join(texts(50)) + "\n")
    m = prepare([str(tmp_path / "a.txt")], str(tmp_path / "ds"), SMALL, kind="char", workers=2)
    assert m["tokens"] > 0 and m["tokenizer"]["kind"] == "char", m["tokenizer"]


def test_a_prepare_killed_midway_continues_to_the_same_result(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"part{i}.txt").write_text("\n".join(texts(20000, 10 + i)) + "\n")  # ~9 MB of text in all
    cmd = [sys.executable, "-m", "mingpt.cli.prepare", str(src), "--tokenizer.ranks_file", gpt2_ranks(), "--workers", "1",
           "--unit-mb", "0.25"]
    out = tmp_path / "out"
    proc = subprocess.Popen([*cmd, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while len(list((out / "work").glob("unit-*.json"))) < 4 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = len(list((out / "work").glob("unit-*.json")))
    (out / "shards" / ".u000099-000.bin.k1lled").write_bytes(b"half a shard")  # as a kill mid-write leaves it
    units = json.loads((out / "work" / "plan.json").read_text())["units"]
    assert proc.returncode == -signal.SIGKILL and 4 <= done_before < units and not (out / "manifest.json").exists()
    with pytest.raises(DataError, match="no manifest.json: its preparation was interrupted. Run the same "
                                        "mingpt-prepare command again"):
        PreparedData(str(out), str(tmp_path / "cache"), 1)
    again = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"{done_before} of {units} units already done" in again.stderr
    clean = subprocess.run([*cmd, "--out", str(tmp_path / "clean")], capture_output=True, text=True, timeout=300)
    assert clean.returncode == 0, clean.stderr
    assert dataset_files(out) == dataset_files(tmp_path / "clean")


TINY = ["model=custom", "model.n_layer=1", "model.n_head=2", "model.n_embd=16", "data.block_size=16",
        "trainer.eval_every=0", "trainer.log_every=3",
        "trainer.progress=false", "optim.warmup_steps=2", "snapshot.every_steps=0", "trainer.max_steps=6"
]


def train_weights(data_path: str, tmp_path: Path, name: str, *overrides: str) -> dict:
    from mingpt.config.compose import compose
    from mingpt.main import assemble
    from mingpt.runtime.distributed import DistInfo

    cfg = compose([*TINY, f"data.path={data_path}", f"data.cache_dir={tmp_path / ('cache-' + name)}",
                   "data.tokenizer.kind=bpe", f"data.tokenizer.ranks_file={gpt2_ranks()}",
                   f"trainer.run_dir={tmp_path / name}", *overrides])
    trainer = assemble(cfg, DistInfo())
    try:
        trainer.train()
    finally:
        trainer.close()
    return {k: v.clone() for k, v in trainer.parallel.gpt.state_dict().items()}


@pytest.mark.parametrize("kind", ["stream", "documents"])
def test_training_from_s3_equals_training_from_local_disk(inputs, tmp_path, s3, kind):
    import s3fs

    fs = s3fs.S3FileSystem()
    bucket = f"prep-{kind}"
    fs.mkdir(bucket)
    fs.put(str(inputs) + "/", f"{bucket}/raw/", recursive=True)
    remote = prepare([f"s3://{bucket}/raw"], f"s3://{bucket}/prepared", SMALL, ranks_file=gpt2_ranks(), workers=2)
    local = prepare([str(inputs)], str(tmp_path / "prepared"), SMALL, ranks_file=gpt2_ranks(), workers=1)
    assert remote["shards"] == local["shards"] and remote["tokens"] == local["tokens"]
    batching = (["trainer.batch_size=8", "trainer.micro_batch_size=4"] if kind == "stream" else
                ["data.documents.token_budget=64", "data.documents.micro_batches_per_step=4"])
    a = train_weights(f"s3://{bucket}/prepared", tmp_path, "s3", f"data.kind={kind}", *batching)
    b = train_weights(str(tmp_path / "prepared"), tmp_path, "local", f"data.kind={kind}", *batching)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the background copy brings every shard into the node's cache; a job stops it when it ends (the two
    # steps above can end before it is done), so a dataset opened on the same cache finishes it
    ds = PreparedData(f"s3://{bucket}/prepared", str(tmp_path / "cache-s3"), 1)
    try:
        deadline = time.monotonic() + 60
        while len(list((tmp_path / "cache-s3" / "shards").rglob("*.bin"))) < len(remote["shards"]):
            assert time.monotonic() < deadline and ds.error is None, ds.error or "the shards never all reached the cache"
            time.sleep(0.1)
    finally:
        ds.close()


def test_a_damaged_shard_on_s3_is_named(inputs, tmp_path, s3):
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.mkdir("prep-damaged")
    m = prepare([str(inputs / "b.jsonl")], "s3://prep-damaged/ds", SMALL, ranks_file=gpt2_ranks(), workers=1)
    victim = m["shards"][1]
    data = bytearray(fs.cat_file(f"prep-damaged/ds/{victim['name']}"))
    data[10] ^= 0xFF
    fs.pipe_file(f"prep-damaged/ds/{victim['name']}", bytes(data))
    ds = PreparedData("s3://prep-damaged/ds", str(tmp_path / "cache"), 1)
    deadline = time.monotonic() + 60
    with pytest.raises(DataError, match=f"shard {victim['name']} of prep-damaged/ds fails its checksum"):
        while time.monotonic() < deadline:  # reads go on until the copy of the damaged shard is checked
            ds.tokens.read(0, m["tokens"])
            time.sleep(0.05)
    ds.close()
    assert not list((tmp_path / "cache").rglob(victim["name"].replace("/", "__")))  # never kept


def test_bad_inputs_are_named(inputs, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a"], "url": ["u"]}), tmp_path / "other.parquet")
    with pytest.raises(DataError, match=r"other.parquet has no column 'text' \(its columns: content, url\); set "
                                        r"--text-field"):
        prepare([str(tmp_path / "other.parquet")], str(tmp_path / "x"), SMALL, ranks_file=gpt2_ranks(), workers=1)
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n' * 5 + '["a list"]\n')
    with pytest.raises(DataError, match=r"bad.jsonl line 6 is a JSON list, not an object"):
        prepare([str(tmp_path / "bad.jsonl")], str(tmp_path / "y"), Settings(unit_bytes=40), ranks_file=gpt2_ranks(),
                workers=1)
    with pytest.raises(DataError, match="input .*missing.txt does not exist"):
        prepare([str(tmp_path / "missing.txt")], str(tmp_path / "z"), SMALL, ranks_file=gpt2_ranks(), workers=1)
    # the same output for other inputs: refused, nothing of the first preparation touched
    (tmp_path / "p.txt").write_text("some text\n" * 100)
    before = {p: p.read_bytes() for p in (tmp_path / "y").rglob("*") if p.is_file()}
    with pytest.raises(DataError, match="holds an unfinished preparation of other inputs or settings"):
        prepare([str(tmp_path / "p.txt")], str(tmp_path / "y"), SMALL, ranks_file=gpt2_ranks(), workers=1)
    assert {p: p.read_bytes() for p in (tmp_path / "y").rglob("*") if p.is_file()} == before
    # a finished dataset: the same command says so, another one is refused
    prepare([str(tmp_path / "p.txt")], str(tmp_path / "done"), SMALL, ranks_file=gpt2_ranks(), workers=1)
    assert prepare([str(tmp_path / "p.txt")], str(tmp_path / "done"), SMALL, ranks_file=gpt2_ranks(), workers=1)["tokens"] > 0
    with pytest.raises(DataError, match="done already holds a prepared dataset of other inputs or settings"):
        prepare([str(inputs / "b.jsonl")], str(tmp_path / "done"), SMALL, ranks_file=gpt2_ranks(), workers=1)
    with pytest.raises(DataError, match=r"was prepared with the bpe tokenizer; set data.tokenizer.kind=bpe \(it is "
                                        r"data.tokenizer.kind=char\)"):
        load_corpus(DataConfig(path=str(tmp_path / "done"), cache_dir=str(tmp_path / "cache")))


def test_a_prepared_dataset_of_another_tokenizer_than_the_snapshot_is_named(inputs, tmp_path):
    prepare([str(inputs / "b.jsonl")], str(tmp_path / "ds"), SMALL, ranks_file=gpt2_ranks(), workers=1)
    d = DataConfig(path=str(tmp_path / "ds"), cache_dir=str(tmp_path / "cache"), tokenizer=TokenizerConfig("bpe", gpt2_ranks()))
    with pytest.raises(TokenizerError, match=r"was tokenized with GPT-2 BPE \(ranks sha256 .*\), the snapshot to "
                                             r"resume with char \(3 characters\)"):
        load_corpus(d, tokenizer_state={"kind": "char", "chars": "abc", "eot": False})


def test_a_missing_bucket_is_named_with_its_endpoint(tmp_path, s3):
    import s3fs

    s3fs.S3FileSystem().mkdir("prep-missing")
    with pytest.raises(DataError, match=r"^bucket no-such-bucket of input s3://no-such-bucket/corpus.txt does not "
                                        rf"exist or is not reachable at {s3.env['AWS_ENDPOINT_URL']}: "):
        load_corpus(DataConfig(path="s3://no-such-bucket/corpus.txt", cache_dir=str(tmp_path / "cache")))
    with pytest.raises(DataError, match=r"^input s3://prep-missing/corpus.txt does not exist; check the path$"):
        load_corpus(DataConfig(path="s3://prep-missing/corpus.txt", cache_dir=str(tmp_path / "cache")))


def test_an_unreachable_s3_source_is_one_line(tmp_path, monkeypatch):
    import s3fs
    from conftest import free_port

    s3fs.S3FileSystem.clear_instance_cache()  # a new client, for the endpoint below
    monkeypatch.setattr(s3fs.S3FileSystem, "_cache", {})  # and the client made here never reused later
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    t = time.monotonic()
    with pytest.raises(DataError, match=r"cannot reach s3://nowhere/corpus \(.*\); check the path, and for s3:// the "
                                        "endpoint"):
        prepare(["s3://nowhere/corpus"], str(tmp_path / "x"), SMALL, ranks_file=gpt2_ranks(), workers=1)
    print(f"failed after {time.monotonic() - t:.1f} s")
