"""`portable report RUN [--out DIR] [--json]`.

Draws a training run's loss / lr / tokens-per-second curves, step time per rank and collective
latency histograms as PNG files, and writes summary.md and summary.json, into DIR (default
RUN/report/; portable/jobs/report.py). Prints the path of summary.md; with --json, one JSON
document with the summary. A folder that is not a run is a user error (exit 3).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..jobs.report import make_report
from .exit_codes import EPILOG, ExitCode
from .interrupts import abandon_on_stop, deferred

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "report",
        parents=parents,
        help="plot a training run's curves and summarize it (markdown)",
        description="Read what `portable train --out RUN` wrote and write RUN/report/: "
        "loss.png, lr.png, tokens_per_s.png, step_time_per_rank.png, comm_histograms.png "
        "(plots need matplotlib), summary.md and summary.json.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", type=Path, metavar="RUN", help="the run folder")
    p.add_argument("--out", "-o", type=Path, default=None, metavar="DIR", help="report folder")
    p.add_argument("--json", action="store_true", help="print one JSON document to stdout")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    done = make_report(args.run_dir, out=args.out, critical=deferred, on_stop=abandon_on_stop)
    if args.json:
        doc = {
            "status": "ok",
            "exit_code": 0,
            "out_dir": str(done.out),
            "summary_md": str(done.summary_md),
            "summary": done.summary,
        }
        print(json.dumps(doc, indent=2))
    else:
        print(done.summary_md)
    return ExitCode.OK
