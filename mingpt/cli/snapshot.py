"""Inspect a snapshot store (local or s3://): list, show, verify.

    mingpt-snapshot list runs/default/snapshots
    mingpt-snapshot verify s3://bucket/run1 --endpoint-url http://minio:9000
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import torch

from mingpt.snapshot import SnapshotStore
from mingpt.snapshot.store import SnapshotInfo


def weights_digest(model_state: dict) -> str:
    """A short sha256 over the model tensors' names, shapes and bytes: equal digests, equal weights."""
    h = hashlib.sha256()
    for name in sorted(model_state):
        t = model_state[name].detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def _describe(store: SnapshotStore, info: SnapshotInfo, verify: bool) -> dict:
    row = {"step": info.step, "path": info.path, "committed": info.committed}
    if not info.committed:
        return row
    try:
        m = store.read_manifest(info.path)
        row.update(time=m["time"], size=sum(f["size"] for f in m["files"].values()), world_size=m.get("world_size"),
                   files=len(m["files"]), format=m["format_version"], tokens_seen=m.get("tokens_seen"))
    except Exception as e:  # noqa: BLE001 - reported in the table
        row["error"] = f"{e.__class__.__name__}: {e}"
        return row
    if verify:
        try:  # every shard, every piece against its sha256
            state, _ = store.load(info.path)
            row["checksum"] = "ok"
            row["weights"] = weights_digest(state["model"]) if "model" in state else None
        except Exception as e:  # noqa: BLE001
            row["checksum"] = f"FAILED ({e})"
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mingpt-snapshot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["list", "show", "verify"],
                    help="list: one row per snapshot; show: one manifest (newest by default); "
                         "verify: checksums and weights digests")
    ap.add_argument("store", help="local directory or s3://bucket/prefix")
    ap.add_argument("--step", type=int, default=None, help="with show: which step")
    ap.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    args = ap.parse_args(argv)
    store = SnapshotStore(args.store, {"endpoint_url": args.endpoint_url} if args.endpoint_url else None)
    snaps = store.list()
    if args.command == "show":
        committed = [s for s in snaps if s.committed and (args.step is None or s.step == args.step)]
        if not committed:
            print(f"no committed snapshot{'' if args.step is None else f' at step {args.step}'} in {args.store}",
                  file=sys.stderr)
            return 1
        print(json.dumps(store.read_manifest(committed[-1].path), indent=1))
        return 0
    rows = [_describe(store, s, verify=args.command == "verify") for s in snaps]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'step':>10}  {'state':<11} {'size MB':>9} {'files':>5} {'world':>5}  {'saved at':<19}  check")
        for r in rows:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["time"])) if "time" in r else "-"
            state = "committed" if r["committed"] else "incomplete"
            size = f"{r['size'] / 1e6:9.2f}" if "size" in r else f"{'-':>9}"
            check = r.get("error") or r.get("checksum", "")
            if r.get("weights"):
                check += f"  weights {r['weights']}"
            print(f"{r['step']:>10}  {state:<11} {size} {r.get('files', '-'):>5} {r.get('world_size') or '-':>5}  "
                  f"{when:<19}  {check}")
    bad = any(r.get("error") or str(r.get("checksum", "ok")) != "ok" for r in rows if r["committed"])
    return 1 if (args.command == "verify" and bad) else 0


if __name__ == "__main__":
    sys.exit(main())
