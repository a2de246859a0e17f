"""Snapshots of the full training state through one fsspec store (a local directory or s3://)."""

from mingpt.snapshot.snapshotter import SaveFailedError, Snapshotter
from mingpt.snapshot.store import SnapshotError, SnapshotStore, open_store

__all__ = ["SaveFailedError", "SnapshotError", "SnapshotStore", "Snapshotter", "open_store"]
