"""`mingpt-prepare INPUT... --out DIR` (or `python -m mingpt.cli.prepare`, also under torchrun for many
nodes): tokenize a corpus once, in parallel, into a prepared dataset; `--verify DATASET` checks one.
The library is mingpt/data/prepare.py."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from mingpt.data.prepare import Settings, prepare, verify
from mingpt.data.prepare import __doc__ as prepare_doc
from mingpt.data.sources import DataError
from mingpt.model.tokenizer import TokenizerError
from mingpt.runtime.console import quiet_on_closed_pipe
from mingpt.runtime.exits import Exit


def count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _parser() -> argparse.ArgumentParser:
    d = Settings()  # every default is the library's
    p = argparse.ArgumentParser(prog="mingpt-prepare", description=prepare_doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="*", metavar="INPUT", help="files, directories or globs (local, s3://, https://)")
    p.add_argument("--out", help="the prepared dataset's directory or s3:// prefix")
    p.add_argument("--verify", metavar="DATASET", help="check every shard of a prepared dataset against its sha256 "
                                                         "(nothing is prepared)")
    p.add_argument("--tokenizer.kind", dest="kind", choices=["bpe", "char"], default="bpe",
                   help="as data.tokenizer.kind (default bpe)")
    p.add_argument("--tokenizer.ranks_file", dest="ranks_file", default=None,
                   help="as data.tokenizer.ranks_file: a local r50k_base.tiktoken for machines without internet")
    p.add_argument("--format", default=d.fmt, choices=["auto", "text", "jsonl", "parquet"],
                   help="auto: by extension (.jsonl[.gz|.zst], .parquet, else text)")
    p.add_argument("--text-field", default=d.text_field, help="JSON field / Parquet column with the text (default %(default)s)")
    p.add_argument("--separator", default=d.separator,
                   help="text files: what separates documents, e.g. $'\\n\\n' (default: a file is one document)")
    p.add_argument("--val-fraction", type=float, default=d.val_fraction,
                   help="the last documents held out (default %(default)s)")
    p.add_argument("--workers", type=int, default=0, help="processes on this machine (default: every core)")
    p.add_argument("--shard-mb", type=float, default=d.shard_bytes / 2**20,
                   help="token bytes per shard at most, MiB (default %(default)g)")
    p.add_argument("--unit-mb", type=float, default=d.unit_bytes / 2**20,
                   help="input bytes per unit of work, MiB (default %(default)g)")
    return p


@quiet_on_closed_pipe
def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.verify:
        problems = verify(args.verify)
        for problem in problems:
            print(f"damaged: {problem}", file=sys.stderr)
        if not problems:
            print(f"{args.verify}: every shard and the index match the manifest")
        return 1 if problems else 0
    if not args.inputs or not args.out:
        parser.error("name the INPUTs and --out DIR (or --verify DATASET)")
    if not 0 < args.val_fraction < 1:
        print(f"error: --val-fraction must be between 0 and 1, got {args.val_fraction}", file=sys.stderr)
        return Exit.BAD_INPUT
    if args.kind == "char" and args.ranks_file:
        print("error: --tokenizer.ranks_file applies to --tokenizer.kind=bpe only (the char tokenizer builds its "
              "vocabulary from the text); leave one of them out", file=sys.stderr)
        return Exit.BAD_INPUT
    settings = Settings(args.format, args.separator, args.text_field, args.val_fraction, int(args.unit_mb * 2**20),
                        int(args.shard_mb * 2**20))
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    barrier = None
    if world > 1:
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=timedelta(days=2))  # ranks wait for the slowest at the end
        barrier = dist.barrier
    try:
        m = prepare(args.inputs, args.out, settings, kind=args.kind, ranks_file=args.ranks_file, workers=args.workers,
                    rank=rank, world_size=world, barrier=barrier, progress=rank == 0 and sys.stderr.isatty())
    except (DataError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; run the same command again to continue where it stopped", file=sys.stderr)
        return Exit.INTERRUPTED
    if rank == 0:
        held_out = (f"the last {m['val_documents']:,} documents" if m["val_documents"] else
                    f"the last {m['tokens'] - m['val_start_token']:,} tokens")
        print(f"{args.out}: {m['tokens']:,} tokens in {count(m['documents'], 'document')}, "
              f"{count(len(m['shards']), 'shard')} ({m['dtype']}); {held_out} held out for validation")
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
