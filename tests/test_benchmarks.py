"""The benchmark scripts still run (smallest form); their numbers are recorded, not asserted."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_cpu_overhead_benchmark_runs_and_writes_its_block(tmp_path):
    spec = importlib.util.spec_from_file_location("_bench_cpu_overhead", BENCH / "cpu_overhead.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    row = bench.measure("mlp", "MLP", repeat=1)
    assert set(row) >= {"capture / export", "cpu inference / eager", "cpu train step / eager step"}
    assert all(value > 0 for value in row.values())
    doc = tmp_path / "perf.md"
    doc.write_text(f"# P\n\nbefore\n{bench.MARK}\nold\n{bench.MARK}\nafter\n")
    bench.write(doc, bench.table({"mlp": row}))
    text = doc.read_text()
    assert "old" not in text and "| mlp |" in text and text.endswith("after\n")
