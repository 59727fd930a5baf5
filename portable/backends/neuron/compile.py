"""Run neuronx-cc on the programs a `neuron` lowering wrote (only where the compiler is installed).

Contract (docs/cli.md, "Compiling for Neuron"; /work/shared/reference/neuron.md):

- A program directory `programs/<key>/` holds `command.txt` (the exact neuronx-cc argv) and
  `model/graph.hlo`. `compile_program` runs that argv with the program directory as working
  directory; success is exit 0 *and* "Compiler status PASS" in the compiler's output or log *and*
  the NEFF (`--output`, `graph.neff`) on disk. The log is `log-neuron-cc.txt` (`--logfile`) beside
  `command.txt`; if the compiler died before writing it, its console output is written there.
- Any other outcome raises `NeuronCompileError` naming the program, the exit status, every
  `NCC_` code in the output (three- or four-letter families: `NCC_EVRF001`, `NCC_CFG015`;
  ncc_codes.py) with its meaning and fix, and the log: exit -9 (SIGKILL, the host ran out of
  memory), -6 / -11 (the compiler crashed), a timeout, or an ordinary failure.
- `compile_all` compiles every program of a `neuron` output in parallel (as `scripts/compile.sh`
  does) and returns one `CompileResult` per program, failures included; it raises only when
  there is nothing to compile.

Nothing here imports JAX or torch; `neuronx_cc_available()` only looks at PATH and asks the
compiler for its version.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from portable.errors import BackendError
from portable.file_digest import sha256_file

from .ncc_codes import CODE as _CODE
from .ncc_codes import NCC_CODES
from .ncc_codes import UNKNOWN_CODE as _UNKNOWN_CODE

__all__ = [
    "COMMAND",
    "COMPILER",
    "LOG",
    "NCC_CODES",
    "NEFF",
    "PASS_MARKER",
    "CompileResult",
    "NeuronCompileError",
    "compile_all",
    "compile_program",
    "default_jobs",
    "explain_codes",
    "find_programs",
    "neuronx_cc_available",
    "read_command",
]

COMPILER = "neuronx-cc"
COMMAND = "command.txt"
NEFF = "graph.neff"
LOG = "log-neuron-cc.txt"
PASS_MARKER = "Compiler status PASS"
_TAIL_LINES = 12

_SIGNALS: dict[int, str] = {
    signal.SIGKILL: "out_of_memory",
    signal.SIGABRT: "crashed",
    signal.SIGSEGV: "crashed",
}


class NeuronCompileError(BackendError):
    """neuronx-cc failed on a program; `result` holds the details (status, codes, log)."""

    def __init__(self, what: str, *, result: CompileResult | None = None, **kw: Any) -> None:
        self.result = result
        super().__init__(what, **kw)


@dataclasses.dataclass(frozen=True)
class CompileResult:
    """The outcome of compiling one program.

    `status`: `pass`, `failed` (the compiler reported an error), `out_of_memory` (killed by
    SIGKILL), `crashed` (SIGABRT / SIGSEGV), `timeout`, or `not_run` (the command could not be
    started: missing compiler, unreadable command.txt). `returncode` is negative for a signal.
    """

    program: str
    program_dir: Path
    status: str
    returncode: int | None
    seconds: float
    neff: Path | None = None
    neff_sha256: str | None = None
    log: Path | None = None
    codes: tuple[str, ...] = ()
    error: str | None = None  # the rendered NeuronCompileError message

    @property
    def ok(self) -> bool:
        return self.status == "pass"

    def to_json(self, root: Path | None = None) -> dict[str, Any]:
        """A manifest record; paths relative to `root` when given."""

        def rel(path: Path | None) -> str | None:
            if path is None:
                return None
            return (path.relative_to(root) if root is not None else path).as_posix()

        return {
            "program": self.program,
            "status": self.status,
            "returncode": self.returncode,
            "seconds": round(self.seconds, 3),
            "neff": rel(self.neff),
            "neff_sha256": self.neff_sha256,
            "log": rel(self.log),
            "codes": list(self.codes),
            "error": self.error,
        }


# discovery --------------------------------------------------------------------------------------


def neuronx_cc_available(timeout: float = 120.0) -> tuple[bool, str]:
    """(True, version) when `neuronx-cc` is on PATH, else (False, why)."""
    exe = shutil.which(COMPILER)
    if exe is None:
        return False, f"{COMPILER} not on PATH"
    try:
        proc = subprocess.run(
            [exe, "--version"], capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{exe} does not run: {exc}"
    text = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        return False, f"`{exe} --version` exited {proc.returncode}: {_last_lines(text, 3)}"
    found = re.search(r"\d+\.\d+[\w.+-]*", text)
    return True, found.group(0) if found else (text.splitlines() or ["unknown version"])[0]


def find_programs(neuron_dir: Path) -> list[Path]:
    """Every `programs/<key>/` under a `neuron` output that holds a `command.txt`, sorted."""
    root = Path(neuron_dir) / "programs"
    if not root.is_dir():
        return []
    return sorted(p.parent for p in root.glob(f"*/{COMMAND}") if p.is_file())


def read_command(program_dir: Path) -> list[str]:
    """The argv in `command.txt`: one argument per line, or one shell-quoted command line
    (backslash-newline continuations and `#` comment lines allowed)."""
    path = Path(program_dir) / COMMAND
    text = path.read_text()
    lines = [ln.strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    if not lines:
        raise NeuronCompileError(
            f"{path} is empty", fix="re-lower the program (`portable lower ... --target neuron`)"
        )
    if len(lines) > 1 and lines[0] == COMPILER and not any(ln.endswith("\\") for ln in lines):
        return lines  # one argument per line
    try:
        return shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as exc:
        raise NeuronCompileError(
            f"{path} is not a valid command line: {exc}",
            fix="re-lower the program (`portable lower ... --target neuron`)",
        ) from exc


def explain_codes(codes: Iterable[str]) -> list[str]:
    """One line per code: `NCC_X: what it means`."""
    return [f"{code}: {NCC_CODES.get(code, _UNKNOWN_CODE)[0]}" for code in codes]


def _fixes(codes: tuple[str, ...]) -> str | None:
    fixes = {c: NCC_CODES.get(c, _UNKNOWN_CODE)[1] for c in codes}
    distinct = list(dict.fromkeys(fixes.values()))
    if len(distinct) <= 1:
        return distinct[0] if distinct else None
    return "; ".join(f"{c}: {f}" for c, f in fixes.items())


# compiling --------------------------------------------------------------------------------------


class _Live:
    """The compiler processes running now, so that an interrupt can stop all of them (each runs
    in its own session: killing its group also stops the compiler's worker processes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen] = set()

    def add(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.add(proc)

    def discard(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.discard(proc)

    def kill_all(self) -> None:
        with self._lock:
            procs = list(self._procs)
        for proc in procs:
            _kill_group(proc)


def compile_program(
    program_dir: Path, *, timeout: float | None = None, _live: _Live | None = None
) -> CompileResult:
    """Compile one program with the argv of its `command.txt`; raise NeuronCompileError unless
    it passed (the error's `result` is the failed CompileResult)."""
    program_dir = Path(program_dir).resolve()
    key = program_dir.name
    start = time.perf_counter()
    argv = _resolved_argv(program_dir, key)
    neff = _inside(program_dir, _option(argv, "--output") or NEFF, key)
    log = _inside(program_dir, _option(argv, "--logfile") or LOG, key)
    neff.unlink(missing_ok=True)  # a NEFF from an earlier run must not pass for this one
    live = _live if _live is not None else _Live()
    returncode, output, timed_out = _run(argv, program_dir, timeout, live)
    seconds = time.perf_counter() - start
    if not log.exists():
        log.write_text(output)
        log_text = ""
    else:
        log_text = log.read_text(errors="replace")
    text = output + "\n" + log_text
    codes = tuple(dict.fromkeys(_CODE.findall(text)))
    tail = _last_lines(output if output.strip() else log_text, _TAIL_LINES)
    passed = returncode == 0 and PASS_MARKER in text and neff.is_file()
    if passed:
        return CompileResult(
            key, program_dir, "pass", 0, seconds, neff, sha256_file(neff), log, codes
        )
    status = _status(returncode, timed_out)
    neff.unlink(missing_ok=True)  # graph.neff exists only after a passing compile
    result = CompileResult(key, program_dir, status, returncode, seconds, None, None, log, codes)
    what, details, fix = _explain(result, argv, text, tail, neff, timeout)
    error = NeuronCompileError(what, details=details, fix=fix)
    error.result = dataclasses.replace(result, error=str(error))
    raise error


def compile_all(
    neuron_dir: Path, *, jobs: int | None = None, timeout: float | None = None
) -> list[CompileResult]:
    """Compile every program under `neuron_dir/programs/` with up to `jobs` compilers at once
    (default: one per program, at most one per CPU). Returns one result per program, in key
    order, failures included (`error` holds the message); raises only if there is no program."""
    programs = find_programs(neuron_dir)
    if not programs:
        raise NeuronCompileError(
            f"{neuron_dir} holds no programs/<key>/{COMMAND} to compile",
            fix="point at the folder a neuron target was lowered into (DIR/neuron_trn3)",
        )
    if jobs is not None and jobs < 1:
        raise NeuronCompileError(f"jobs must be at least 1, got {jobs}")
    workers = jobs or default_jobs(len(programs))
    live = _Live()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers)
    try:
        futures = [pool.submit(_compile_collect, p, timeout, live) for p in programs]
        results = [f.result() for f in futures]
    except BaseException:  # Ctrl-C: stop every compiler before leaving
        live.kill_all()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return results


def default_jobs(programs: int) -> int:
    """Compilers run at once by default: one per program, at most one per CPU."""
    return max(1, min(programs, os.cpu_count() or 1))


def _compile_collect(program_dir: Path, timeout: float | None, live: _Live) -> CompileResult:
    try:
        return compile_program(program_dir, timeout=timeout, _live=live)
    except NeuronCompileError as exc:
        if exc.result is not None:
            return exc.result
        return CompileResult(
            Path(program_dir).name, Path(program_dir), "not_run", None, 0.0, error=str(exc)
        )


def _resolved_argv(program_dir: Path, key: str) -> list[str]:
    argv = read_command(program_dir)
    if Path(argv[0]).name != COMPILER or (len(argv) > 1 and argv[1] != "compile"):
        raise NeuronCompileError(
            f"program {key}: {program_dir / COMMAND} is not a `{COMPILER} compile` command "
            f"(it starts {shlex.join(argv[:2])})",
            fix="re-lower the program; portable runs nothing but the Neuron compiler",
        )
    exe = shutil.which(COMPILER)
    if exe is None:
        raise NeuronCompileError(
            f"cannot compile program {key}: {COMPILER} not on PATH",
            fix="install the Neuron SDK compiler (AWS's pip repository) or run "
            "scripts/compile.sh on a host that has it",
        )
    return [exe, *argv[1:]]


def _inside(program_dir: Path, name: str, key: str) -> Path:
    """`program_dir / name`, refusing paths that leave the program directory (portable deletes a
    stale NEFF before compiling: it must never touch anything else)."""
    path = (program_dir / name).resolve()
    if not path.is_relative_to(program_dir):
        raise NeuronCompileError(
            f"program {key}: {program_dir / COMMAND} writes {name}, outside the program directory",
            fix="re-lower the program; --output and --logfile name files beside command.txt",
        )
    return path


def _run(
    argv: list[str], cwd: Path, timeout: float | None, live: _Live
) -> tuple[int | None, str, bool]:
    """(returncode, stdout+stderr, timed_out)."""
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    live.add(proc)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out.decode(errors="replace"), False
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, _ = proc.communicate()
        return proc.returncode, out.decode(errors="replace"), True
    except BaseException:
        _kill_group(proc)
        proc.wait()
        raise
    finally:
        live.discard(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _status(returncode: int | None, timed_out: bool) -> str:
    if timed_out:
        return "timeout"
    if returncode is not None and returncode < 0:
        return _SIGNALS.get(-returncode, "crashed")
    if returncode is not None and returncode > 128:  # a shell wrapper reports 128 + signal
        return _SIGNALS.get(returncode - 128, "failed")
    return "failed"


def _explain(
    result: CompileResult,
    argv: list[str],
    text: str,
    tail: str,
    neff: Path,
    timeout: float | None,
) -> tuple[str, str, str]:
    """(what, details, fix) of a failed compile."""
    key, rc = result.program, result.returncode
    details = explain_codes(result.codes)
    if tail:
        details.append("last lines of output:")
        details.extend("  " + line for line in tail.splitlines())
    details.append(f"log: {result.log}")
    details.append(
        f"rerun: cd {shlex.quote(str(result.program_dir))} && {shlex.join([COMPILER, *argv[1:]])}"
    )
    if result.status == "out_of_memory":
        what = f"{COMPILER} was killed (SIGKILL, exit {rc}) compiling program {key}: the host ran out of memory"
        fix = (
            "use a host with more memory, run fewer compiles in parallel (--compile-jobs 1, "
            "or scripts/compile.sh with fewer jobs), or make the graph smaller (pipeline stages)"
        )
    elif result.status == "crashed":
        what = f"{COMPILER} crashed (signal {_signal_name(rc)}, exit {rc}) compiling program {key}"
        fix = (
            "a compiler bug: run `portable check` on the output to rule out inputs the compiler "
            "rejects, try another neuronx-cc release, and report it to aws-neuron-sdk with the "
            "log and model/graph.hlo"
        )
    elif result.status == "timeout":
        what = f"{COMPILER} did not finish program {key} within {timeout:g}s; it was stopped"
        fix = "allow more time (real models take minutes to an hour), or split the program"
    elif rc == 0:
        missing = "no NEFF at " + str(neff) if PASS_MARKER in text else f"no '{PASS_MARKER}'"
        what = f"{COMPILER} exited 0 on program {key} but did not succeed ({missing})"
        fix = "read the log; check the neuronx-cc installation"
    else:
        codes = ", ".join(result.codes) or "no NCC_ code in the output"
        what = f"{COMPILER} failed on program {key} (exit {rc}): {codes}"
        fix = _fixes(result.codes) or "read the log; run `portable check` on the output"
    return what, "\n".join(details), fix


def _signal_name(returncode: int | None) -> str:
    number = -returncode if returncode is not None and returncode < 0 else (returncode or 0) - 128
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _option(argv: list[str], flag: str) -> str | None:
    """The value of `--flag X` or `--flag=X` (the last one wins, as in argparse)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def _last_lines(text: str, n: int) -> str:
    lines = [ln.rstrip() for ln in text.strip().splitlines() if ln.strip()]
    return "\n".join(lines[-n:])
