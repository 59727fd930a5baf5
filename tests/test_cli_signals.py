"""Ctrl-C, SIGTERM and kill -9 during `portable lower`, with real processes.

- Ctrl-C (SIGINT) stops the command with exit 130 and one `error:` line, no traceback, and the
  previous output untouched; also when the interrupt lands in a garbage-collector callback,
  which Python swallows (JAX registers one: the cause of runs that did not stop);
- a run killed with -9 leaves its staging directory; the next run into the same DIR removes it,
  and puts the previous output back when the kill came between the two renames of the swap;
- an exception of any kind between those renames leaves the previous output in place;
- a live run's staging directory is never removed by another run.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from portable.cli.app import main
from portable.cli.exit_codes import ExitCode

ROOT = Path(__file__).resolve().parents[1]
MLP = f"{ROOT / 'examples' / 'mlp.py'}:MLP"
INTERRUPTED = "error: interrupted by Ctrl-C (SIGINT): stopped before finishing"

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def _snapshot(out: Path) -> dict[str, str]:
    """sha256 of every file under `out`, by relative path."""
    return {
        p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.fixture
def previous(tmp_path) -> tuple[Path, dict[str, str]]:
    """An earlier `portable lower` output at tmp_path/out, and its files' hashes."""
    out = tmp_path / "out"
    assert main(["lower", MLP, "-t", "cpu", "-o", str(out), "-q"]) == 0
    return out, _snapshot(out)


def _driver(tmp_path: Path, body: str) -> Path:
    """A script that patches portable as `body` says, then runs `portable` with its argv."""
    script = tmp_path / "driver.py"
    head = "import gc, os, signal, sys\nimport portable.cli.lower as lower\n"
    tail = "\nfrom portable.cli.app import main\nsys.exit(main(sys.argv[1:]))\n"
    script.write_text(head + textwrap.dedent(body) + tail)
    return script


def _python(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def _assert_one_line(stderr: str) -> None:
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert "Exception ignored" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert errors == [stderr.strip().splitlines()[-1]], stderr
    assert errors[0].startswith(INTERRUPTED), stderr


def test_ctrl_c_during_lower_exits_130_and_keeps_the_previous_output(previous):
    out, before = previous
    cmd = [sys.executable, "-m", "portable.cli", "lower", MLP, "--target", "all"]
    proc = subprocess.Popen(
        [*cmd, "-o", str(out), "--force"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    lines = []
    assert proc.stderr is not None
    for line in proc.stderr:  # stage lines end when their stage ends (stderr is not a tty)
        lines.append(line)
        if "saving program.portable" in line:  # now lowering for every backend
            sent = time.monotonic()
            proc.send_signal(signal.SIGINT)
            break
    _, rest = proc.communicate(timeout=60)
    stderr = "".join(lines) + rest
    assert proc.returncode == 130, stderr
    assert time.monotonic() - sent < 30, stderr
    _assert_one_line(stderr)
    assert _snapshot(out) == before
    assert _leftovers(out.parent) == []


def test_ctrl_c_swallowed_by_a_gc_callback_still_stops(previous):
    """An interrupt raised inside a gc callback is "ignored" by Python; the run must stop, and
    the interrupt raised again must not land in the clean-up of the staging directory."""
    out, before = previous
    script = _driver(
        out.parent,
        """
        fired = []

        def swallowing_callback(phase, info):  # like JAX's _xla_gc_callback
            if not fired:
                fired.append(True)
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(100_000):  # the handler runs here, inside the callback
                    pass

        real = lower._lower_one

        def lower_one(*args, **kwargs):
            gc.callbacks.append(swallowing_callback)
            gc.collect()
            return real(*args, **kwargs)

        lower._lower_one = lower_one
        """,
    )
    proc = _python(str(script), "lower", MLP, "-t", "cpu", "-o", str(out), "--force")
    assert proc.returncode == 130, proc.stderr
    _assert_one_line(proc.stderr)
    assert _snapshot(out) == before and _leftovers(out.parent) == []


def test_sigterm_exits_143_and_writes_nothing(tmp_path):
    script = _driver(tmp_path, "lower._lower_one = lambda *a, **k: os.kill(os.getpid(), 15)\n")
    out = tmp_path / "fresh"
    proc = _python(str(script), "lower", MLP, "-t", "cpu", "-o", str(out), "--json")
    assert proc.returncode == 143, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: terminated (SIGTERM)")
    assert '"exit_code": 143' in proc.stdout
    assert not out.exists() and _leftovers(tmp_path) == []


def test_kill_9_leftovers_are_removed_by_the_next_run(previous):
    out, _ = previous
    script = _driver(out.parent, "lower._lower_one = lambda *a, **k: os.kill(os.getpid(), 9)\n")
    proc = _python(str(script), "lower", MLP, "-t", "cpu", "-o", str(out), "--force")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert any(name.startswith(".out.tmp-") for name in _leftovers(out.parent))
    assert main(["lower", MLP, "-t", "cpu", "-o", str(out), "--force", "-q"]) == 0
    assert _leftovers(out.parent) == []


def test_kill_9_between_the_renames_gives_the_previous_output_back(previous):
    out, before = previous
    script = _driver(
        out.parent,
        """
        real_rename = os.rename

        def rename(src, dst, *args, **kwargs):  # the swap's second rename: staging -> out
            if ".out.tmp-" in os.fspath(src) and os.path.basename(dst) == "out":
                os.kill(os.getpid(), signal.SIGKILL)
            return real_rename(src, dst, *args, **kwargs)

        os.rename = rename
        """,
    )
    proc = _python(str(script), "lower", MLP, "-t", "cpu", "-o", str(out), "--force")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not out.exists()  # the previous output is set aside, the new one not yet in place
    # the next run puts it back first; without --force it then refuses to replace it
    assert main(["lower", MLP, "-t", "cpu", "-o", str(out), "-q"]) == ExitCode.OUTPUT_CONFLICT
    assert _snapshot(out) == before
    assert _leftovers(out.parent) == []


@pytest.mark.parametrize(
    ("error", "code"),
    [(RuntimeError("injected"), ExitCode.INTERNAL_ERROR), (KeyboardInterrupt(), 130)],
)
def test_an_exception_between_the_renames_keeps_the_previous_output(
    previous, monkeypatch, capsys, error, code
):
    out, before = previous
    real_rename = os.rename

    def rename(src, dst, *args, **kwargs):
        if ".out.tmp-" in os.fspath(src) and Path(dst) == out:
            raise error
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    assert main(["lower", MLP, "-t", "cpu", "-o", str(out), "--force", "-q"]) == code
    assert _snapshot(out) == before
    assert _leftovers(out.parent) == []
    capsys.readouterr()


def test_a_live_runs_staging_directory_is_left_alone(tmp_path):
    from portable.cli.output import staging

    out = tmp_path / "out"
    with staging(out, force=False) as tmp:
        (tmp / "part").write_text("in progress")
        code = "import pathlib, sys; from portable.cli.output import recover_stale as r; "
        code += "print(r(pathlib.Path(sys.argv[1])))"
        proc = _python("-c", code, str(out))  # another process sweeps beside `out`
        assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr
        assert (tmp / "part").read_text() == "in progress"
    assert (out / "part").read_text() == "in progress"
    assert _leftovers(tmp_path) == []


def test_a_staging_directory_that_lost_its_lock_goes_once_its_process_is_gone(tmp_path):
    """A process ended at once (a second Ctrl-C) while its main thread still wrote: its staging
    directory may outlive its lock file; the pid in its name tells whether it is still live."""
    from portable.cli.output import recover_stale

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], text=True,
                          capture_output=True).stdout.strip()  # fmt: skip
    gone = tmp_path / f".out.tmp-{dead}-deadbeef"
    live = tmp_path / f".out.tmp-{os.getpid()}-cafebabe"
    foreign = tmp_path / ".out.tmp-notours"
    for folder in (gone, live, foreign):
        (folder / "cuda").mkdir(parents=True)
    assert recover_stale(tmp_path / "out") == [gone.name]
    assert _leftovers(tmp_path) == sorted([live.name, foreign.name])
