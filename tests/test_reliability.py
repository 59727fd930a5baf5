"""The bad-input catalogue (benchmarks/reliability.py) in its quick form: every scenario ends as
it must, a typed error for bad input or the right result, with no crash, hang, code execution,
silent wrong result or lost data. The long form (signals, killed and stopped ranks, base
installs, the field-by-field archive sweep) is recorded in docs/testing.md; those parts have
their own tests too (test_cli_signals, test_run_failures, test_optional_deps,
test_archive_adversarial)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_quick_catalogue_ends_as_it_must(capsys):
    spec = importlib.util.spec_from_file_location("_bench_reliability", BENCH / "reliability.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    code = bench.main(["--quick"])
    out = capsys.readouterr().out
    line = out.strip().splitlines()[-1]
    assert code == 0, out
    head, rest = line.split(", ", 1)
    typed, total = head.removeprefix("typed errors ").split(" / ")
    assert typed == total and int(total) >= 80, line
    assert rest == "crashes 0, hangs 0, code executions 0, silent wrong 0, data lost 0", line
