"""The measurement layer of `portable train` (portable/jobs/{flops,peaks,metrics,comm_stats,
trace,report}.py, `portable report`).

FLOPs are checked three ways: hand-computed counts (the MLP example), the 6*N*T rule plus the
attention term (the GPT example, exact), and torch's own FlopCounterMode on the eager model's
forward and backward (an independent counter). Run folders for the report are written here in
tmp_path with known numbers, and the report's numbers are compared with ones computed in the
test.
"""

from __future__ import annotations

import io
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import portable
from portable.cli import main
from portable.errors import JobError
from portable.ir.plan import Mesh, Plan
from portable.jobs.comm_stats import CommStats, TimedCollectives, bucket_of
from portable.jobs.flops import RECOMPUTE, program_flops
from portable.jobs.metrics import MetricsLog, ProgressBar, read_jsonl
from portable.jobs.peaks import PEAKS, detect_device, device_peak, measure_cpu_peak, mfu
from portable.jobs.report import PLOTS, report, summarize
from portable.jobs.trace import StepTracer, write_chrome_trace
from portable.parallel import column_parallel, row_parallel
from portable.passes import get_pass
from tests.support import load_spec

PNG = b"\x89PNG\r\n\x1a\n"

# --- FLOPs ----------------------------------------------------------------------------------

# MLP example: x[8, 32] -> fc1 (32 -> 64) -> gelu -> fc2 (64 -> 4)
MLP_FORWARD = 2 * 8 * 32 * 64 + 2 * 8 * 64 * 4  # two addmm
# backward: fc2's input gradient and weight gradient, fc1's weight gradient (x needs none)
MLP_BACKWARD = 2 * 8 * 4 * 64 + 2 * 4 * 8 * 64 + 2 * 64 * 8 * 32


@pytest.fixture(scope="module")
def mlp_step():
    spec = load_spec("mlp")
    torch.manual_seed(0)
    return portable.capture(
        spec.build(), spec.batch(), loss_fn=spec.loss_fn, optimizer=portable.optim.SGD(lr=0.1)
    )


@pytest.fixture(scope="module")
def gpt():
    spec = load_spec("gpt")
    torch.manual_seed(0)
    model = spec.build()
    return spec, model, portable.capture_spec(spec, training=True, model=model)


def test_mlp_flops_hand_computed(mlp_step):
    spec = load_spec("mlp")
    inference = program_flops(portable.capture_spec(spec))
    assert inference.total == MLP_FORWARD == 36864
    assert inference.by_op == {"aten.addmm.default": MLP_FORWARD}
    step = program_flops(mlp_step)
    assert step.total == MLP_FORWARD + MLP_BACKWARD == 77824
    assert step.by_op == {"aten.addmm.default": MLP_FORWARD, "aten.mm.default": MLP_BACKWARD}


def test_gpt_training_step_is_6nt_plus_attention(gpt):
    """6 x (matmul parameters) x tokens, plus 12 x layers x hidden x sequence per token for
    q @ k^T and att @ v forward and backward: exact for GPT's step, and 6NT alone is within 5%."""
    spec, model, program = gpt
    idx, _ = spec.batch()
    tokens, seq = idx.numel(), idx.shape[1]
    cfg = model.config
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    rule = 6 * n * tokens
    attention = 12 * cfg.n_layer * cfg.n_embd * seq * tokens
    count = program_flops(program)
    assert count.total == rule + attention == 21_233_664
    assert abs(count.total - rule) / rule < 0.05
    assert count.by_op["aten.bmm.default"] == attention


def test_gpt_matches_torch_flop_counter_on_eager(gpt):
    spec, model, program = gpt
    idx, targets = spec.batch()
    with FlopCounterMode(display=False) as counter:
        spec.loss_fn(model, idx, targets).backward()
    model.zero_grad(set_to_none=True)
    assert program_flops(program).total == counter.get_total_flops()


def test_fused_attention_counts_the_same(gpt):
    """softmax-fusion turns q @ k^T ... @ v into portable::attention (+ its backward): the
    count is unchanged, now under the attention ops (backward twice the forward)."""
    _, _, program = gpt
    fused = get_pass("softmax-fusion").apply(program).program
    count, plain = program_flops(fused), program_flops(program)
    assert count.total == plain.total
    forward = count.by_op["portable.attention.default"]
    assert count.by_op["portable.attention_backward.default"] == 2 * forward
    assert forward + 2 * forward == plain.by_op["aten.bmm.default"]


def test_remat_recomputation_is_not_model_flops(gpt):
    spec, model, program = gpt
    full = portable.capture(
        model, spec.batch(), loss_fn=spec.loss_fn, optimizer=spec.optimizer, remat="full"
    )
    count, plain = program_flops(full), program_flops(program)
    assert count.total == plain.total
    # the blocks' forward GEMMs the backward reads again: qkv, attn.proj, mlp.fc, both bmm
    c = model.config
    tokens = spec.batch()[0].numel()
    per_block = 2 * tokens * c.n_embd * (3 * c.n_embd + c.n_embd + 4 * c.n_embd)
    per_block += 2 * 2 * tokens * spec.batch()[0].shape[1] * c.n_embd
    assert count.by_op[RECOMPUTE] == c.n_layer * per_block
    assert RECOMPUTE not in plain.by_op


def test_saved_program_counts_from_its_tensor_specs(mlp_step, tmp_path):
    loaded = portable.load(mlp_step.save(tmp_path / "mlp.portable"))
    assert all("val" not in n.meta for n in loaded.graph.nodes)
    assert program_flops(loaded) == program_flops(mlp_step)


def test_per_rank_program_counts_per_rank(mlp_step):
    plan = Plan(Mesh({"tp": 2}), rules=(*column_parallel("fc1"), *row_parallel("fc2")))
    per_rank = get_pass("spmd-partition").apply(mlp_step.replace(plan=plan)).program
    assert per_rank.is_per_rank
    assert program_flops(per_rank).total * 2 == program_flops(mlp_step).total


def test_dynamic_dims_need_values(tmp_path):
    spec = load_spec("mlp")
    batch = torch.export.Dim("batch", min=2, max=64)
    program = portable.capture(spec.build(), spec.inputs(), dynamic_shapes=({0: batch},))
    assert program_flops(program).total == MLP_FORWARD  # the example's size (the SymInt's hint)
    loaded = portable.load(program.save(tmp_path / "dyn.portable"))
    symbol = str(loaded.signature.inputs[-1].spec.shape[0])
    with pytest.raises(JobError, match=f"dynamic dim {symbol} has no value"):
        program_flops(loaded)
    assert program_flops(loaded, dims={symbol: 4}).total == MLP_FORWARD // 2


class _Convs(nn.Module):
    def __init__(self, groups: int = 1) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 4, 3, stride=2, groups=groups)
        self.t = nn.ConvTranspose2d(4, 2, 2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.t(F.relu(self.c2(F.relu(self.c1(x))))).mean()


def test_convolution_forward_and_backward():
    """Against torch's FlopCounterMode (no groups), and by hand for a grouped conv: each
    gradient asked for costs one forward (torch's grad-weight formula counts a grouped conv's
    weight gradient `groups` times)."""
    x = torch.randn(2, 3, 9, 9)
    sgd = portable.optim.SGD(lr=0.1)
    model = _Convs()
    program = portable.capture(model, (x,), loss_fn=lambda m, x: m(x), optimizer=sgd)
    with FlopCounterMode(display=False) as counter:
        model(x).backward()
    assert program_flops(program).total == counter.get_total_flops()
    grouped = portable.capture(_Convs(groups=2), (x,), loss_fn=lambda m, x: m(x), optimizer=sgd)
    c1 = 2 * (8 * 3 * 3 * 3) * 2 * 9 * 9  # 2 * numel(w) * N * output positions
    c2 = 2 * (4 * 4 * 3 * 3) * 2 * 4 * 4
    t = 2 * (4 * 2 * 2 * 2) * 2 * 4 * 4  # transposed: input positions
    count = program_flops(grouped)
    assert count.by_op["aten.convolution.default"] == c1 + c2 + t
    # c1: weight gradient only (x needs none); c2 and t: input and weight gradients
    assert count.by_op["aten.convolution_backward.default"] == c1 + 2 * c2 + 2 * t


# --- peaks and MFU --------------------------------------------------------------------------


def test_peak_table():
    assert set(PEAKS) == {"trn1", "trn2", "trn3", "h100", "h200", "b200", "gb200"}
    for kind, peak in PEAKS.items():
        assert peak.kind == kind and peak.source
        assert peak.flops and all(math.isfinite(v) and v > 0 for v in peak.flops.values())
        assert {"float32", "bfloat16"} <= set(peak.flops)
        assert peak.flops["bfloat16"] > peak.flops["float32"]
        assert peak.hbm_bytes is not None and peak.hbm_bytes > 0
    # hardware.md's rows (dense): Trn3 has about half GB200's BF16 rate, MXFP8 above its BF16
    assert PEAKS["trn3"].flops["bfloat16"] == 671e12 and PEAKS["trn3"].flops["mxfp8"] == 2517e12
    assert PEAKS["trn2"].flops["float8"] == 1299e12 and "mxfp8" not in PEAKS["trn2"].flops
    assert PEAKS["h100"].flops["bfloat16"] == 989e12 and "mxfp8" not in PEAKS["h100"].flops
    assert PEAKS["gb200"].flops["bfloat16"] == 2.5e15 and PEAKS["b200"].flops["mxfp4"] == 9e15
    assert PEAKS["trn3"].hbm_bytes == 144 << 30
    assert device_peak("H100") is PEAKS["h100"]
    assert PEAKS["b200"].rate("bf16") == 2.25e15
    assert PEAKS["trn3"].rate(torch.float8_e4m3fn) == PEAKS["trn3"].rate("float8") == 2517e12


def test_unknown_device_kind_lists_known():
    with pytest.raises(JobError, match="no peak FLOP rate is known for device 'a100'") as exc:
        device_peak("a100")
    assert "trn3" in str(exc.value) and "gb200" in str(exc.value) and "cpu" in str(exc.value)
    with pytest.raises(JobError, match="h100 has no peak rate for 'mxfp4'"):
        PEAKS["h100"].rate("mxfp4")


def test_measured_cpu_peak():
    rate = measure_cpu_peak(torch.float32, seconds=0.05)
    assert math.isfinite(rate) and 1e8 < rate < 1e14
    start = time.perf_counter()
    assert measure_cpu_peak(torch.float32) == rate  # cached for this process
    assert time.perf_counter() - start < 0.01
    cpu = device_peak("cpu")
    assert cpu.flops == {"float32": rate} and "measured" in cpu.source


def test_detect_device():
    assert detect_device("cpu") == detect_device("xla") == "cpu"
    assert detect_device("neuron") == "trn3"
    assert detect_device("neuron:trn2") == "trn2"
    with pytest.raises(JobError, match="unknown Trainium target 'neuron:trn9'"):
        detect_device("neuron:trn9")
    if not torch.cuda.is_available():
        with pytest.raises(JobError, match="torch sees no CUDA device"):
            detect_device("cuda")


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA GB200", "gb200"),
    ],
)
def test_detect_cuda_device_by_name(monkeypatch, name, kind):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    assert detect_device("cuda") == kind


def test_unknown_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-40GB")
    with pytest.raises(JobError, match="no peak FLOP rate is known for GPU 'NVIDIA A100"):
        detect_device("cuda")


def test_mfu_arithmetic():
    # 6e12 FLOPs in 0.5 s on 4 devices of 10 TFLOP/s: 6e12 / (0.5 * 10e12 * 4) = 0.3
    assert mfu(6e12, 0.5, 10e12, 4) == pytest.approx(0.3)
    assert mfu(0, 1.0, 1e12, 1) == 0.0
    with pytest.raises(JobError, match=r"step_time_s=0.0.*devices=0"):
        mfu(1e12, 0.0, 1e12, 0)
    with pytest.raises(JobError, match="flops_per_step=nan"):
        mfu(math.nan, 1.0, 1e12, 1)


# --- metrics.jsonl and the progress bar ------------------------------------------------------


def test_metrics_log_appends_flushed_lines(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    log = MetricsLog(path)
    log.write({"step": 1, "loss": 2.5, "grad_norm": None})
    assert read_jsonl(path) == [{"step": 1, "loss": 2.5, "grad_norm": None}]  # flushed already
    log.write({"step": 2, "loss": math.nan, "lr": math.inf})
    log.close()
    assert read_jsonl(path)[1] == {"step": 2, "loss": None, "lr": None}  # JSON has no NaN
    with pytest.raises(JobError, match="was closed"):
        log.write({"step": 3})


def test_metrics_log_resume_drops_steps_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsLog(path) as log:
        for k in range(1, 8):
            log.write({"step": k, "loss": 1.0 / k})
    with path.open("a") as f:
        f.write('{"step": 8, "loss": 0.1')  # killed mid-line
    with MetricsLog(path, resume_after=5) as log:
        log.write({"step": 6, "loss": 0.5})
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4, 5, 6]
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary left


def test_metrics_log_repairs_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo')
    assert read_jsonl(path) == [{"step": 1}]  # a torn last line is left out
    with MetricsLog(path) as log:  # and dropped before appending
        log.write({"step": 2})
    assert path.read_text() == '{"step":1}\n{"step":2}\n'


def test_read_jsonl_refuses_bad_files(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n[1, 2]\n{"step": 3}\n')
    with pytest.raises(JobError, match=r"m.jsonl:2 is a list, not an object"):
        read_jsonl(path)
    path.write_text('{"step": 1}\n{"step": 2\n{"step": 3}\n')
    with pytest.raises(JobError, match=r"m.jsonl:2 is not valid JSON"):
        read_jsonl(path)
    path.write_text('{"step": 1, "loss": NaN, "note": "NaN here"}\n')  # Python's json.dumps
    assert read_jsonl(path) == [{"step": 1, "loss": None, "note": "NaN here"}]
    path.write_text('{"step": 1}\n' * 100)
    with pytest.raises(JobError, match="is over 64 bytes"):
        read_jsonl(path, max_bytes=64)
    link = tmp_path / "link.jsonl"
    link.symlink_to(path)
    with pytest.raises(JobError, match="cannot read .*link.jsonl"):
        read_jsonl(link)
    os.mkfifo(tmp_path / "fifo")  # opened without blocking, refused
    with pytest.raises(JobError, match="fifo is not a regular file"):
        read_jsonl(tmp_path / "fifo")


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal_only():
    tty = _Tty()
    bar = ProgressBar(10, start=0, stream=tty)
    assert bar.enabled
    bar.update(10, loss=2.0, tokens_per_s=12345.0, mfu=0.312, grad_norm=None)
    bar.close()
    text = tty.getvalue()
    assert text.startswith("\rstep 10/10 [####################]") and text.endswith("\n")
    assert "loss 2" in text and "tok/s 12.3k" in text and "mfu 31.2%" in text
    assert "eta 0s" in text and "grad_norm" not in text
    line = bar.line(3, {"eta": 125.0})
    assert "[######..............]" in line and "eta 2m05s" in line
    pipe = io.StringIO()  # not a terminal: nothing at all
    quiet = ProgressBar(10, stream=pipe)
    quiet.update(1, loss=1.0)
    quiet.close()
    assert not quiet.enabled and pipe.getvalue() == ""


# --- collectives ----------------------------------------------------------------------------


def test_comm_stats_buckets_and_percentiles():
    stats = CommStats()
    for ms in range(1, 101):  # 1..100 ms, 1000-byte messages: bucket 2^9 (512 <= 1000 < 1024)
        stats.record("all_reduce", 1000, ms / 1000, ms / 2000)
    stats.record("all_reduce", 1 << 20, 0.5, 0.0)
    stats.record("all_gather", 0, 1e-7, 1e-7)
    doc = stats.to_json()
    assert bucket_of(1000) == 9 and bucket_of(1 << 20) == 20 and bucket_of(0) == 0
    op = doc["ops"]["all_reduce"]
    assert op["count"] == 101 and op["bytes"] == 100 * 1000 + (1 << 20)
    assert set(op["buckets"]) == {"2^9", "2^20"}
    b = op["buckets"]["2^9"]
    assert b["count"] == 100
    assert (b["p50_s"], b["p99_s"], b["max_s"]) == (0.050, 0.099, 0.100)
    assert b["total_s"] == pytest.approx(sum(range(1, 101)) / 1000)
    # latency histogram: 1 ms = 1000 us is in [2^9, 2^10) us, 100 ms in [2^16, 2^17)
    assert set(b["latency_us"]) == {f"2^{j}" for j in range(9, 17)}
    assert sum(b["latency_us"].values()) == 100
    assert doc["ops"]["all_gather"]["buckets"]["2^0"]["latency_us"] == {"2^0": 1}
    assert doc["exposed_s"] == pytest.approx(sum(range(1, 101)) / 2000 + 1e-7)
    comm, exposed = stats.step_totals()
    assert comm == pytest.approx(doc["comm_s"]) and exposed == pytest.approx(doc["exposed_s"])
    assert stats.step_totals() == (0.0, 0.0)  # since the last call
    json.dumps(doc, allow_nan=False)
    with pytest.raises(JobError, match="must be non-negative"):
        stats.record("all_reduce", 8, -1.0, 0.0)


def test_comm_stats_memory_is_bounded():
    stats = CommStats(sample=16)
    for i in range(2000):
        stats.record("all_reduce", 64, (i % 100 + 1) / 1000, 0.0)
    bucket = stats._ops["all_reduce"][6]
    assert len(bucket.sample) == 16 and bucket.count == 2000
    b = stats.to_json()["ops"]["all_reduce"]["buckets"]["2^6"]
    assert 0.001 <= b["p50_s"] <= b["p99_s"] <= b["max_s"] == 0.1


class _SleepyRuntime:
    """A CollectiveRuntime of one rank: each collective returns at once (the transfer in
    flight), `wait` blocks WAIT_S, as torch's functional collectives do."""

    WAIT_S = 0.02
    mesh = "mesh of one"

    def __init__(self) -> None:
        self.waited: list[int] = []

    def _issue(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    def all_reduce(self, x, reduce_op, axis, group_size):
        return self._issue(x)

    def all_gather(self, x, dim, axis, group_size):
        return self._issue(torch.cat([x] * group_size, dim))

    def reduce_scatter(self, x, reduce_op, dim, axis, group_size):
        return self._issue(x.chunk(group_size, dim)[0])

    def all_to_all(self, x, split_dim, concat_dim, axis, group_size):
        return self._issue(x)

    def local_shard(self, x, dim, axis, group_size):
        return x.chunk(group_size, dim)[0].clone()

    def wait(self, x):
        time.sleep(self.WAIT_S)
        self.waited.append(id(x))
        return x


def test_timed_collectives_latency_and_exposed_time():
    stats = CommStats()
    inner = _SleepyRuntime()
    timed = TimedCollectives(inner, stats)
    x = torch.ones(256)  # 1 KiB
    pending = timed.all_reduce(x, "sum", "dp", 2)
    time.sleep(0.03)  # compute overlapped with the transfer: not exposed
    assert torch.equal(timed.wait(pending), x)
    gathered = timed.wait(timed.all_gather(torch.ones(4, 8), 0, "dp", 2))  # 128 bytes
    assert gathered.shape == (8, 8)
    assert timed.local_shard(x, 0, "dp", 2).shape == (128,)  # no communication: not recorded
    assert timed.mesh == "mesh of one"  # everything else is the inner runtime's
    ops = stats.to_json()["ops"]
    assert set(ops) == {"all_reduce", "all_gather"}
    reduce = ops["all_reduce"]["buckets"]["2^10"]
    assert reduce["count"] == 1
    assert reduce["max_s"] >= 0.05  # issue -> wait done: the overlap and the wait
    exposed = ops["all_reduce"]["exposed_s"]
    assert _SleepyRuntime.WAIT_S <= exposed < reduce["max_s"] - 0.025
    assert ops["all_gather"]["buckets"]["2^7"]["count"] == 1
    comm, exposed_total = stats.step_totals()
    assert comm >= 0.07 and exposed_total >= 2 * _SleepyRuntime.WAIT_S
    assert len(inner.waited) == 2 and not timed._pending


# --- traces ---------------------------------------------------------------------------------


def test_step_tracer_writes_chrome_traces_of_chosen_steps(tmp_path):
    tracer = StepTracer(tmp_path / "traces", rank=1, steps={2})
    with tracer.step(1):
        torch.mm(torch.ones(8, 8), torch.ones(8, 8))
    with tracer.step(2):
        torch.mm(torch.ones(8, 8), torch.ones(8, 8))
    tracer.close()
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == ["rank1-step2.json"]
    doc = json.loads((tmp_path / "traces" / "rank1-step2.json").read_text())
    names = {e.get("name") for e in doc["traceEvents"]}
    assert "step 2" in names and "aten::mm" in names
    assert any(e.get("ph") == "X" for e in doc["traceEvents"])


def test_write_chrome_trace(tmp_path):
    path = tmp_path / "traces" / "rank0-step3.json"
    events = [
        {"name": "step 3", "ts_us": 0, "dur_us": 1500.0, "tid": 0},
        {"name": "all_reduce", "ts_us": 100, "dur_us": 20, "tid": 1, "args": {"bytes": 64}},
    ]
    write_chrome_trace(path, events, pid=3)
    doc = json.loads(path.read_text())
    assert doc["traceEvents"][1] == {
        "name": "all_reduce",
        "ph": "X",
        "ts": 100,
        "dur": 20,
        "pid": 3,
        "tid": 1,
        "args": {"bytes": 64},
    }
    with pytest.raises(JobError, match="trace event 0 is not"):
        write_chrome_trace(path, [{"name": "x", "ts_us": 0, "dur_us": -1, "tid": 0}])
    assert json.loads(path.read_text()) == doc  # the failed write left the old file
    assert sorted(p.name for p in path.parent.iterdir()) == ["rank0-step3.json"]


# --- the report -----------------------------------------------------------------------------

STEPS = 10
STEP_TIME = [3.0, 1.5] + [1.0 + 0.01 * k for k in range(3, STEPS + 1)]  # seconds, steps 1..10
TOKENS_PER_STEP = 1024


def _step_record(k: int) -> dict:
    t = STEP_TIME[k - 1]
    return {
        "step": k,
        "loss": 4.0 / k,
        "lr": 1e-3 * min(1.0, k / 4),
        "grad_norm": 1.0,
        "loss_scale": None,
        "step_time_s": t,
        "tokens_per_s": TOKENS_PER_STEP / t,
        "mfu": 0.1 + 0.01 * k,
        "data_wait_s": 0.05,
        "comm_s": 0.2,
        "exposed_comm_s": 0.1,
        "memory_bytes": 1000 * k,
        "time_s": sum(STEP_TIME[:k]),
    }


def _write_run(run: Path, *, with_comm: bool = True, summary: dict | None = None) -> None:
    run.mkdir(parents=True)
    with MetricsLog(run / "metrics.jsonl") as log:
        for k in range(1, STEPS + 1):
            log.write(_step_record(k))
    evals = [(5, 1.2, 5 * TOKENS_PER_STEP, 8.0), (10, 0.7, 10 * TOKENS_PER_STEP, 14.0)]
    with MetricsLog(run / "eval.jsonl") as log:
        for step, loss, tokens, t in evals:
            log.write({"step": step, "eval_loss": loss, "tokens": tokens, "time_s": t})
    events = [
        {"time_s": 0.0, "event": "start"},
        {"time_s": 6.0, "event": "checkpoint", "step": 5},
        {"time_s": 7.0, "event": "restart", "rank": 1, "reason": "killed | by a drill"},
        {"time_s": 7.5, "event": "resume", "step": 5},
    ]
    with MetricsLog(run / "events.jsonl") as log:
        for e in events:
            log.write(e)
    (run / "ranks").mkdir()
    for rank in (0, 1):
        stats = CommStats()
        if with_comm:
            for i in range(10):
                stats.record("all_reduce", 4096, 0.001 * (i + 1) * (rank + 1), 0.0005)
            stats.record("all_gather", 100, 0.002, 0.002)
        doc = {
            "rank": rank,
            "steps": list(range(1, STEPS + 1)),
            "step_time_s": [t + 0.01 * rank for t in STEP_TIME],
            "data_wait_s": [0.05] * STEPS,
            "comm": stats.to_json(),
        }
        (run / "ranks" / f"rank{rank}.json").write_text(json.dumps(doc))
    job = {
        "config": {"spec": "examples/gpt.py:GPT", "steps": STEPS, "target_loss": 1.0},
        "summary": {
            "tokens": STEPS * TOKENS_PER_STEP,
            "wall_s": 20.0,
            "steps": STEPS,
            "device": {"kind": "cpu", "count": 2, "peak_flops": 1e11},
            "price_per_hour": 36.0,
            "target_loss": 1.0,
            **(summary or {}),
        },
        "prediction": {"step_time_s": 0.8, "memory_bytes": 20000},
    }
    (run / "job.json").write_text(json.dumps(job))


def test_report_of_a_run(tmp_path):
    run = tmp_path / "run"
    _write_run(run)
    path = report(run)
    out = run / "report"
    assert path == out / "summary.md"
    assert sorted(p.name for p in out.iterdir()) == sorted([*PLOTS, "summary.md", "summary.json"])
    for name in PLOTS:
        assert (out / name).read_bytes()[:8] == PNG, name

    steady = STEP_TIME[2:]  # steps 3..10
    mean_step = statistics.fmean(steady)
    s = json.loads((out / "summary.json").read_text())
    assert s["steps"] == STEPS and s["steady_steps"] == 8
    assert s["final_loss"] == pytest.approx(0.4)
    assert s["tokens"] == STEPS * TOKENS_PER_STEP and s["wall_s"] == 20.0
    assert s["mean_step_time_s"] == pytest.approx(mean_step)
    assert s["mean_tokens_per_s"] == pytest.approx(statistics.fmean(1024 / t for t in steady))
    assert s["mean_mfu"] == pytest.approx(statistics.fmean(0.1 + 0.01 * k for k in range(3, 11)))
    assert s["data_wait_pct"] == pytest.approx(100 * 0.05 * 8 / sum(steady))
    assert s["exposed_comm_pct"] == pytest.approx(100 * 0.1 * 8 / sum(steady))
    assert s["peak_memory_bytes"] == 10000
    # eval and target: 1.0 is first reached by the eval at step 10 (0.7), 14 s in
    assert (s["final_eval_loss"], s["best_eval_loss"], s["best_eval_step"]) == (0.7, 0.7, 10)
    assert s["target_reached"] is True
    assert (s["time_to_target_s"], s["tokens_to_target"]) == (14.0, 10 * TOKENS_PER_STEP)
    # $36 an hour is $0.01 a second
    assert s["cost_per_step"] == pytest.approx(0.01 * mean_step)
    assert s["cost_to_target"] == pytest.approx(0.14)
    assert s["cost_total"] == pytest.approx(0.2)
    assert s["events"]["counts"] == {"checkpoint": 1, "restart": 1, "resume": 1, "start": 1}
    assert [e["event"] for e in s["events"]["recovery"]] == ["restart", "resume"]
    reduce = s["comm"]["all_reduce"]["2^12"]
    assert (reduce["count"], reduce["ranks"]) == (20, 2)
    assert reduce["p50_s"] == pytest.approx(0.010) and reduce["max_s"] == pytest.approx(0.020)
    prediction = {r["quantity"]: r for r in s["prediction"]}
    assert prediction["step_time_s"]["measured_over_predicted"] == pytest.approx(mean_step / 0.8)
    assert prediction["memory_bytes"]["measured"] == 10000

    md = path.read_text()
    assert f"| mean step time | {mean_step:.4g} s |" in md
    assert "| final loss | 0.4 |" in md and "| tokens | 10240 |" in md
    assert f"| data wait | {100 * 0.4 / sum(steady):.1f}% |" in md
    assert f"| exposed communication | {100 * 0.8 / sum(steady):.1f}% |" in md
    assert "| time to target | 14 s |" in md and "| cost to target | 0.14 |" in md
    assert "| best eval loss | 0.7 at step 10 |" in md
    assert "| all_reduce | 4.0 KiB+ | 20 | 2 | 0.01 s | 0.02 s | 0.02 s |" in md
    assert "killed \\| by a drill" in md  # a | from the file does not break the table
    assert "| step_time_s | 0.8 |" in md
    assert "![loss](loss.png)" in md and "steady state: 8 steps, 2 dropped" in md

    # a second report replaces the first; the run's files are untouched
    (out / "loss.png").write_bytes(b"old")
    report(run)
    assert (out / "loss.png").read_bytes()[:8] == PNG
    assert not [p for p in run.iterdir() if p.name.startswith(".report")]


def test_report_without_comm_and_targets_from_the_files(tmp_path):
    """No collectives: no histogram. A job.json without the target figures: they come from
    eval.jsonl and the config's target_loss."""
    run = tmp_path / "run"
    _write_run(run, with_comm=False)
    job = json.loads((run / "job.json").read_text())
    job["summary"] = {"price_per_hour": 36.0}
    (run / "job.json").write_text(json.dumps(job))
    out = tmp_path / "elsewhere"
    report(run, out=out)
    assert not (out / "comm_histograms.png").exists() and (out / "loss.png").exists()
    s = summarize(run)
    assert s["comm"] == {} and s["time_to_target_s"] == 14.0 and s["wall_s"] == sum(STEP_TIME)
    assert s["cost_to_target"] == pytest.approx(0.14)
    assert s["tokens"] == pytest.approx(STEPS * TOKENS_PER_STEP)  # from tokens/s x step time


def test_report_without_matplotlib(tmp_path, monkeypatch):
    run = tmp_path / "run"
    _write_run(run)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    path = report(run)
    assert sorted(p.name for p in path.parent.iterdir()) == ["summary.json", "summary.md"]
    assert "plots need matplotlib: `pip install matplotlib`" in path.read_text()


def test_report_refuses_what_is_not_a_run(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(JobError, match="is not a training run: it has neither job.json"):
        report(tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    with pytest.raises(JobError, match="is not a folder"):
        report(tmp_path / "file")
    run = tmp_path / "run"
    _write_run(run)
    (run / "job.json").write_text("[1, 2]")
    with pytest.raises(JobError, match="expected an object, got list"):
        report(run)
    (run / "job.json").unlink()
    (run / "job.json").symlink_to(tmp_path / "file")
    with pytest.raises(JobError, match="is a symbolic link"):
        report(run)
    (run / "job.json").unlink()
    (run / "ranks" / "rank0.json").write_text('{"steps": [1, 2], "step_time_s": [1.0]}')
    with pytest.raises(JobError, match="rank0.json: steps and step_time_s must be lists"):
        report(run)
    assert not (run / "report").exists()


def test_report_refuses_an_out_folder_with_other_files(tmp_path):
    run = tmp_path / "run"
    _write_run(run)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(JobError, match="holds files a report does not write: notes.txt"):
        report(run, out=out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    with pytest.raises(JobError, match="holds files a report does not write"):
        report(run, out=run)  # the run folder itself


def test_report_cli(tmp_path, capsys):
    run = tmp_path / "run"
    _write_run(run)
    assert main(["report", str(run)]) == 0
    out, _ = capsys.readouterr()
    assert out.strip() == str(run / "report" / "summary.md")
    assert main(["report", str(run), "--out", str(tmp_path / "r"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "ok" and doc["summary_md"] == str(tmp_path / "r" / "summary.md")
    assert doc["summary"]["steps"] == STEPS and "loss.png" in doc["summary"]["plots"]
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 3
    _, err = capsys.readouterr()
    assert err.startswith("error: ") and "is not a training run" in err
    assert main(["report", str(tmp_path / "empty"), "--json"]) == 3
    assert json.loads(capsys.readouterr().out)["error"]["type"] == "JobError"


def test_metrics_written_per_step_are_what_the_report_reads(tmp_path):
    """The writer's side of the contract: a log written, resumed after a crash, read back."""
    run = tmp_path / "run"
    with MetricsLog(run / "metrics.jsonl") as log:
        for k in range(1, 6):
            log.write(_step_record(k))
    os.truncate(run / "metrics.jsonl", (run / "metrics.jsonl").stat().st_size - 5)
    with MetricsLog(run / "metrics.jsonl", resume_after=3) as log:
        for k in range(4, STEPS + 1):
            log.write(_step_record(k))
    s = summarize(run)
    assert s["steps"] == STEPS and s["last_step"] == STEPS
    assert s["mean_step_time_s"] == pytest.approx(statistics.fmean(STEP_TIME[2:]))


def test_report_of_a_minimal_run(tmp_path):
    """metrics.jsonl alone (a job still running, or killed before job.json): a report with
    what there is; step time per rank from metrics.jsonl."""
    run = tmp_path / "run"
    with MetricsLog(run / "metrics.jsonl") as log:
        log.write(_step_record(1))
        log.write(_step_record(2))
    path = report(run)
    md = path.read_text()
    assert "steady state: 2 steps, 0 dropped" in md and "| best eval loss | - |" in md
    assert f"| mean step time | {statistics.fmean(STEP_TIME[:2]):.4g} s |" in md
    assert "## Collectives" not in md and "## Configuration" not in md
    names = {p.name for p in path.parent.iterdir()}
    assert names == {*PLOTS, "summary.md", "summary.json"} - {"comm_histograms.png"}
