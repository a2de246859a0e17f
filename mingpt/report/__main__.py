"""mingpt-report RUN_DIR [--html PATH | --no-html]   (the same: python -m mingpt.report)

Prints the run's summary (steps, tokens, best validation loss, restarts, world sizes, goodput and
where the rest of the time went, the slowest ranks, snapshots) and writes one self-contained HTML
page with the plots (RUN_DIR/report.html unless --html says where).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mingpt.report.goodput import read_records
from mingpt.report.summary import Run, summary
from mingpt.runtime.console import quiet_on_closed_pipe
from mingpt.runtime.exits import Exit


@quiet_on_closed_pipe
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mingpt-report", description=__doc__.split("\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="the run directory (trainer.run_dir), or its metrics.jsonl")
    ap.add_argument("--html", help="where to write the page (default: RUN_DIR/report.html)")
    ap.add_argument("--no-html", action="store_true", help="print the summary only")
    args = ap.parse_args(argv)
    path = Path(args.run_dir)
    metrics = path if path.is_file() else path / "metrics.jsonl"
    if not metrics.is_file():
        print(f"error: no metrics at {metrics}: give the run directory a training run wrote "
              "(trainer.run_dir, default runs/default)", file=sys.stderr)
        return Exit.BAD_INPUT
    run = Run.of(read_records(metrics))
    print(summary(run, str(metrics.parent)))
    if args.no_html:
        return 0
    try:
        from mingpt.report.html import write_html
    except ImportError as e:
        print(f"\nno HTML report: {e.name} is not installed (pip install 'mingpt[report]')", file=sys.stderr)
        return 0
    out = Path(args.html) if args.html else metrics.parent / "report.html"
    write_html(run, out, str(metrics.parent))
    print(f"\nreport: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
