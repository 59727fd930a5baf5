"""Fused vs unfused attention: peak memory, time, and the largest HLO intermediate.

    python benchmarks/attention_fusion.py [--seq 2048] [--write docs/performance.md]

One causal attention layer written out by hand (q @ k^T / sqrt(d), causal mask by masked_fill,
softmax, @ v), batch 1, 8 heads, head dim 64, captured as a training step (forward + backward;
SGD with lr 0, so the update costs nothing and the weights stay put). The fused program is the
same capture after the `softmax-fusion` pass. In the same run, on the `cpu` backend:

- peak memory of one step, fused / unfused: in a fresh process per variant, the peak resident
  set while the step runs (Linux VmHWM, reset through /proc/self/clear_refs just before the
  step) minus the resident set just before it. Goal: at most 0.35;
- time of one step, fused / unfused (median after warm-up). Goal: at most 0.8;
- the largest intermediate array in the HLO the `xla` backend writes for each program (bytes),
  which shows whether an L x L tensor exists.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
MARK = "<!-- attention_fusion -->"
HEADS, HEAD_DIM = 8, 64


class CausalSelfAttention(torch.nn.Module):
    """Attention as model code writes it (no SDPA), on q/k/v projections of x."""

    def __init__(self, heads: int = HEADS, head_dim: int = HEAD_DIM) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        width = heads * head_dim
        self.qkv = torch.nn.Linear(width, 3 * width)

    def forward(self, x):
        b, seq, _ = x.shape
        q, k, v = self.qkv(x).view(b, seq, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        return out.transpose(1, 2).reshape(b, seq, -1)


def programs(seq: int):
    """(unfused, fused) training-step programs of the layer at sequence length `seq`."""
    import portable
    from portable.passes import PassManager, parse_pipeline, registry

    if "softmax-fusion" not in registry.names():
        raise SystemExit("the `softmax-fusion` pass is not registered: nothing to compare")
    torch.manual_seed(0)
    model = CausalSelfAttention()
    batch = (torch.randn(1, seq, HEADS * HEAD_DIM),)
    unfused = portable.capture(
        model,
        batch,
        loss_fn=lambda m, x: m(x).square().mean(),
        optimizer=portable.optim.SGD(lr=0.0),
    )
    fused, (report,) = PassManager(parse_pipeline("softmax-fusion")).run(unfused)
    if not report.changed:
        raise SystemExit(f"softmax-fusion found no attention: {report.summary()}")
    return unfused, fused, batch


def _step_seconds(program, batch, repeat: int) -> float:
    import portable

    exe = portable.compile(program, backend="cpu")
    exe(*batch)  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        exe(*batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


_PEAK_SCRIPT = r"""
import gc, sys
sys.path.insert(0, {bench!r})
import attention_fusion as bench
import portable
unfused, fused, batch = bench.programs({seq})
exe = portable.compile(fused if {variant!r} == "fused" else unfused, backend="cpu")
del unfused, fused
gc.collect()
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak-RSS counter (VmHWM) to the current RSS
before = status("VmRSS")
exe(*batch)
print(status("VmHWM") - before)
"""


def peak_bytes(seq: int, variant: str) -> int:
    """Peak resident memory one step adds, measured in a fresh process."""
    code = _PEAK_SCRIPT.format(bench=str(REPO / "benchmarks"), seq=seq, variant=variant)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


_SHAPE = re.compile(r"\b(f32|f16|bf16|s32|s64|pred|u8|f64)\[([0-9,]*)\]")
_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "s32": 4, "s64": 8, "pred": 1, "u8": 1, "f64": 8}


def largest_hlo_array(program) -> tuple[int, str]:
    """(bytes, "f32[1,8,2048,2048]") of the largest array in the program's xla HLO text."""
    import portable

    compiled = portable.lower(program, "xla")
    text = compiled.lowered.texts["graph.hlo.txt"]
    best = (0, "")
    for dtype, dims in _SHAPE.findall(text):
        size = math.prod(int(d) for d in dims.split(",") if d) * _BYTES[dtype]
        best = max(best, (size, f"{dtype}[{dims}]"))
    return best


def measure(seq: int, repeat: int) -> dict:
    unfused, fused, batch = programs(seq)
    result = {"seq": seq}
    result["time_unfused_s"] = _step_seconds(unfused, batch, repeat)
    result["time_fused_s"] = _step_seconds(fused, batch, repeat)
    result["peak_unfused"] = peak_bytes(seq, "unfused")
    result["peak_fused"] = peak_bytes(seq, "fused")
    result["hlo_unfused"] = largest_hlo_array(unfused)
    result["hlo_fused"] = largest_hlo_array(fused)
    result["memory_ratio"] = result["peak_fused"] / max(result["peak_unfused"], 1)
    result["time_ratio"] = result["time_fused_s"] / result["time_unfused_s"]
    return result


def table(r: dict) -> str:
    mib = 1 << 20
    return "\n".join(
        [
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, one causal attention "
            f"layer, batch 1, {HEADS} heads, head dim {HEAD_DIM}, sequence {r['seq']}, "
            "training step (forward + backward), `cpu` backend",
            "",
            "| quantity | unfused | fused | fused / unfused | goal |",
            "|---|---|---|---|---|",
            f"| peak memory of a step | {r['peak_unfused'] / mib:.1f} MiB | "
            f"{r['peak_fused'] / mib:.1f} MiB | {r['memory_ratio']:.3f} | <= 0.35: "
            f"{'met' if r['memory_ratio'] <= 0.35 else 'not met'} |",
            f"| time of a step | {r['time_unfused_s'] * 1e3:.1f} ms | "
            f"{r['time_fused_s'] * 1e3:.1f} ms | {r['time_ratio']:.3f} | <= 0.8: "
            f"{'met' if r['time_ratio'] <= 0.8 else 'not met'} |",
            f"| largest array in the xla HLO | {r['hlo_unfused'][1]} ({r['hlo_unfused'][0] / mib:.1f}"
            f" MiB) | {r['hlo_fused'][1]} ({r['hlo_fused'][0] / mib:.1f} MiB) | "
            f"{r['hlo_fused'][0] / max(r['hlo_unfused'][0], 1):.3f} | no L x L |",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--write", type=Path, help="update this markdown file's block")
    args = parser.parse_args(argv)
    result = measure(args.seq, args.repeat)
    text = table(result)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.write:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from cpu_overhead import write

        write(args.write, text, MARK)
    return 0


if __name__ == "__main__":
    sys.exit(main())
