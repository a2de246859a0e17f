import base64
import os
import socket
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture
def corpus_file(tmp_path) -> Path:
    """A small corpus of a few thousand characters that the test writes itself."""
    lines = [f"Speaker {i % 7}: the quick brown fox {i} jumps over the lazy dog." for i in range(300)]
    p = tmp_path / "corpus.txt"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


def make_ranks_file(path: Path) -> Path:
    """A tiny BPE ranks file in tiktoken's format: the 256 bytes plus a few merges."""
    tokens = [bytes([b]) for b in range(256)] + [b"th", b"he", b"the", b" the", b"ow", b"ro", b"row"]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    return env


def torchrun_cmd(nproc: int, *args: str, max_restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            f"--max-restarts={max_restarts}", *args]
