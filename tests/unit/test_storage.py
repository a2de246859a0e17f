import os
import stat

import pytest

from mingpt.runtime import storage
from mingpt.runtime.storage import atomic_write_bytes


def test_atomic_write_is_readable_like_any_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "model.safetensors"
    atomic_write_bytes(path, b"weights")
    umask = os.umask(0o022)
    os.umask(umask)
    assert path.read_bytes() == b"weights"
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask  # not mkstemp's private 0600
    assert os.listdir(path.parent) == ["model.safetensors"]


def test_a_failed_write_keeps_the_previous_file(tmp_path):
    path = tmp_path / "manifest.json"
    atomic_write_bytes(path, b"old")
    with pytest.raises(TypeError):
        atomic_write_bytes(path, "not bytes")  # fails inside the write
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["manifest.json"]


@pytest.mark.parametrize("readable_by, folder, file", [("user", 0o700, 0o600), ("group", 0o750, 0o640),
                                                      ("all", 0o755, 0o644)])
def test_trainer_readable_by_sets_what_the_run_writes(tmp_path, monkeypatch, readable_by, folder, file):
    monkeypatch.setattr(storage, "_UMASK", storage._UMASK)
    before = os.umask(0o022)
    try:
        storage.set_umask(readable_by)
        atomic_write_bytes(tmp_path / "run" / "metrics.jsonl", b"{}")
        (tmp_path / "run" / "plain").write_text("x")  # an open() of its own
    finally:
        os.umask(before)
    assert stat.S_IMODE((tmp_path / "run").stat().st_mode) == folder
    assert {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "run").iterdir()} == {file}
