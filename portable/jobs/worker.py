"""One process of a training job: `torchrun ... -m portable.jobs.worker --job-folder RUN --report DIR`.

torchrun starts it once per rank (cpu, cuda) or once for the controller (xla, neuron), and again
after a failure when the job allows restarts (TORCHELASTIC_RESTART_COUNT counts them): a
restarted process resumes from the last complete checkpoint by itself. It beats into the report
folder (heartbeat.py) so the launcher can tell a stopped or wedged rank from a slow one, dies
with torchrun (lifetime.py), and reports a PortableError to the launcher with its type
(diagnosis.py), exiting 3.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the heavy imports: a restart's clock starts when the process does

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402

from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from ..distributed.agent import AGENT_PID_ENV  # noqa: E402
from ..distributed.diagnosis import write_failure  # noqa: E402
from ..distributed.heartbeat import Heartbeat  # noqa: E402
from ..distributed.lifetime import die_with_parent  # noqa: E402
from ..errors import PortableError  # noqa: E402

__all__ = ["main"]


@record
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    agent = os.environ.get(AGENT_PID_ENV)
    die_with_parent(int(agent) if agent else None)
    rank = int(os.environ.get("RANK", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    beat = Heartbeat(args.report, rank, interval=min(1.0, args.timeout / 10)).start()
    try:
        from .loop import run_job

        run_job(args.job_folder, restart=restart, started=STARTED, at=beat.at)
        beat.at("done")
    except PortableError as exc:
        write_failure(Path(args.report), rank, exc)
        print(f"error: [rank {rank}] {exc}", file=sys.stderr)
        return 3
    finally:
        beat.stop()
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m portable.jobs.worker",
        description="One process of a portable training job (torchrun starts it).",
    )
    p.add_argument("--job-folder", required=True, type=Path, metavar="RUN", help="the job's RUN")
    p.add_argument("--report", required=True, type=Path, help="heartbeats and failures")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S")
    return p


if __name__ == "__main__":
    sys.exit(main())
