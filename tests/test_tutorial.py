"""The docs, run: docs/tutorial-hf.md step by step, the decorator's example, and every `portable`
command line and flag the docs show.

The tutorial is executed as written: each ```python file=NAME``` block is written to NAME in a
fresh directory, each `$ command` of a ```console``` block runs there (`portable ...` through
the CLI's `main`, `python FILE` in this process, anything else in a shell), and its output must
match the lines the page shows after it. Timings, sizes, hashes, the opset version and error
figures are compared as placeholders; a line `...` in the page stands for any lines. The small
form (CI) skips the training-step lowering; PORTABLE_SLOW=full runs every command. When a
change alters what the commands print, `PORTABLE_UPDATE_TUTORIAL=1` writes the new output into
the page (review the diff: it is what a reader will see).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from portable.cli import ExitCode, main
from portable.cli.app import build_parser

DOCS = Path(__file__).resolve().parents[1] / "docs"
README = DOCS.parent / "README.md"
TUTORIAL = DOCS / "tutorial-hf.md"
FULL = os.environ.get("PORTABLE_SLOW") == "full"
SLOW_COMMANDS = ("--train",)  # the training step's lowering (~1 min on 2 cores)

_FENCE = re.compile(r"^```([a-z]*)(?: file=(\S+))?\n(.*?)^```$", re.M | re.S)
_PLACEHOLDERS = (
    (re.compile(r"\b\d+\.\ds\b"), "<time>"),
    (re.compile(r"\bhash [0-9a-f]{16}\b"), "hash <hash>"),
    (re.compile(r"\b\d+(\.\d+)? (B|KiB|MiB|GiB)\b"), "<size>"),
    (re.compile(r"\bopset \d+\.\d+\b"), "opset <version>"),
    (re.compile(r"\b\d\.\d{3}e[+-]\d\d\b"), "<error>"),
)


@dataclasses.dataclass(frozen=True)
class Step:
    """A file the page shows (`text` is its content) or a command (`text` is its output)."""

    kind: str  # "file" or "command"
    name: str  # the file name, or the command line
    text: str


def steps(page: str) -> list[Step]:
    """The page's files and commands, in order."""
    out = []
    for lang, file, body in _FENCE.findall(page):
        if file:
            out.append(Step("file", file, body))
        elif lang == "console":
            for chunk in re.split(r"^\$ ", body, flags=re.M)[1:]:
                command, _, output = chunk.partition("\n")
                out.append(Step("command", command, output))
    return out


def normalized(text: str) -> list[str]:
    lines = []
    for line in text.rstrip("\n").splitlines():
        for pattern, placeholder in _PLACEHOLDERS:
            line = pattern.sub(placeholder, line)
        lines.append(line.rstrip())
    return lines


def matches(expected: list[str], actual: list[str]) -> bool:
    """Line by line, where an expected `...` matches any number of lines."""
    if not expected:
        return not actual
    if expected[0] == "...":
        return any(matches(expected[1:], actual[i:]) for i in range(len(actual) + 1))
    return bool(actual) and expected[0] == actual[0] and matches(expected[1:], actual[1:])


def run_command(command: str, capsys) -> tuple[int, str]:
    """Run one `$ command` of the page in the current directory: (exit code, stderr + stdout)."""
    argv = shlex.split(command)
    capsys.readouterr()
    if argv[0] == "portable":
        code = main(argv[1:])
    elif argv[0] == "python":
        runpy.run_path(argv[1], run_name="__main__")
        code = 0
    else:
        done = subprocess.run(command, shell=True, capture_output=True, text=True, check=False)
        return done.returncode, done.stderr + done.stdout
    out, err = capsys.readouterr()
    return code, err + out


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A fresh directory, current and importable, whose modules are forgotten afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


@pytest.mark.slow
def test_tutorial_runs_as_written(workdir, capsys):
    """PORTABLE_UPDATE_TUTORIAL=1 writes what the commands print into the page instead of
    comparing (outputs shown abridged, with `...`, are kept): for a change that alters output."""
    pytest.importorskip("transformers")
    pytest.importorskip("jax")
    page = TUTORIAL.read_text()
    update = os.environ.get("PORTABLE_UPDATE_TUTORIAL") == "1"
    ran = 0
    for step in steps(page):
        if step.kind == "file":
            (workdir / step.name).write_text(step.text)
            continue
        if not (FULL or update) and any(flag in step.name for flag in SLOW_COMMANDS):
            continue
        code, output = run_command(step.name, capsys)
        assert code == ExitCode.OK, f"$ {step.name}\n{output}"
        ran += 1
        want, got = normalized(step.text), normalized(output)
        if update and "..." not in want:
            page = page.replace(f"$ {step.name}\n{step.text}", f"$ {step.name}\n{output}", 1)
            continue
        diff = "\n".join(difflib.unified_diff(want, got, "the page", "printed", lineterm=""))
        assert matches(want, got), f"$ {step.name}: the output differs from the page\n{diff}"
    if update:
        TUTORIAL.write_text(page)
    assert ran >= 4  # lower (inference), find, check, the Python script


def test_tutorial_structure_is_what_the_harness_reads():
    found = steps(TUTORIAL.read_text())
    files = [s.name for s in found if s.kind == "file"]
    commands = [s.name for s in found if s.kind == "command"]
    assert files == ["tiny_llama.py", "lower_and_check.py"]
    assert any("-t neuron:trn3 -t cuda --parity" in c and "--train" not in c for c in commands)
    assert any("-t neuron:trn3 -t cuda --parity" in c and "--train" in c for c in commands)
    assert "python lower_and_check.py" in commands


def test_matching_with_placeholders_and_ellipsis():
    want = normalized("[1/2] capturing x ... 8.9s\n...\nparity: ok\n")
    assert matches(want, normalized("[1/2] capturing x ... 12.0s\na\nb\nparity: ok"))
    assert not matches(want, normalized("[1/2] capturing y ... 12.0s\nparity: ok"))
    assert not matches(want, normalized("[1/2] capturing x ... 1.0s\nparity: MISMATCH"))


def test_decorator_doc_example_runs(workdir):
    example = next(body for lang, _, body in _FENCE.findall((DOCS / "decorator.md").read_text()))
    namespace = runpy.run_path(_write(workdir / "example.py", example))
    program, step = namespace["program"], namespace["step"]
    assert program.kind.value == "inference" and step.kind.value == "training_step"
    assert step.metadata["optimizer"]["kind"] == "adamw"


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# every command line and flag the docs show is one the CLI takes -------------------------------


def _docs() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _command_lines(text: str) -> list[str]:
    """The `portable ...` command lines of the code blocks (inline mentions may be partial)."""
    lines = []
    for _, _, body in _FENCE.findall(text):
        for line in body.splitlines():
            line = line.removeprefix("$ ").split("  #")[0].strip()
            if line.startswith("portable ") and "&&" not in line:
                lines.append(line)
    return lines


# flags of other tools the docs quote (neuronx-cc, benchmark scripts, the pytest plugin)
_FOREIGN_FLAGS = {
    "--distribution-strategy",
    "--framework",
    "--logical-nc-config",
    "--model-type",
    "--auto-cast",  # neuronx-cc flags named in docs/backends/neuron.md
    "--implicit-integer-downcast",
    "--native-int64",
    "--portable-backends",
    "--dry-run",
    "--write",
    "--quick",  # benchmarks/reliability.py
    "--sweep",
    "--dtypes",  # tests/support/opinfo.py (the OpInfo sweep)
    "--recompute-granularity",  # Megatron-LM's flag, named in docs/planner.md
    "--async-tensor-model-parallel-allreduce",  # Megatron-LM's flag, named in docs/planner.md
    "--fit",  # benchmarks/planner_validation.py
    "--rows",
    "--layers",  # benchmarks/planner_speed.py
}


def _portable_flags() -> set[str]:
    top = build_parser()
    flags = {s for a in top._actions for s in a.option_strings}
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            for parser in action.choices.values():
                flags |= {s for a in parser._actions for s in a.option_strings}
    return flags


def test_docs_name_only_real_flags():
    flags = _portable_flags()
    for doc in _docs():
        named = set(re.findall(r"`(--[a-z][a-z0-9-]*)", doc.read_text()))
        unknown = named - flags - _FOREIGN_FLAGS
        assert not unknown, f"{doc.name} names {sorted(unknown)}; the CLI takes {sorted(flags)}"


def test_docs_command_lines_parse():
    parser = build_parser()
    for doc in _docs():
        for line in _command_lines(doc.read_text()):
            argv = [a for a in shlex.split(line)[1:] if not re.fullmatch(r"\[.*|.*\]|\.\.\.", a)]
            if any(re.fullmatch(r"[A-Z_]+|[A-Z]+2?", a) for a in argv) or "|" in line:
                continue  # a synopsis with metavariables (`--target T`), not a command
            try:
                parser.parse_args(argv)
            except SystemExit as exc:
                if exc.code != 0:
                    pytest.fail(f"{doc.name}: `{line}` is not a valid command (exit {exc.code})")
