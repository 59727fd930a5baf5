"""`portable run` when a rank dies, stops or fails: real processes, 2 ranks, gloo.

Each job trains the MLP example data-parallel over 2 ranks for far more steps than it is given
time for, with `--timeout 3`; a rank is hit once its heartbeat says it is in step 3 or later:
- kill -9 of rank 1: the job ends within seconds, the message names rank 1, SIGKILL and the step;
- SIGSTOP of rank 1: the same, in about the timeout (gloo alone would wait 30 minutes), naming
  the stopped process;
- Ctrl-C of `portable run`: exit 130, the job ends with it;
and after each, no process of the job is left (none reparented to init, none holding the
caller's stdout: reading it to the end returns). A rank that raises an exception that is not a
PortableError (an index out of range in its shard) is named, with the exception, instead of
"run it again without --quiet/--json".
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
MLP = f"{ROOT / 'examples' / 'mlp.py'}:MLP"
BOUND_S = 30  # the job ends this soon after a rank is hit (timeout 3s, shutdown, exit)

pytestmark = pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc")


def _job_processes(marker: Path) -> dict[int, list[bytes]]:
    """pid -> command line of every process whose command line names `marker`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(os.fsencode(marker) in part for part in cmdline):
            found[int(entry.name)] = cmdline
    return found


def _ranks(marker: Path) -> dict[int, tuple[int, Path | None]]:
    """rank -> (pid, report folder) of the job's worker processes."""
    ranks = {}
    for pid, cmdline in _job_processes(marker).items():
        if b"portable.distributed.worker" not in cmdline[:4]:
            continue  # the CLI, torchrun
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = next((int(e[5:]) for e in environ if e.startswith(b"RANK=")), None)
        report = cmdline[cmdline.index(b"--report") + 1] if b"--report" in cmdline else None
        if rank is not None:
            ranks[rank] = (pid, Path(os.fsdecode(report)) if report else None)
    return ranks


def _mid_job(marker: Path, proc: subprocess.Popen, limit: float = 240) -> int:
    """Wait until rank 1 is in training step 3 or later; return its pid."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and proc.poll() is None:
        rank1 = _ranks(marker).get(1)
        if rank1 is not None and rank1[1] is not None:
            try:
                beat = json.loads((rank1[1] / "rank1.beat.json").read_text())
            except (OSError, ValueError):
                beat = {}
            if beat.get("phase") == "step" and beat.get("step", 0) >= 3:
                return rank1[0]
        time.sleep(0.1)
    raise AssertionError(f"rank 1 never reached step 3 (exit {proc.poll()})")


@pytest.fixture
def job(tmp_path):
    """Start `portable run` on MLP (dp=2, --timeout 3); yield (process, its --out); on the way
    out, kill whatever of the job a failing test left behind."""
    plan = tmp_path / "dp.json"
    plan.write_text(json.dumps({"mesh": {"dp": 2}, "batch_axes": ["dp"]}))
    out = tmp_path / "out"
    args = [MLP, "--nproc", "2", "--plan", str(plan), "--steps", "1000000", "--timeout", "3"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "portable.cli", "run", *args, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    yield proc, out
    for pid in _job_processes(out):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.kill()
    proc.communicate()


def _finish(proc: subprocess.Popen, out: Path, hit: float) -> str:
    """The job's stderr, once it ended (stdout read to its end) within BOUND_S of `hit`."""
    try:
        _, stderr = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the job still ran {BOUND_S}s after the rank was hit") from None
    assert time.monotonic() - hit < BOUND_S
    assert _job_processes(out) == {}, "processes of the job outlived it"
    return stderr


def test_a_killed_rank_ends_the_job_and_is_named(job):
    proc, out = job
    os.kill(_mid_job(out, proc), signal.SIGKILL)
    stderr = _finish(proc, out, time.monotonic())
    assert proc.returncode == 4, stderr
    assert "error: rank 1 of 2 was killed by signal SIGKILL (9) in training step " in stderr
    assert "rank 0: " in stderr and "--quiet/--json" not in stderr
    assert not out.exists()


def test_a_stopped_rank_ends_the_job_in_bounded_time(job):
    proc, out = job
    pid = _mid_job(out, proc)
    os.kill(pid, signal.SIGSTOP)
    stderr = _finish(proc, out, time.monotonic())
    assert proc.returncode == 4, stderr
    assert "error: rank 1 of 2 hung in training step " in stderr
    assert "no heartbeat for 3." in stderr and "stopped by a signal (SIGSTOP" in stderr
    assert f"(pid {pid})" in stderr


def test_ctrl_c_ends_the_job_with_the_launcher(job):
    proc, out = job
    _mid_job(out, proc)
    proc.send_signal(signal.SIGINT)
    stderr = _finish(proc, out, time.monotonic())
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1].startswith("error: interrupted by Ctrl-C (SIGINT)")


class _Lookup(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(10, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids) * 2


def test_a_rank_that_raises_is_named_with_its_exception(tmp_path):
    """Rank 1's half of the batch holds an id past the table: only rank 1 raises."""
    import portable
    from portable import Mesh, Plan
    from portable.distributed.diagnosis import RankFailedError
    from portable.distributed.launch import launch, prepare
    from portable.passes.spmd_partition import partition

    torch.manual_seed(0)
    program = portable.capture(_Lookup(), (torch.tensor([[1, 2], [3, 4]]),))
    per_rank, _ = partition(program.replace(plan=Plan(Mesh({"dp": 2}), batch_axes=("dp",))))
    (ids,) = [i.name for i in per_rank.signature.user_inputs]
    run_dir = prepare(per_rank, {ids: torch.tensor([[1, 2], [3, 40]])}, tmp_path / "run")
    with pytest.raises(RankFailedError) as info:
        launch(run_dir, 2, tmp_path / "out", timeout_s=10)
    message = str(info.value)
    # torchrun may SIGTERM rank 1 after it raised and before it exits: then there is no exit
    # status, and the rank still counts as one that raised
    assert re.match(
        r"rank 1 of 2 failed( with exit status 1)? in the inference call: "
        r"IndexError: index out of range in self",
        message,
    ), message
    assert "rank 0: " in message and "--quiet/--json" not in message
    assert "rank 1 raised an exception that is not a portable error (File " in message
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- the message


def _outcome(returncode=1, hung=None, beats=None):
    from portable.distributed.job import Outcome

    return Outcome(returncode, hung or {}, beats or {}, output_tail="")


def _beat(rank, phase="step", step=3):
    from portable.distributed.heartbeat import Beat

    return Beat(rank, pid=1000 + rank, phase=phase, time=0.0, step=step, steps=5)


COLLECTIVE = {"type": "CollectiveError", "what": "waiting for all_reduce did not complete"}
KILLED = {
    "exitcode": -9,
    "signal": "SIGKILL",
    "pid": 1001,
    "message": "Signal 9",
    "traceback": None,
}
RAISED = {
    "exitcode": -15,
    "signal": "SIGTERM",
    "pid": 1001,
    "message": "RuntimeError: boom",
    "traceback": 'Traceback:\n  File "<eval_with_key>.2", line 5, in forward\n',
}
STOPPED = {"exitcode": -15, "signal": "SIGTERM", "pid": 1000, "message": "", "traceback": None}
MESSAGES = [
    ({1: KILLED}, {0: COLLECTIVE}, {}, "rank 1 of 2 was killed by signal SIGKILL (9) in step 3"),
    # torchrun saw rank 1 die before rank 0's collective failed, SIGTERMed rank 0 and recorded
    # it as failed too: rank 0 is not the cause although its number is lower
    ({0: STOPPED, 1: KILLED}, {}, {}, "rank 1 of 2 was killed by signal SIGKILL (9) in step 3"),
    # the rank raised, then torchrun's SIGTERM ended it: the exception is the cause
    ({1: RAISED, 0: KILLED}, {}, {}, "rank 1 of 2 failed in step 3: RuntimeError: boom"),
    ({}, {0: COLLECTIVE}, {1: "stopped"}, "rank 1 of 2 hung in step 3: no heartbeat for 3.5s"),
    ({}, {0: COLLECTIVE}, {}, "rank 0 of 2: waiting for all_reduce did not complete; rank(s) 1"),
]


@pytest.mark.parametrize(("failures", "reports", "hung", "headline"), MESSAGES)
def test_the_message_names_the_rank_that_caused_the_failure(failures, reports, hung, headline):
    from portable.distributed.diagnosis import job_error
    from portable.distributed.job import Hung

    beats = {r: _beat(r) for r in (0, 1)}
    hung = {r: Hung(r, beats[r], 3.5, state) for r, state in hung.items()}
    error = job_error(2, _outcome(hung=hung, beats=beats), failures, reports, timeout_s=3)
    text = str(error).replace("training step 3 of 5", "step 3")
    assert text.startswith(headline), text
    assert "\n  rank 0: " in text and "\n  rank 1: " in text


def test_a_rank_portable_error_is_raised_again_with_its_type():
    from portable.distributed.diagnosis import job_error
    from portable.errors import InputError

    reports = {1: {"type": "InputError", "what": "bad input", "fix": "pass another"}}
    error = job_error(2, _outcome(), {1: KILLED}, {0: COLLECTIVE, **reports}, timeout_s=3)
    assert isinstance(error, InputError)
    assert str(error).startswith("rank 1: bad input (ranks that failed: 0, 1)")
    assert job_error(2, _outcome(returncode=0), {}, {}, timeout_s=3) is None
