"""Snapshots of the full training state through one fsspec store (a local directory or s3://)."""

from mingpt.snapshot.snapshotter import Snapshotter
from mingpt.snapshot.store import SnapshotError, SnapshotStore

__all__ = ["SnapshotError", "SnapshotStore", "Snapshotter"]
