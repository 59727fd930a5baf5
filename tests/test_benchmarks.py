"""The benchmark scripts still run (smallest form); their numbers are recorded, not asserted."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

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


@pytest.mark.slow
def test_gpu_check_dry_run_exercises_every_part(tmp_path):
    """benchmarks/gpu_check.py runs on a GPU machine; its --dry-run runs the same code on CPU
    (Triton interpreted, tiny sizes), so the script is known to work before a GPU is lent. The
    small form's parity runs the MLP (GPT's kernel graph against cpu in the interpreter is
    tests/test_cuda_backend.py's); PORTABLE_SLOW=full adds GPT."""
    import json
    import os

    import torch.backends

    pytest.importorskip("triton")
    assert os.environ.get("TRITON_INTERPRET") == "1"  # tests/conftest.py
    spec = importlib.util.spec_from_file_location("_bench_gpu_check", BENCH / "gpu_check.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "gpu.json"
    doc = tmp_path / "perf.md"
    stems = ["mlp", "gpt"] if os.environ.get("PORTABLE_SLOW") == "full" else ["mlp"]
    # the script sets the TF32 flags, as in a process of its own; torch.testing._internal (the
    # OpInfo tests, when they ran earlier in this worker) froze them: torch's own unfreezing
    with getattr(torch.backends, "__allow_nonbracketed_mutation")():
        code = bench.main(
            ["--dry-run", "--examples", ",".join(stems), "--json", str(out), "--write", str(doc)]
        )
    assert code == 0
    result = json.loads(out.read_text())
    assert [(r["model"], r["kind"]) for r in result["parity"]] == [
        (stem, kind) for stem in stems for kind in ("inference", "training")
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


def _bench(stem: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{stem}", BENCH / f"{stem}.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_mx_quantize_benchmark_small_measures_every_format_and_writes_its_block(tmp_path, capsys):
    bench = _bench("mx_quantize")
    quant, dequant, info = bench.measure(bench.SMALL, repeat=1, torchao=False)
    assert list(quant) == [f"{f} {r}" for f in bench.FORMATS for r in bench.RULES]
    assert all(row["portable / copy"] > 0 and row["portable ms"] > 0 for row in quant.values())
    assert quant["e4m3 rceil"]["goal"].startswith("<= 1.00x: ")  # no torchao: 1.0x
    assert quant["e2m1 floor"]["goal"].startswith("<= 1.00x: ")
    assert list(dequant) == list(bench.FORMATS)
    assert all(row["goal"].startswith("<= 1.50x: ") for row in dequant.values())
    assert info["numel"] == bench.SMALL and "not measured" in info["torchao"]
    doc = tmp_path / "perf.md"
    doc.write_text(f"# P\n\nbefore\n{bench.MARK}\nold\n{bench.MARK}\nafter\n")
    bench.main(["--small", "--repeat", "1", "--no-torchao", "--write", str(doc)])
    text = doc.read_text()
    assert "old" not in text and "| e4m3 rceil |" in text and "| e2m1 |" in text
    assert text.endswith("after\n") and "1 MiB float32" in capsys.readouterr().out


def test_mx_training_benchmark_data_is_fixed_and_it_fails_clearly_without_the_pass(monkeypatch):
    import pytest
    import torch

    bench = _bench("mx_training")
    first, again = bench.markov_batches(3, 128), bench.markov_batches(3, 128)
    assert torch.equal(
        torch.stack([t for b in first for t in b]), torch.stack([t for b in again for t in b])
    )
    idx, targets = first[0]
    assert idx.shape == targets.shape == (bench.BATCH, bench.SEQ)
    assert torch.equal(idx[:, 1:], targets[:, :-1])  # targets are the next tokens
    successors = {}
    for prev, nxt in zip(idx.flatten().tolist(), targets.flatten().tolist(), strict=True):
        successors.setdefault(prev, set()).add(nxt)
    assert max(len(s) for s in successors.values()) <= bench.SUCCESSORS
    monkeypatch.setattr(bench, "PASS", "mx-quantize-not-there")
    with pytest.raises(SystemExit, match="`mx-quantize-not-there` pass is not registered"):
        bench.measure(steps=2)


def test_mx_training_benchmark_few_steps_records_both_curves(tmp_path):
    import json
    import math

    import pytest

    from portable.passes import registry

    bench = _bench("mx_training")
    assert bench.PASS in registry.names()
    out, doc = tmp_path / "curves.json", tmp_path / "perf.md"
    doc.write_text(f"# P\n{bench.MARK}\nold\n{bench.MARK}\n")
    args = ["--steps", "3", "--json", str(out), "--write", str(doc)]
    try:
        import matplotlib  # noqa: F401

        args += ["--plot", str(tmp_path / "curves.png")]
    except ImportError:
        pass
    bench.main(args)
    result = json.loads(out.read_text())
    fp32, mx = result["losses"]["fp32"], result["losses"]["mxfp8"]
    assert len(fp32) == len(mx) == 3 and all(math.isfinite(v) for v in fp32 + mx)
    assert result["quantized_operands"] > 0
    assert fp32 != mx and abs(fp32[0] - mx[0]) < 0.05  # same weights and batch, quantized GEMMs
    assert result["gap"] == pytest.approx((result["final"]["mxfp8"] / result["final"]["fp32"]) - 1)
    assert "old" not in doc.read_text() and "| mxfp8 |" in doc.read_text()
    if "--plot" in args:
        assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_attention_fusion_benchmark_small_form_writes_its_block(tmp_path):
    bench = _bench("attention_fusion")
    out, doc = tmp_path / "r.json", tmp_path / "perf.md"
    doc.write_text(f"# P\n{bench.MARK}\nold\n{bench.MARK}\n")
    assert (
        bench.main(["--seq", "128", "--repeat", "1", "--json", str(out), "--write", str(doc)]) == 0
    )
    import json

    result = json.loads(out.read_text())
    assert result["peak_unfused"] > 0 and result["time_fused_s"] > 0
    # at 128 the scores are 8 x 128 x 128: the unfused HLO has them, the fused one does not need to
    assert result["hlo_unfused"][0] >= result["hlo_fused"][0]
    assert "old" not in doc.read_text() and "peak memory of a step" in doc.read_text()


def test_comm_overlap_benchmark_tiny_run_measures_all_three_variants(tmp_path):
    import json

    bench = _bench("comm_overlap")
    out, doc = tmp_path / "r.json", tmp_path / "perf.md"
    doc.write_text(f"# P\n{bench.MARK}\nold\n{bench.MARK}\n")
    argv = [
        "--layers",
        "1",
        "--width",
        "64",
        "--batch",
        "2",
        "--seq",
        "8",
        "--steps",
        "1",
        "--rounds",
        "1",
        "--json",
        str(out),
        "--write",
        str(doc),
    ]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert set(result["step_s"]) == {"baseline", "overlap", "compute-only"}
    assert result["losses_identical"] and result["pass"]["bucketed"] > 1
    assert "old" not in doc.read_text() and "exposed communication" in doc.read_text()


@pytest.mark.slow
def test_train_job_benchmark_small_form_measures_all_three_and_writes_its_section(tmp_path):
    """benchmarks/train_job.py at its smallest: real `portable train` jobs (cpu engine) beside
    the baseline's own process, sync and async checkpoints, the data wait."""
    import json

    bench = _bench("train_job")
    out, doc = tmp_path / "r.json", tmp_path / "perf.md"
    doc.write_text("# P\n\nbefore\n")
    argv = ["--small", "--rounds", "1", "--no-xla", "--json", str(out), "--write", str(doc)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    cpu, ck = result["cpu"], result["checkpoint"]
    # how many steps of job and baseline overlap is the load's business (none, under a busy
    # suite): the ratios are the benchmark's to report, not this test's
    assert {"loop", "baseline"} <= set(cpu["samples"]) and 0 <= cpu["data_wait"] < 1
    steps, every = result["config"]["steps"], result["config"]["ckpt_every"]
    assert len(ck["sync"]["stalls_s"]) == len(ck["async"]["stalls_s"]) == steps // every
    assert ck["bytes"] > result["config"]["state_bytes"]  # the state and DCP's metadata
    text = doc.read_text()
    assert text.startswith("# P\n\nbefore\n") and bench.HEADING in text
    assert text.count(bench.MARK) == 2 and "| (b) loop blocked per checkpoint" in text


@pytest.mark.slow
def test_pipeline_bubble_benchmark_small_form_checks_the_machinery(tmp_path):
    """benchmarks/pipeline_bubble.py --small: two gloo ranks run a tiny GPT under 1F1B and
    zero-bubble; the values are finite, the formula fields present and the losses equal (to
    each other, and to the single-device step within 1e-5). Timings are not asserted."""
    import json
    import math

    bench = _bench("pipeline_bubble")
    out, doc = tmp_path / "r.json", tmp_path / "perf.md"
    doc.write_text("# P\n\nbefore\n")
    assert bench.main(["--small", "--json", str(out), "--write", str(doc)]) == 0
    result = json.loads(out.read_text())
    (row,) = result["bubble"]
    assert (row["p"], row["m"]) == (2, 4) and row["formula"] == pytest.approx(1 / 5)
    values = [row["bubble_mean"], row["diff_points"], row["step_s"]]
    values += row["bubble_per_rank"] + row["own_bubble_per_rank"] + row["busy_s_per_rank"]
    assert len(values) == 9 and all(math.isfinite(v) for v in values)
    assert row["oversubscribed"] == (result["host"]["cores"] < 2)
    assert all(0 < share <= 1.05 for share in row["on_cpu_per_rank"])
    zb = result["zero_bubble"]
    assert zb["zero-bubble"]["formula"] == pytest.approx(1 / 13)
    assert zb["losses_identical"] and zb["single_within_tol"]
    assert len(zb["1f1b"]["losses"]) == len(zb["reference_losses"]) == 3
    assert zb["1f1b"]["held_per_rank"] == [2, 1]  # 1F1B holds p - rank micro-batches
    assert all(math.isfinite(zb[s]["step_s"]) for s in ("1f1b", "zero-bubble"))
    assert len(result["host"]["loadavg_before"]) == 3
    text = doc.read_text()
    assert text.startswith("# P\n\nbefore\n") and bench.HEADING in text
    assert text.count(bench.MARK) == 2 and "| 2 | 4 |" in text
