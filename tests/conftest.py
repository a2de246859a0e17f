import base64
import gzip
import json
import os
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import free_port, free_port_runs  # noqa: F401 - the tests' and the benchmarks' port pickers
from benchmarks.seaweed import SeaweedFS  # beside the benchmarks, which use it too
from mingpt.config.schema import DataConfig, DocumentsConfig
from mingpt.data import load_corpus
from mingpt.data.prepare import Settings
from mingpt.snapshot import SnapshotStore
from mingpt.training.ledger import STATES

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(autouse=True)
def environment_restored():
    """Each test starts from the suite's environment. Code that an agent runs in-process (the rendezvous
    handler sets MINGPT_LAUNCH_ID) writes os.environ; monkeypatch.delenv of a name that was not set
    restores nothing, so one test's launch id went to every job a later test started: two jobs of one
    "launch" share a store's lease, and test_lease's second job was let in."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


def make_corpus(directory: Path) -> Path:
    """A small corpus (about 17,000 characters) that the test writes itself."""
    lines = [f"Speaker {i % 7}: the quick brown fox {i} jumps over the lazy dog." for i in range(300)]
    p = directory / "corpus.txt"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


@pytest.fixture
def corpus_file(tmp_path) -> Path:
    return make_corpus(tmp_path)


def make_ranks_file(path: Path) -> Path:
    """A tiny BPE ranks file in tiktoken's format: the 256 bytes plus a few merges."""
    tokens = [bytes([b]) for b in range(256)] + [b"th", b"he", b"the", b" the", b"ow", b"ro", b"row"]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)))
    return path


def torchrun_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    return env


def torchrun_cmd(nproc: int, *args: str, max_restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            f"--max-restarts={max_restarts}", *args]


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on loopback, for what a real server cannot be made to do on cue; the AWS
    environment points at it with dummy credentials."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ENDPOINT_URL=f"http://{host}:{port}", AWS_ACCESS_KEY_ID="test-key-id",
                      AWS_SECRET_ACCESS_KEY="test-secret-do-not-log", AWS_DEFAULT_REGION="us-east-1")
    yield {"server": server, "host": host, "port": port}
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory):
    server = SeaweedFS(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3(seaweedfs, monkeypatch):
    """The AWS environment of this test points at the real S3 server (SeaweedFS on loopback)."""
    import s3fs

    for k, v in seaweedfs.env.items():
        monkeypatch.setenv(k, v)
    s3fs.S3FileSystem.clear_instance_cache()  # an instance made for another endpoint must not answer
    yield seaweedfs
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(params=["local", "s3"])
def store_url(request, tmp_path):
    """The same store tests against a local directory and against s3:// on a real S3 server
    (SeaweedFS on loopback; the AWS environment points at it for the test)."""
    if request.param == "local":
        return str(tmp_path / "snapshots")
    request.getfixturevalue("s3")
    import uuid

    import s3fs

    bucket = f"bkt-{uuid.uuid4().hex[:10]}"
    s3fs.S3FileSystem().mkdir(bucket)
    return f"s3://{bucket}/run"


def make_docs_corpus(directory: Path, n: int = 400) -> Path:
    """Documents of very different lengths (a skewed distribution), separated by blank lines."""
    import random

    rng = random.Random(0)
    docs = []
    for i in range(n):
        words = int(rng.lognormvariate(2.5, 1.0)) + 1
        docs.append(" ".join(f"w{rng.randrange(30)}" for _ in range(words)) + f" end{i % 10}.")
    p = directory / "docs.txt"
    p.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return p


NOBODY = 65534  # a second local user, as on a shared node


def as_nobody():
    """preexec_fn for subprocess: run the child as the user nobody (the tests run as root). Only for
    small stand-alone programs: nobody cannot reach root's interpreter under /root."""
    def drop():
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    return drop


# A child in a user namespace of its own keeps its files' owner but loses root's power to ignore
# permissions: a 0555 directory is read-only to it, as it is to any user on a cluster.
WITHOUT_CAPABILITIES = ["unshare", "--user"]


def fs_of(store):
    """The fsspec file system under a snapshot store, for tests that damage or inspect its files."""
    import fsspec

    return fsspec.filesystem("file") if store.local else store.files.fs


def save_state(store, step: int, state: dict, manifest: dict) -> str:
    """Write and commit one snapshot as its only writer (what a tool or a test needs): the tensors of
    state["model"] as shards, everything else as the small state; returns its path."""
    from mingpt.snapshot import Snapshotter
    from mingpt.snapshot.layout import Slot

    snap = Snapshotter(store, keep_last=1_000_000, retries=0)
    slots = [Slot(f"model.{k}", v.detach().contiguous(), tuple(v.shape)) for k, v in state.get("model", {}).items()]
    snap.save(step, slots, {k: v for k, v in state.items() if k != "model"}, manifest)
    assert snap.wait() is True, f"the snapshot of step {step} was not committed"
    snap.close()
    return f"{store.root}/{store.name(step)}"


# Test helpers over the library's own parts (the library has no test-only code).

def records(path) -> list[dict]:
    """Every whole record of a metrics file that may still be written to ([] before it exists)."""
    from mingpt.training.metrics import read_records

    return read_records(path) if Path(path).exists() else []


def read_metrics(path, kind: str = "train") -> dict:
    """step -> the last record of that kind ("train" or "eval") in a metrics file."""
    from mingpt.training.metrics import read_records

    return {rec["step"]: rec for rec in read_records(path) if rec.get("kind") == kind}


def read_corpus(path: str, fetch_default: bool) -> tuple[str, str]:
    """The corpus text and the path read, as training locates and reads it."""
    from mingpt.data.sources import locate_corpus, read_text

    path = locate_corpus(path, fetch_default)
    return read_text(path), path


def read_documents(path: str, fmt: str, separator: str, text_field: str, fetch_default: bool) -> list[str]:
    """Every document of a raw corpus in memory, through the reader that preparation uses."""
    from mingpt.data.sources import DataError, document_files, file_units, raw_format, unit_documents

    file_fmt, sep = raw_format(fmt, separator)
    docs = [d for f in document_files(path, fmt, fetch_default)
            for unit in file_units(f, file_fmt, sep, 1 << 62, text_field) for d, _ in unit_documents(unit, sep, text_field)]
    if not docs:
        raise DataError(f"{path} holds no non-empty documents")
    return docs


def token_stream(ids):
    """A TokenStream over one in-memory array (one shard)."""
    from mingpt.data.prepared import TokenStream

    return TokenStream([len(ids)], lambda k: ids)


def char_tokenizer(text: str, eot: bool = False):
    """The CharTokenizer of the characters of `text`."""
    from mingpt.model.tokenizer import CharTokenizer

    return CharTokenizer("".join(sorted(set(text))), eot)


@pytest.fixture
def two_nodes():
    """Two "nodes" in their own network namespaces joined by a veth pair: {"a": Node, "b": Node}."""
    from benchmarks.netns import NoNamespaces
    from benchmarks.netns import two_nodes as make

    try:
        with make() as (a, b):
            yield {"a": a, "b": b}
    except NoNamespaces as e:
        pytest.skip(str(e))


# Helpers that unit tests and scenarios share.

def snapshots(run_dir: Path) -> dict[int, str]:
    """step -> run id of every committed snapshot in run_dir/snapshots."""
    store = SnapshotStore(str(run_dir / "snapshots"))
    return {s.step: store.read_manifest(s.path)["run_id"] for s in store.list() if s.committed}


# Prepared datasets (mingpt-prepare) from inputs of every format.

def gpt2_ranks() -> str:
    """GPT-2's BPE ranks, for a test that needs its real vocabulary: $MINGPT_TEST_RANKS_FILE, or the copy the
    project's own machines keep beside the checkout; else the test skips, saying what to put where."""
    path = Path(os.environ.get("MINGPT_TEST_RANKS_FILE") or SHARED_DATA / "r50k_base.tiktoken")
    if not path.is_file():
        pytest.skip(f"needs GPT-2's BPE ranks: set MINGPT_TEST_RANKS_FILE=/path/to/r50k_base.tiktoken ({path} is "
                    "missing; data/README.md says where to get the file)")
    return str(path)


SMALL = Settings(unit_bytes=8192, shard_bytes=4096)  # many units, several shards per unit


def texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "naïve", "café", "42", "'s"]
    return [" ".join(rng.choice(words, int(rng.integers(3, 60)))) + "." for _ in range(n)]


def make_inputs(root: Path) -> Path:
    """One input directory with every format: a long text file, plain / gzip / zstd JSON lines,
    and Parquet with several row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    src = root / "src"
    src.mkdir(parents=True)
    (src / "a_book.txt").write_text("\n".join(texts(900, 1)) + "\n")
    lines = "\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(texts(300, 2))) + "\n"
    (src / "b.jsonl").write_text(lines)
    (src / "c.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (src / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    pq.write_table(pa.table({"text": texts(250, 3), "n": list(range(250))}), src / "e.parquet", row_group_size=100)
    return src


def dataset_files(out: Path) -> dict[str, bytes]:
    files = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
             if p.is_file() and (p.parent.name == "shards" or p.name == "index.int64")}
    manifest = json.loads((out / "manifest.json").read_text())
    manifest.pop("created")
    manifest["inputs"] = [{**i, "path": Path(i["path"]).name} for i in manifest["inputs"]]
    files["manifest"] = json.dumps(manifest, sort_keys=True).encode()
    return files


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    return make_inputs(tmp_path_factory.mktemp("inputs"))


# GPT-2 checkpoints in Hugging Face's layout.

BLOCK = 32


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A small random GPT-2 with GPT-2's full vocabulary, saved the way the hub serves them."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e .[test]")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=50257)
    model = transformers.GPT2LMHeadModel(config).eval()
    path = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    model.save_pretrained(path)
    return path, model


def bpe_overrides(corpus, tmp_path, run_dir, *extra):
    return ["data=shakespeare_bpe", f"data.block_size={BLOCK}", f"data.tokenizer.ranks_file={gpt2_ranks()}",
            f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}", f"trainer.run_dir={run_dir}",
            "trainer.batch_size=4", "trainer.micro_batch_size=4", "trainer.eval_every=0", "trainer.progress=false",
            "optim.warmup_steps=0", "optim.lr=1e-4", "optim.min_lr=1e-4", *extra]


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def load_documents(path, fmt, cache, block_size=16, val_fraction=0.1):
    return load_corpus(DataConfig(path=str(path), fetch_default=False, block_size=block_size,
                                  val_fraction=val_fraction, cache_dir=str(cache), kind="documents",
                                  documents=DocumentsConfig(format=fmt)))


def ledger(t0, step, kind="time", job="j1", **seconds):
    s = dict.fromkeys(STATES, 0.0)
    s.update(seconds)
    return {"kind": kind, "step": step, "t0": t0, "s": s, "time": t0 + sum(s.values()), "job_id": job,
            "world_size": 2}


class Payload:
    """What an attacker stores in a job's store: unpickling it creates a directory, as any code could run."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def forged_state(marker) -> bytes:
    """A rendezvous state as torch's c10d backend stores it (base64 of a pickle), carrying Payload."""
    return base64.b64encode(pickle.dumps(Payload(str(marker))))
