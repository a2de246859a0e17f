"""mingpt.snapshot.restore's messages name a snapshot as its user wrote the store."""

import pytest
import torch
from conftest import save_state

from mingpt.snapshot import SnapshotError, SnapshotStore
from mingpt.snapshot.layout import Slot
from mingpt.snapshot.restore import restore


def test_a_snapshot_on_s3_that_does_not_fit_or_is_damaged_is_named_by_its_url(s3):
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.mkdir("restore-msg")
    store = SnapshotStore("s3://restore-msg/run")
    path = save_state(store, 1, {"model": {"w": torch.arange(1000.0)}}, {})
    manifest = store.read_manifest(path)
    with pytest.raises(SnapshotError, match=r"^snapshot s3://restore-msg/run/step_000000001 does not fit this model"):
        restore(store, path, manifest, [Slot("model.w", torch.empty(4), (4,))], rank=0, world=1)
    fs.pipe_file(f"{path}/shard-00000-of-00001.bin", b"\0" * manifest["files"]["shard-00000-of-00001.bin"]["size"])
    with pytest.raises(SnapshotError, match=r"^snapshot s3://restore-msg/run/step_000000001 is damaged"):
        restore(store, path, manifest, [Slot("model.w", torch.empty(1000), (1000,))], rank=0, world=1)
