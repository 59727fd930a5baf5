"""The `cuda` backend on a real GPU: parity, kernel bandwidth, attention vs SDPA, MX matmul.

    python benchmarks/gpu_check.py [--json OUT.json] [--write docs/performance.md]

One command for a machine with one sm_90 or sm_100 GPU, about 3 minutes on an H200. It prints:

1. parity of every example on `cuda` against `cpu`: inference, and 3 training steps (loss of
   each step, every parameter and optimizer state), through `portable.compile(..., "cuda")`
   (the per-arch kernel graph under torch.compile);
2. each Triton kernel's achieved bandwidth (bytes read + written / time) as a ratio of a
   device-to-device copy of the same number of bytes, measured in the same run;
3. the Triton attention kernel's time against PyTorch SDPA on the same inputs (causal), and on
   the case SDPA cannot take directly (padding mask + causal, given to SDPA as one merged mask);
4. the MX matmul: native block-scaled `torch._scaled_mm` on sm_100 against the dequantize ->
   matmul emulation (on sm_90, emulation only: the arch has no MX);
5. the `.pt2` written by `portable lower` loaded and run on the GPU, against `cpu`.

`--dry-run` runs the same code paths on CPU with tiny sizes (Triton kernels in the interpreter;
needs TRITON_INTERPRET=1 before Python starts): that is how CI keeps this script working.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import portable

REPO = Path(__file__).resolve().parents[1]
MARK = "<!-- gpu_check -->"
EXAMPLES = {"mlp": "MLP", "cnn": "CNN", "gpt": "GPT", "llama": "Llama", "moe": "MoE"}
STEPS = 3
INFERENCE_TOL = {"rtol": 1e-4, "atol": 1e-5}  # TF32 is off; Triton softmax vs ATen: ulps
TRAINING_TOL = {"rtol": 1e-3, "atol": 1e-4}  # GPU reductions sum in another order than CPU


class Bench:
    """Timing on the device (CUDA events through triton.testing.do_bench), or wall clock on CPU."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)

    def time_ms(self, fn: Callable[[], Any]) -> float:
        if self.device.type == "cuda":
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=25, rep=100))
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    def copy_ms(self, nbytes: int) -> float:
        """A device-to-device copy of `nbytes` (read nbytes/2 + write nbytes/2)."""
        src = torch.empty(max(nbytes // 2, 1), dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        return self.time_ms(lambda: dst.copy_(src))


# -- 1. parity ---------------------------------------------------------------------------------


def _spec(stem: str) -> portable.ModelSpec:
    name = f"_gpu_check_{stem}"
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return portable.spec_of(getattr(module, EXAMPLES[stem]))


@contextlib.contextmanager
def _cuda_backend(dry_run: bool) -> Iterator[str]:
    """The backend name parity runs on: `cuda`, or for a dry run a cuda backend that runs on
    CPU, registered only while the check runs."""
    if not dry_run:
        yield "cuda"
        return
    from portable.backends import registry
    from portable.backends.cuda import CudaBackend, CudaOptions

    class CpuInterpretedCuda(CudaBackend):
        name = "cuda-dry-run"

        def __init__(self, options=None) -> None:
            super().__init__(CudaOptions(device="cpu", torch_compile=False))

    with registry.temporarily(CpuInterpretedCuda.name, CpuInterpretedCuda):
        yield CpuInterpretedCuda.name


def parity(stems: list[str], backend: str, budget_s: float) -> list[dict[str, Any]]:
    from portable.testing import check_parity

    rows, start = [], time.perf_counter()
    for stem in stems:
        for kind in ("inference", "training"):
            if time.perf_counter() - start > budget_s:
                rows.append({"model": stem, "kind": kind, "ok": None, "note": "time budget"})
                continue
            spec = _spec(stem)
            torch.manual_seed(0)
            training = kind == "training"
            program = portable.capture_spec(spec, training=training)
            inputs = spec.batch() if training else spec.inputs()
            tol = TRAINING_TOL if training else INFERENCE_TOL
            t0 = time.perf_counter()
            report = check_parity(
                program, inputs, backends=[backend], steps=STEPS if training else 1, **tol
            )
            mine = [r for r in report.rows if r.backend == backend]
            rows.append(
                {
                    "model": stem,
                    "kind": kind,
                    "ok": bool(report.ok) and bool(mine),
                    "compared": len(mine),
                    "max_abs": max((r.max_abs for r in mine), default=float("nan")),
                    "max_rel": max((r.max_rel for r in mine), default=float("nan")),
                    "seconds": time.perf_counter() - t0,
                }
            )
    return rows


# -- 2. kernel bandwidth -----------------------------------------------------------------------


def _half(dry_run: bool) -> torch.dtype:
    """bf16 on the GPU; fp16 in the dry run (Triton's interpreter cannot run a bf16 tl.dot)."""
    return torch.float16 if dry_run else torch.bfloat16


def _kernel_cases(device: torch.device, dry_run: bool) -> list[tuple[str, Callable, int]]:
    """(label, call, bytes read + written) for every Triton kernel of the backend."""
    from portable.backends.cuda import dispatch

    n = 1 << (12 if dry_run else 25)  # 32 Mi fp32 = 128 MiB
    rows, cols = (8, 64) if dry_run else (16384, 4096)
    x = torch.randn(n, device=device) * 4
    cases = []
    for fmt in ("e4m3", "e2m1"):
        codes, scales = dispatch.mx_quantize(x, fmt, 0, "rceil", 32)
        moved_q = x.numel() * 4 + codes.numel() + scales.numel()
        cases.append(
            (f"mx_quantize {fmt} rceil, {x.numel() * 4 >> 20} MiB fp32",
             lambda fmt=fmt: dispatch.mx_quantize(x, fmt, 0, "rceil", 32), moved_q)
        )  # fmt: skip
        cases.append(
            (f"mx_dequantize {fmt} -> fp32",
             lambda c=codes, s=scales, fmt=fmt: dispatch.mx_dequantize(c, s, fmt, 0, torch.float32, 32),
             moved_q)
        )  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16):
        s = torch.randn(rows, cols, device=device, dtype=dtype)
        mask = torch.randn(cols, device=device, dtype=dtype)
        moved = 2 * s.numel() * s.element_size() + mask.numel() * mask.element_size()
        cases.append(
            (f"scale_mask_softmax {rows}x{cols} {str(dtype)[6:]}",
             lambda s=s, mask=mask: dispatch.scale_mask_softmax(s, mask, 0.125, -1), moved)
        )  # fmt: skip
    b, h, seq, d = (1, 2, 64, 32) if dry_run else (4, 16, 2048, 128)
    q, k, v = (torch.randn(b, h, seq, d, device=device, dtype=_half(dry_run)) for _ in range(3))
    moved = 4 * q.numel() * q.element_size()
    cases.append(
        (f"attention causal b{b} h{h} L{seq} d{d} {str(q.dtype)[6:]}",
         lambda: dispatch.attention(q, k, v, None, True, None), moved)
    )  # fmt: skip
    return cases


def bandwidth(bench: Bench, dry_run: bool) -> list[dict[str, Any]]:
    out = []
    for label, call, nbytes in _kernel_cases(bench.device, dry_run):
        kernel_ms = bench.time_ms(call)
        copy_ms = bench.copy_ms(nbytes)
        out.append(
            {
                "kernel": label,
                "bytes": nbytes,
                "kernel_ms": kernel_ms,
                "GB_per_s": nbytes / kernel_ms / 1e6,
                "copy_GB_per_s": nbytes / copy_ms / 1e6,
                "vs_copy": copy_ms / kernel_ms,  # 1.0 = as fast as a copy of the same bytes
            }
        )
    return out


# -- 3. attention vs SDPA ----------------------------------------------------------------------


def _attention_calls(q, k, v, keep, merged) -> list[tuple[str, Callable, Callable]]:
    import torch.nn.functional as F

    from portable.backends.cuda import dispatch

    return [
        (
            "causal",
            lambda: dispatch.attention(q, k, v, None, True, None),
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        ),
        (
            "padding mask + causal",
            lambda: dispatch.attention(q, k, v, keep, True, None),
            lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=merged),
        ),
    ]


def attention_vs_sdpa(bench: Bench, dry_run: bool) -> list[dict[str, Any]]:
    shapes = (
        [(1, 2, 64, 32)] if dry_run else [(4, 16, 2048, 64), (4, 16, 2048, 128), (1, 16, 8192, 128)]
    )
    out = []
    for b, h, seq, d in shapes:
        q, k, v = (
            torch.randn(b, h, seq, d, device=bench.device, dtype=_half(dry_run)) for _ in range(3)
        )
        keep = torch.ones(b, 1, 1, seq, dtype=torch.bool, device=bench.device)
        keep[..., seq - seq // 8 :] = False  # padded keys
        causal = torch.ones(seq, seq, dtype=torch.bool, device=bench.device).tril()
        merged = keep & causal
        for case, triton_call, sdpa_call in _attention_calls(q, k, v, keep, merged):
            got, want = triton_call(), sdpa_call()
            err = float((got.float() - want.float()).abs().nan_to_num().max())
            t_ms, s_ms = bench.time_ms(triton_call), bench.time_ms(sdpa_call)
            out.append(
                {
                    "shape": f"b{b} h{h} L{seq} d{d}",
                    "case": case,
                    "triton_ms": t_ms,
                    "sdpa_ms": s_ms,
                    "triton_over_sdpa": t_ms / s_ms,
                    "max_abs_diff": err,
                }
            )
    return out


# -- 4. MX matmul ------------------------------------------------------------------------------


def mx_matmul(bench: Bench, dry_run: bool) -> dict[str, Any]:
    from portable.backends.cuda import dispatch
    from portable.backends.cuda.targets import arch_of_device

    m, n, k = (32, 32, 64) if dry_run else (8192, 8192, 8192)
    a = torch.randn(m, k, device=bench.device)
    w = torch.randn(n, k, device=bench.device)
    ca, sa = dispatch.mx_quantize(a, "e4m3", 1, "rceil", 32)
    cw, sw = dispatch.mx_quantize(w, "e4m3", 1, "rceil", 32)

    def emulated():
        da = dispatch.mx_dequantize(ca, sa, "e4m3", 1, torch.bfloat16, 32)
        dw = dispatch.mx_dequantize(cw, sw, "e4m3", 1, torch.bfloat16, 32)
        return da @ dw.t()

    record: dict[str, Any] = {"shape": f"{m}x{k} @ {k}x{n}", "emulated_ms": bench.time_ms(emulated)}
    arch = arch_of_device(bench.device)
    if arch is not None and arch.native_mx:
        native = lambda: dispatch.mx_matmul(ca, sa, cw, sw, "e4m3", torch.bfloat16)  # noqa: E731
        got, want = native().float(), emulated().float()
        record.update(
            native_ms=bench.time_ms(native),
            native_rel_err=float((got - want).norm() / want.norm()),
            path="native torch._scaled_mm (block-32 E8M0, swizzled)",
        )
    else:
        record["path"] = "emulated: this arch has no MX matmul"
    return record


# -- 5. the .pt2 on the GPU --------------------------------------------------------------------


def pt2_on_device(device: torch.device) -> list[dict[str, Any]]:
    from torch.export.passes import move_to_device_pass

    from portable.backends.cuda import load_pt2

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for stem in ("gpt", "llama"):
            spec = _spec(stem)
            program = portable.capture_spec(spec)
            portable.lower(program, "cuda", Path(tmp) / stem)
            ep = load_pt2(Path(tmp) / stem / "program.pt2")
            if device.type == "cuda":
                ep = move_to_device_pass(ep, "cuda")
            inputs = spec.inputs()
            got = ep.module()(*[t.to(device) for t in inputs])
            want = portable.compile(program, backend="cpu")(*inputs)
            err = float((got.cpu() - want).abs().max())
            out.append({"model": stem, "max_abs": err, "ok": err <= 1e-3})
    return out


# -- report ------------------------------------------------------------------------------------


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def report(result: dict[str, Any]) -> str:
    env = result["environment"]
    parts = [
        f"GPU check on {env['device']} (capability {env['capability']}), torch {env['torch']}, "
        f"triton {env['triton']}, {env['seconds']:.0f} s in all.",
        "",
        "Parity, `cuda` vs `cpu` (inference; training: 3 steps, loss and all state):",
        "",
        _table(
            result["parity"], ["model", "kind", "ok", "compared", "max_abs", "max_rel", "seconds"]
        ),
        "",
        "Triton kernels, achieved bandwidth vs a device-to-device copy of the same bytes:",
        "",
        _table(
            result["bandwidth"], ["kernel", "kernel_ms", "GB_per_s", "copy_GB_per_s", "vs_copy"]
        ),
        "",
        "Attention, Triton online-softmax kernel vs PyTorch SDPA (forward; bf16 on a GPU):",
        "",
        _table(
            result["attention"],
            ["shape", "case", "triton_ms", "sdpa_ms", "triton_over_sdpa", "max_abs_diff"],
        ),
        "",
        "MX matmul (e4m3, rceil): " + json.dumps(result["mx_matmul"]),
        "",
        "`.pt2` on the device vs `cpu`: " + json.dumps(result["pt2"]),
    ]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, interpreter")
    parser.add_argument("--examples", default=",".join(EXAMPLES), help="comma list of examples")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument("--write", type=Path, help="update this markdown file's gpu_check block")
    parser.add_argument("--budget", type=float, default=200.0, help="seconds for the parity part")
    args = parser.parse_args(argv)
    if args.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--dry-run runs Triton in its interpreter: set TRITON_INTERPRET=1")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device here (use --dry-run to check the script on CPU)")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    start = time.perf_counter()
    device = "cpu" if args.dry_run else "cuda"
    bench = Bench(device)
    import triton

    result: dict[str, Any] = {
        "environment": {
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
            "capability": ".".join(map(str, torch.cuda.get_device_capability()))
            if device == "cuda"
            else "-",
            "torch": torch.__version__,
            "triton": triton.__version__,
        }
    }
    stems = [s for s in args.examples.split(",") if s]
    with _cuda_backend(args.dry_run) as backend:
        result["parity"] = parity(stems, backend, args.budget)
    result["bandwidth"] = bandwidth(bench, args.dry_run)
    result["attention"] = attention_vs_sdpa(bench, args.dry_run)
    result["mx_matmul"] = mx_matmul(bench, args.dry_run)
    result["pt2"] = pt2_on_device(bench.device)
    result["environment"]["seconds"] = time.perf_counter() - start
    text = report(result)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.write:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from cpu_overhead import write

        write(args.write, text, MARK)
    ok = all(r["ok"] is not False for r in result["parity"]) and all(r["ok"] for r in result["pt2"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
