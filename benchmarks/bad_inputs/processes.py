"""Signals during `portable lower` and a killed, stopped or failing rank of `portable run`: real
processes (issue 13, items 9 and 10). "typed" means handled as designed: the documented exit code
and one `error:` line, earlier outputs intact, no process or temp dir left. Linux only (/proc);
each scenario takes 10-60 s (fresh processes import torch)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from .base import Scenario

ROOT = Path(__file__).resolve().parents[2]
MLP = f"{ROOT / 'examples' / 'mlp.py'}:MLP"
PY = sys.executable
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _result(name, outcome, code, message):
    """The catalogue's outcome string: typed (handled as designed) | crash | hang | lost."""
    detail = f"exit {code}: {message.strip()[:200]}"
    return {"typed": "typed:", "data_lost": "lost:", "hang": "hang:"}.get(
        outcome, "crash:"
    ) + detail


def _snapshot(out: Path) -> dict[str, str]:
    if not out.exists():
        return {}
    return {
        p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


def _dotted(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def _previous(tmp: Path) -> tuple[Path, dict[str, str]]:
    out = tmp / "out"
    proc = subprocess.run([PY, "-m", "portable.cli", "lower", MLP, "-t", "cpu", "-o", str(out), "-q"],
                          env=ENV, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return out, _snapshot(out)


def _driver(tmp: Path, body: str) -> Path:
    script = tmp / "driver.py"
    head = "import gc, os, signal, sys\nimport portable.cli.lower as lower\n"
    tail = "\nfrom portable.cli.app import main\nsys.exit(main(sys.argv[1:]))\n"
    script.write_text(head + textwrap.dedent(body) + tail)
    return script


def _classify_interrupt(name, code, want, stderr, out, before):
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if _snapshot(out) != before or _dotted(out.parent):
        return _result(
            name, "data_lost", code, f"output changed or leftovers: {_dotted(out.parent)}"
        )
    if code != want or "Traceback" in stderr or not last.startswith("error: "):
        return _result(name, "crash", code, stderr[-800:])
    return _result(name, "typed", code, last)


# ----------------------------------------------------------------------- portable lower


def lower_sigint() -> str:
    """Ctrl-C (SIGINT) during `portable lower MLP --target all --force` over an earlier output."""
    with tempfile.TemporaryDirectory() as t:
        out, before = _previous(Path(t))
        cmd = [PY, "-m", "portable.cli", "lower", MLP, "--target", "all", "-o", str(out), "--force"]
        proc = subprocess.Popen(
            cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=ENV
        )
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "saving program.portable" in line:
                proc.send_signal(signal.SIGINT)
                break
        try:
            _, rest = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            return _result("lower_sigint", "hang", None, "still running 60s after SIGINT")
        return _classify_interrupt(
            "lower_sigint", proc.returncode, 130, "".join(lines) + rest, out, before
        )


def lower_sigint_swallowed_by_gc_callback() -> str:
    """Ctrl-C raised inside a gc callback (as JAX's _xla_gc_callback does): Python swallows it."""
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        out, before = _previous(tmp)
        script = _driver(
            tmp,
            """
            fired = []
            def cb(phase, info):
                if not fired:
                    fired.append(1); os.kill(os.getpid(), signal.SIGINT)
                    for _ in range(100_000): pass
            real = lower._lower_one
            def lower_one(*a, **k):
                gc.callbacks.append(cb); gc.collect(); return real(*a, **k)
            lower._lower_one = lower_one
        """,
        )
        proc = subprocess.run([PY, str(script), "lower", MLP, "-t", "cpu", "-o", str(out), "--force"],
                              env=ENV, capture_output=True, text=True, timeout=120)  # fmt: skip
        return _classify_interrupt(
            "lower_sigint_gc", proc.returncode, 130, proc.stderr, out, before
        )


def lower_sigterm() -> str:
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        out, before = _previous(tmp)
        script = _driver(tmp, "lower._lower_one = lambda *a, **k: os.kill(os.getpid(), 15)\n")
        proc = subprocess.run([PY, str(script), "lower", MLP, "-t", "cpu", "-o", str(out), "--force"],
                              env=ENV, capture_output=True, text=True, timeout=120)  # fmt: skip
        return _classify_interrupt("lower_sigterm", proc.returncode, 143, proc.stderr, out, before)


def lower_kill9_then_rerun() -> str:
    """kill -9 during lowering leaves .out.tmp-*; the next run into DIR must remove it."""
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        out, _ = _previous(tmp)
        script = _driver(tmp, "lower._lower_one = lambda *a, **k: os.kill(os.getpid(), 9)\n")
        subprocess.run(
            [PY, str(script), "lower", MLP, "-t", "cpu", "-o", str(out), "--force"], env=ENV
        )
        left = _dotted(tmp)
        rerun = subprocess.run([PY, "-m", "portable.cli", "lower", MLP, "-t", "cpu", "-o", str(out), "--force", "-q"],
                               env=ENV, capture_output=True, text=True)  # fmt: skip
        if _dotted(tmp):
            return _result("lower_kill9_rerun", "crash", rerun.returncode, f"left: {_dotted(tmp)}")
        return _result("lower_kill9_rerun", "typed", rerun.returncode, f"removed {left}")


_AT_THE_SWAP = """
real = os.rename
def rename(src, dst, *a, **k):
    if ".out.tmp-" in os.fspath(src) and os.path.basename(dst) == "out":
        {action}
    return real(src, dst, *a, **k)
os.rename = rename
"""


def lower_kill9_between_renames() -> str:
    """kill -9 between the swap's renames: the next run must put the earlier output back."""
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        out, before = _previous(tmp)
        script = _driver(tmp, _AT_THE_SWAP.format(action="os.kill(os.getpid(), 9)"))
        subprocess.run(
            [PY, str(script), "lower", MLP, "-t", "cpu", "-o", str(out), "--force"], env=ENV
        )
        rerun = subprocess.run([PY, "-m", "portable.cli", "lower", MLP, "-t", "cpu", "-o", str(out), "-q"],
                               env=ENV, capture_output=True, text=True)  # fmt: skip
        if _snapshot(out) != before:
            return _result(
                "lower_kill9_renames", "data_lost", rerun.returncode, "earlier output not restored"
            )
        return _result(
            "lower_kill9_renames", "typed", rerun.returncode, rerun.stderr.strip().splitlines()[0]
        )


def lower_exception_between_renames() -> str:
    """A RuntimeError raised by the second rename of the swap."""
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        out, before = _previous(tmp)
        script = _driver(tmp, _AT_THE_SWAP.format(action='raise RuntimeError("injected")'))
        proc = subprocess.run([PY, str(script), "lower", MLP, "-t", "cpu", "-o", str(out), "--force", "-q"],
                              env=ENV, capture_output=True, text=True)  # fmt: skip
        if _snapshot(out) != before:
            return _result(
                "lower_exception_renames", "data_lost", proc.returncode, "earlier output lost"
            )
        return _result("lower_exception_renames", "typed", proc.returncode, "earlier output intact")


# ----------------------------------------------------------------------- portable run


def _job_processes(marker: Path) -> dict[int, list[bytes]]:
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(os.fsencode(marker) in part for part in cmdline):
                found[int(entry.name)] = cmdline
    return found


def _rank1(marker: Path) -> tuple[int, Path] | None:
    for pid, cmdline in _job_processes(marker).items():
        if b"portable.distributed.worker" in cmdline[:4] and b"--report" in cmdline:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if b"RANK=1" in environ:
                return pid, Path(os.fsdecode(cmdline[cmdline.index(b"--report") + 1]))
    return None


def _run_job(name: str, hit) -> str:
    """`portable run` MLP dp=2 --timeout 3; `hit(proc, rank1_pid)` once rank 1 is in step >= 3."""
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        plan = tmp / "dp.json"
        plan.write_text(json.dumps({"mesh": {"dp": 2}, "batch_axes": ["dp"]}))
        out = tmp / "out"
        cmd = [PY, "-m", "portable.cli", "run", MLP, "--nproc", "2", "--plan", str(plan),
               "--steps", "1000000", "--timeout", "3", "--out", str(out)]  # fmt: skip
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
        )
        try:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and proc.poll() is None:
                found = _rank1(out)
                beat = {}
                if found:
                    try:
                        beat = json.loads((found[1] / "rank1.beat.json").read_text())
                    except (OSError, ValueError):
                        pass
                if beat.get("phase") == "step" and beat.get("step", 0) >= 3:
                    break
                time.sleep(0.1)
            else:
                return _result(name, "crash", proc.poll(), "rank 1 never reached step 3")
            hit(proc, found[0])
            try:
                _, stderr = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                return _result(name, "hang", None, "the job ran on 30s after the hit")
            left = _job_processes(out)
            last = [line for line in stderr.splitlines() if line.startswith("error:")]
            if left:
                return _result(name, "crash", proc.returncode, f"processes left: {list(left)}")
            return _result(name, "typed", proc.returncode, last[-1] if last else stderr[-500:])
        finally:
            for pid in _job_processes(out):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.kill()


def run_kill9_rank() -> str:
    return _run_job("run_kill9_rank", lambda proc, pid: os.kill(pid, signal.SIGKILL))


def run_sigstop_rank() -> str:
    return _run_job("run_sigstop_rank", lambda proc, pid: os.kill(pid, signal.SIGSTOP))


def run_ctrl_c() -> str:
    return _run_job("run_ctrl_c", lambda proc, pid: proc.send_signal(signal.SIGINT))


def run_rank_raises() -> str:
    """Rank 1's shard holds an embedding id past the table: an IndexError on rank 1 only."""
    code = textwrap.dedent("""
        import sys, torch, portable
        from portable import Mesh, Plan
        from portable.distributed.launch import launch, prepare
        from portable.passes.spmd_partition import partition
        class Lookup(torch.nn.Module):
            def __init__(self):
                super().__init__(); self.table = torch.nn.Embedding(10, 8)
            def forward(self, ids):
                return self.table(ids) * 2
        p = portable.capture(Lookup(), (torch.tensor([[1, 2], [3, 4]]),))
        per_rank, _ = partition(p.replace(plan=Plan(Mesh({"dp": 2}), batch_axes=("dp",))))
        (ids,) = [i.name for i in per_rank.signature.user_inputs]
        d = sys.argv[1]
        run = prepare(per_rank, {ids: torch.tensor([[1, 2], [3, 40]])}, d + "/run")
        try:
            launch(run, 2, d + "/out", timeout_s=10)
        except Exception as e:
            print(type(e).__name__ + ": " + str(e).splitlines()[0]); sys.exit(4)
    """)
    with tempfile.TemporaryDirectory() as t:
        proc = subprocess.run(
            [PY, "-c", code, t], env=ENV, capture_output=True, text=True, timeout=240
        )
        first = proc.stdout.strip()
        ok = first.startswith("RankFailedError: rank 1 of 2 failed") and "IndexError" in first
        return _result(
            "run_rank_raises",
            "typed" if ok else "crash",
            proc.returncode,
            first or proc.stderr[-500:],
        )


def run_bad_timeout() -> str:
    proc = subprocess.run([PY, "-m", "portable.cli", "run", MLP, "--nproc", "2", "--timeout", "0"],
                          env=ENV, capture_output=True, text=True)  # fmt: skip
    ok = proc.returncode == 2 and "must be positive" in proc.stderr
    return _result(
        "run_bad_timeout",
        "typed" if ok else "crash",
        proc.returncode,
        proc.stderr.strip().splitlines()[-1],
    )


def _scenario(name: str, category: str, fn) -> Scenario:
    return Scenario(name, category, lambda tmp: fn(), quick=False, timeout=400)


SCENARIOS = [
    _scenario("Ctrl-C during lower --target all --force", "signal", lower_sigint),
    _scenario("Ctrl-C swallowed by a gc callback", "signal", lower_sigint_swallowed_by_gc_callback),
    _scenario("SIGTERM during lower", "signal", lower_sigterm),
    _scenario("kill -9 during lower, then rerun", "signal", lower_kill9_then_rerun),
    _scenario("kill -9 between the swap's renames", "signal", lower_kill9_between_renames),
    _scenario("exception between the swap's renames", "signal", lower_exception_between_renames),
    _scenario("kill -9 of rank 1 mid-job", "rank", run_kill9_rank),
    _scenario("SIGSTOP of rank 1 mid-job", "rank", run_sigstop_rank),
    _scenario("Ctrl-C of portable run mid-job", "rank", run_ctrl_c),
    _scenario("rank 1 raises (embedding index)", "rank", run_rank_raises),
    _scenario("--timeout 0", "rank", run_bad_timeout),
]
