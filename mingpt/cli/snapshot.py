"""Inspect a snapshot store (local or s3://): list, show, verify; and clean up after dead jobs.

    mingpt-snapshot list runs/default                     # a run directory: its snapshots/
    mingpt-snapshot show runs/default --step 1000 --full
    mingpt-snapshot verify s3://bucket/run1 --endpoint-url http://minio:9000
    mingpt-snapshot uploads s3://bucket/run1 --abort      # multipart uploads that dead processes left
    mingpt-snapshot clean-cache                           # this user's node-cache copies of ended jobs
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import torch

from mingpt.runtime.console import quiet_on_closed_pipe
from mingpt.runtime.exits import Exit
from mingpt.runtime.storage import is_local
from mingpt.snapshot import SnapshotStore
from mingpt.snapshot.layout import layout_name
from mingpt.snapshot.nodecache import reclaim
from mingpt.snapshot.restore import read_whole
from mingpt.snapshot.store import SnapshotInfo


def store_path(path: str) -> str:
    """Where the tools look for snapshots: a run directory (trainer.run_dir) means its snapshots/
    folder (where snapshots go by default); a store, one snapshot folder or an s3:// URL as given."""
    inner = os.path.join(path, "snapshots")
    return inner if is_local(path) and os.path.isdir(inner) else path


def weights_digest(model_state: dict) -> str:
    """A short sha256 over the model tensors' names, shapes and bytes: equal digests, equal weights."""
    h = hashlib.sha256()
    for name in sorted(model_state):
        t = model_state[name].detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def _describe(store: SnapshotStore, info: SnapshotInfo, verify: bool) -> dict:
    row = {"step": info.step, "path": store.url_of(info.path), "committed": info.committed}
    if not info.committed:
        return row
    try:
        m = store.read_manifest(info.path)
        row.update(time=m["time"], size=sum(f["size"] for f in m["files"].values()), world_size=m.get("world_size"),
                   files=len(m["files"]), format=m["format_version"], tokens_seen=m.get("tokens_seen"))
        missing = store.missing_files(info.path, m)  # one listing: a file cut short or lost does not load
    except Exception as e:  # noqa: BLE001 - reported in the table
        row["error"] = f"{e.__class__.__name__}: {e}"
        return row
    if missing:
        row["error"] = f"does not load: {', '.join(missing)}"
        return row
    if verify:
        try:  # every shard, every chunk against its sha256
            state, _ = read_whole(store, info.path)
            row["checksum"] = "ok"
            row["weights"] = weights_digest(state["model"]) if "model" in state else None
        except Exception as e:  # noqa: BLE001
            row["checksum"] = f"FAILED ({e})"
    return row


def _show(store: SnapshotStore, info: SnapshotInfo, full: bool) -> None:
    """One snapshot in a screenful: what it holds, its tensors summarised (`full`: one line each)."""
    m = store.read_manifest(info.path)
    shape, tok, tensors = m["model_shape"], m["tokenizer"], m["tensors"]
    missing = store.missing_files(info.path, m)
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m["time"]))
    groups: dict[str, list] = {}  # model.*, optim.*: [tensors, values, bytes, dtypes]
    for name, t in tensors.items():
        n, g = torch.Size(t["shape"]).numel(), groups.setdefault(name.partition(".")[0], [0, 0, 0, set()])
        g[0], g[1], g[2] = g[0] + 1, g[1] + n, g[2] + n * getattr(torch, t["dtype"]).itemsize
        g[3].add(t["dtype"])
    lines = [
        f"snapshot step {m['step']}: {store.url_of(info.path)}",
        f"  state      {'does not load: ' + ', '.join(missing) if missing else 'committed, every file there'}",
        (f"  saved      {when} by {m.get('world_size', '?')} rank(s) ({layout_name(m)}), "
         f"{m.get('writers', '?')} writer(s), format {m['format_version']}, torch {m.get('versions', {}).get('torch')}"),
        f"  run        {m.get('run_id')}" + (f" (job {m['job_id']})" if m.get("job_id") else ""),
        (f"  model      {shape['n_layer']} layers, {shape['n_head']} heads, {shape['n_embd']} wide, context "
         f"{shape['block_size']}, vocabulary {shape['vocab_size']}"),
        f"  tokenizer  {tok['kind']}" + (f" ({len(tok['chars'])} characters)" if tok["kind"] == "char" else ""),
        f"  data       {m.get('corpus')}, {m.get('tokens_seen') or 0:,} tokens seen",
        "  tensors    " + "; ".join(f"{kind} {g[0]} ({g[1] / 1e6:.2f}M values, {g[2] / 1e6:.1f} MB, "
                                     f"{', '.join(sorted(g[3]))})" for kind, g in groups.items()),
        f"  files      {len(m['files'])}, {sum(f['size'] for f in m['files'].values()) / 1e6:.1f} MB",
    ]
    if full:
        lines += [f"    {name}  {t['dtype']} {tuple(t['shape'])}" for name, t in tensors.items()]
        lines += [f"    {name}  {f['size']:,} bytes" for name, f in m["files"].items()]
    else:
        lines.append("  (--full: every tensor and file; --json: the whole manifest)")
    print("\n".join(lines))


def _uploads(store: SnapshotStore, older_than_s: float, abort: bool) -> int:
    found = store.uploads(older_than_s)
    for u in found:
        if abort:
            store.files.abort_upload(u)
        print(f"{'aborted' if abort else 'unfinished'}: s3://{u['bucket']}/{u['key']} (begun {u['age_s'] / 3600:.1f} h "
              f"ago, upload id {u['upload_id'][:16]}...)")
    hint = "" if abort or not found else " (add --abort to abort them)"
    print(f"{len(found)} unfinished multipart upload{'' if len(found) == 1 else 's'} older than "
          f"{older_than_s / 3600:g} h under {store.url}{' aborted' if abort and found else ''}{hint}")
    return 0


def _table(rows: list[dict]) -> None:
    """One line per snapshot: step, state, size, files, world size, when saved, the check."""
    print(f"{'step':>10}  {'state':<11} {'size MB':>9} {'files':>5} {'world':>5}  {'saved at':<19}  check")
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["time"])) if "time" in r else "-"
        state = ("damaged" if r.get("error") else "committed") if r["committed"] else "incomplete"
        size = f"{r['size'] / 1e6:9.2f}" if "size" in r else f"{'-':>9}"
        check = r.get("error") or r.get("checksum", "")
        if r.get("weights"):
            check += f"  weights {r['weights']}"
        print(f"{r['step']:>10}  {state:<11} {size} {r.get('files', '-'):>5} {r.get('world_size') or '-':>5}  "
              f"{when:<19}  {check}")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mingpt-snapshot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["list", "show", "verify", "uploads", "clean-cache"],
                    help="list: one row per snapshot; show: one manifest (newest by default); "
                         "verify: checksums and weights digests; uploads: unfinished multipart uploads (with "
                         "--abort: abort them); clean-cache: remove this user's node-cache copies of jobs that "
                         "no longer run")
    ap.add_argument("store", nargs="?", help="a run directory (its snapshots/), a store: local directory or "
                    "s3://bucket/prefix (not for clean-cache)")
    ap.add_argument("--abort", action="store_true", help="with uploads: abort the ones listed")
    ap.add_argument("--older-than", type=float, default=1.0, metavar="HOURS",
                    help="with uploads: only those begun this long ago (default 1: a running save's upload is "
                         "younger)")
    ap.add_argument("--dir", default="/dev/shm", help="with clean-cache: snapshot.node_cache_dir (default /dev/shm)")
    ap.add_argument("--step", type=int, default=None, help="with show: which step")
    ap.add_argument("--full", action="store_true", help="with show: every tensor and file, one line each")
    ap.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    return ap


@quiet_on_closed_pipe
def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.command == "clean-cache":
        gone = reclaim(args.dir)
        for path, size in gone:
            print(f"removed {path} ({size / 1e6:.1f} MB)")
        print(f"{len(gone)} stale node-cache director{'y' if len(gone) == 1 else 'ies'} removed from {args.dir}; the "
              "copies of running jobs were left")
        return 0
    if args.store is None:
        ap.error(f"{args.command} needs a STORE")
    store = SnapshotStore(store_path(args.store), {"endpoint_url": args.endpoint_url} if args.endpoint_url else None)
    try:  # a store that is not there is said so, not listed as one without snapshots
        if not store.local:
            store.files.check()  # names a missing bucket and the endpoint asked
        elif not os.path.isdir(store.root):
            raise FileNotFoundError(f"{args.store} does not exist: give a run directory or a snapshot store")
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return Exit.BAD_INPUT
    if args.command == "uploads":
        return _uploads(store, args.older_than * 3600, args.abort)
    snaps = store.list()
    if args.command == "show":
        committed = [s for s in snaps if s.committed and (args.step is None or s.step == args.step)]
        if not committed:
            print(f"no committed snapshot{'' if args.step is None else f' at step {args.step}'} in {store.url}",
                  file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps(store.read_manifest(committed[-1].path), indent=1))
        else:
            _show(store, committed[-1], args.full)
        return 0
    rows = [_describe(store, s, verify=args.command == "verify") for s in snaps]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        _table(rows)
    bad = any(r.get("error") or str(r.get("checksum", "ok")) != "ok" for r in rows if r["committed"])
    return 1 if (args.command == "verify" and bad) else 0


if __name__ == "__main__":
    sys.exit(main())
