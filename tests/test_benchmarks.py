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


def test_gpu_check_dry_run_exercises_every_part(tmp_path):
    """benchmarks/gpu_check.py runs on a GPU machine; its --dry-run runs the same code on CPU
    (Triton interpreted, tiny sizes), so the script is known to work before a GPU is lent."""
    import json
    import os

    import pytest

    pytest.importorskip("triton")
    assert os.environ.get("TRITON_INTERPRET") == "1"  # tests/conftest.py
    spec = importlib.util.spec_from_file_location("_bench_gpu_check", BENCH / "gpu_check.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "gpu.json"
    doc = tmp_path / "perf.md"
    code = bench.main(
        ["--dry-run", "--examples", "mlp,gpt", "--json", str(out), "--write", str(doc)]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert [(r["model"], r["kind"]) for r in result["parity"]] == [
        ("mlp", "inference"),
        ("mlp", "training"),
        ("gpt", "inference"),
        ("gpt", "training"),
    ]
    assert all(r["ok"] for r in result["parity"])
    kernels = " ".join(r["kernel"] for r in result["bandwidth"])
    for name in ("mx_quantize", "mx_dequantize", "scale_mask_softmax", "attention"):
        assert name in kernels
    assert {r["case"] for r in result["attention"]} == {"causal", "padding mask + causal"}
    assert result["mx_matmul"]["path"].startswith("emulated")
    assert all(r["ok"] for r in result["pt2"])
    assert bench.MARK in doc.read_text()
    from portable.backends import registry

    assert "cuda-dry-run" not in registry.names()  # registered only while the check ran
