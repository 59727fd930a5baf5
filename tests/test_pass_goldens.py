"""Golden IR-text tests for every registered pass: this IR in, this IR out.

Each case is `tests/golden/passes/<pass>/<case>.in.txt`: a program in the printed form (read by
`portable.ir.parser`) under a `# pipeline: <passes>` line, plus `<case>.plan.json` when the pass
needs a plan (spmd-partition). The test parses the input, verifies it, runs the pipeline with
`verify_each`, and compares the result with `<case>.out.txt`: one `# <report summary>` line per
pass, then the printed program. `PORTABLE_UPDATE_GOLDEN=1` rewrites the .out.txt files
(docs/testing.md, "IR-text tests").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import portable
from portable import Plan
from portable.ir.parser import parse_program
from portable.passes import PassManager, parse_pipeline, registry
from tests.support import UPDATE_ENV, check_golden

GOLDEN = Path(__file__).resolve().parent / "golden" / "passes"
CASES = sorted(GOLDEN.glob("*/*.in.txt"))
PIPELINE = "# pipeline: "


def _name(path: Path) -> str:
    return f"{path.parent.name}/{path.name.removesuffix('.in.txt')}"


def _pipeline(text: str, path: Path) -> str:
    lines = [line.removeprefix(PIPELINE) for line in text.splitlines() if line.startswith(PIPELINE)]
    assert len(lines) == 1, f"{path} needs exactly one `{PIPELINE}...` line"
    return lines[0].strip()


def _plan(path: Path) -> Plan | None:
    plan = path.with_name(path.name.removesuffix(".in.txt") + ".plan.json")
    return Plan.from_json(json.loads(plan.read_text())) if plan.exists() else None


def _body(text: str) -> str:
    """The printed program of a golden file: its lines less the `#` comments."""
    return "".join(line for line in text.splitlines(True) if not line.startswith("#"))


@pytest.mark.parametrize("path", CASES, ids=_name)
def test_pass_golden(path: Path) -> None:
    text = path.read_text()
    program = parse_program(text, plan=_plan(path))
    portable.verify(program)
    out, reports = PassManager(parse_pipeline(_pipeline(text, path)), verify_each=True).run(program)
    got = "".join(f"# {report.summary()}\n" for report in reports) + out.text()
    check_golden(path.with_name(path.name.removesuffix(".in.txt") + ".out.txt"), got)


@pytest.mark.parametrize("path", CASES, ids=_name)
def test_golden_files_read_back_as_printed(path: Path) -> None:
    """Inputs and expectations are in the printer's form: each parses and prints as itself."""
    for name in (path.name, path.name.replace(".in.txt", ".out.txt")):
        file = path.with_name(name)
        if file.exists():
            body = _body(file.read_text())
            assert parse_program(body).text() == body, file


def test_every_registered_pass_has_golden_cases() -> None:
    """A pass's cases sit in the folder of its name, and their pipelines start with it."""
    folders = {p.parent.name for p in CASES}
    missing = sorted(set(registry.names()) - folders)
    assert not missing, f"passes without tests/golden/passes/<pass>/*.in.txt: {missing}"
    for path in CASES:
        first = parse_pipeline(_pipeline(path.read_text(), path))[0]
        assert first.name == path.parent.name, path


def test_the_comm_overlap_golden_pair_holds_from_text() -> None:
    """tests/golden/comm_overlap_mlp_dp.*.txt (printed from a capture by test_comm_overlap.py)
    hold from the text alone: the parsed `before` program gives the `after` text."""
    before = (GOLDEN.parent / "comm_overlap_mlp_dp.before.txt").read_text()
    out, _ = PassManager(parse_pipeline("comm-overlap"), verify_each=True).run(
        parse_program(before)
    )
    assert out.text() == (GOLDEN.parent / "comm_overlap_mlp_dp.after.txt").read_text()


def test_update_mode_writes_and_compare_mode_shows_the_diff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    golden = tmp_path / "case.out.txt"
    monkeypatch.delenv(UPDATE_ENV, raising=False)
    with pytest.raises(AssertionError, match="is missing: run with PORTABLE_UPDATE_GOLDEN=1"):
        check_golden(golden, "a\n")
    monkeypatch.setenv(UPDATE_ENV, "1")
    check_golden(golden, "a\nb\n")
    assert golden.read_text() == "a\nb\n"
    monkeypatch.setenv(UPDATE_ENV, "0")  # 0 is off
    check_golden(golden, "a\nb\n")
    with pytest.raises(AssertionError, match=r"(?s)differs.*-b\n\+c"):
        check_golden(golden, "a\nc\n")
