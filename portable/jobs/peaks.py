"""Peak FLOP rates per device and number format, and model FLOPs utilization.

`PEAKS` holds one chip of each accelerator, dense rates (no structured sparsity), per number
format: `float32`, `tfloat32`, `bfloat16`, `float16`, `float8`, `mxfp8`, `mxfp4`, `float4`. A
format a chip has no rate for is absent (Hopper has no native MX: its MX GEMMs are emulated and
run at the rate of the format they dequantize to). Figures are from
shared/reference/hardware.md (AWS Neuron architecture pages, NVIDIA datasheets), except where
`source` says otherwise: Trainium1, which hardware.md does not list (AWS Neuron "Trainium
Architecture": 190 FP16/BF16/cFP8/TF32 TFLOPS, 47.5 FP32 TFLOPS, 32 GiB), and NVIDIA's FP32
(non-tensor-core) rates, from the same datasheets. `h100` is the SXM part (H100 PCIe and NVL
boards are slower; a CUDA device named H100 reads as it). The CPU has no table entry: its peak
is measured (`measure_cpu_peak`).

    MFU = model FLOPs per step / (step time x peak per device x devices)
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Mapping
from types import MappingProxyType

import torch

from ..backends.neuron.targets import DEFAULT_VARIANT
from ..errors import JobError

__all__ = ["PEAKS", "DevicePeak", "detect_device", "device_peak", "measure_cpu_peak", "mfu"]

_T = 1e12
_GIB = 1 << 30
_GB = 10**9


@dataclasses.dataclass(frozen=True)
class DevicePeak:
    """`flops`: peak FLOP/s of one device per number format; `hbm_bytes`: its memory (None when
    unknown); `source`: where the numbers come from."""

    kind: str
    flops: dict[str, float]
    hbm_bytes: int | None
    source: str

    def rate(self, number_format: str | torch.dtype) -> float:
        """The peak FLOP/s for `number_format`: a format name (`bfloat16`, `bf16`, `mxfp8`) or
        a torch dtype (`torch.float8_e4m3fn` reads as `float8`)."""
        name = str(number_format).removeprefix("torch.")
        key = _FORMAT_ALIASES.get(name, name)
        if key not in self.flops:
            raise JobError(
                f"{self.kind} has no peak rate for {number_format!r}",
                fix=f"use one of {', '.join(sorted(self.flops))}",
            )
        return self.flops[key]


_FORMAT_ALIASES = {
    "fp32": "float32",
    "tf32": "tfloat32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp8": "float8",
    "float8_e4m3fn": "float8",
    "float8_e5m2": "float8",
}

_HW = "shared/reference/hardware.md"
_NV_FP32 = "NVIDIA datasheet FP32 (not in hardware.md)"


def _trn(
    kind: str, bf16: float, fp32: float, hbm_gib: int, source: str, **fp8: float
) -> DevicePeak:
    tflops = {"float32": fp32, "tfloat32": bf16, "bfloat16": bf16, "float16": bf16, **fp8}
    return DevicePeak(kind, {k: v * _T for k, v in tflops.items()}, hbm_gib * _GIB, source)


def _gpu(kind: str, bf16: float, fp8: float, fp32: float, hbm_gb: int, **low: float) -> DevicePeak:
    flops = {"float32": fp32, "bfloat16": bf16, "float16": bf16, "float8": fp8, **low}
    source = f"{_HW} ({kind.upper()} row); float32: {_NV_FP32}"
    return DevicePeak(kind, {k: v * _T for k, v in flops.items()}, hbm_gb * _GB, source)


PEAKS: Mapping[str, DevicePeak] = MappingProxyType(
    {
        "trn1": _trn(
            "trn1",
            190,
            47.5,
            32,
            "AWS Neuron docs, Trainium Architecture (not in hardware.md)",
            float8=190,
        ),
        "trn2": _trn("trn2", 667, 181, 96, f"{_HW} (Trainium2 chip)", float8=1299),
        "trn3": _trn(
            "trn3", 671, 183, 144, f"{_HW} (Trainium3 chip)", float8=2517, mxfp8=2517, mxfp4=2517
        ),
        "h100": _gpu("h100", 989, 1979, 67, 80),
        "h200": _gpu("h200", 989, 1979, 67, 141),
        "b200": _gpu("b200", 2250, 4500, 75, 180, mxfp8=4500, mxfp4=9000, float4=9000),
        "gb200": _gpu("gb200", 2500, 5000, 80, 186, mxfp8=5000, mxfp4=10000, float4=10000),
    }
)


def device_peak(kind: str) -> DevicePeak:
    """The peak of one device of `kind` (a PEAKS key, or `cpu`: measured on this process)."""
    name = kind.strip().lower()
    if name == "cpu":
        rate = measure_cpu_peak(torch.float32)
        threads = torch.get_num_threads()
        source = f"measured: best timed float32 square matmul on {threads} thread(s)"
        return DevicePeak("cpu", {"float32": rate}, None, source)
    if name not in PEAKS:
        raise JobError(
            f"no peak FLOP rate is known for device {kind!r}",
            fix=f"use one of {', '.join(['cpu', *PEAKS])}",
        )
    return PEAKS[name]


_MEASURED: dict[tuple[torch.dtype, int], float] = {}  # (dtype, threads) -> FLOP/s, this process


def measure_cpu_peak(dtype: torch.dtype = torch.float32, *, seconds: float = 0.3) -> float:
    """This process's best matmul rate (FLOP/s) for `dtype` on its torch threads: square
    matmuls (n from 1024, grown until one takes 10 ms or more, at most 2048) timed for about
    `seconds`, the fastest taken. Measured once per dtype and thread count per process."""
    key = (dtype, torch.get_num_threads())
    if key not in _MEASURED:
        _MEASURED[key] = _measure(dtype, seconds)
    return _MEASURED[key]


def _measure(dtype: torch.dtype, seconds: float) -> float:
    # n from 1024, grown until one matmul takes 10 ms: on small matmuls waking a thread pool
    # (several threads on few cores) costs more than the arithmetic and the rate reads 100x low
    n = 1024
    while True:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        _time_once(a, b)  # warm: the pool is up, the pages touched
        best = _time_once(a, b)
        if best >= 1e-2 or n >= 2048:
            break
        n *= 2
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        best = min(best, _time_once(a, b))
    return 2.0 * n**3 / best


def _time_once(a: torch.Tensor, b: torch.Tensor) -> float:
    start = time.perf_counter()
    torch.mm(a, b)
    return max(time.perf_counter() - start, 1e-9)


_GPU_NAMES = (("gb200", "gb200"), ("b200", "b200"), ("h200", "h200"), ("h100", "h100"))


def detect_device(engine: str) -> str:
    """The device kind a job on `engine` runs on: `cpu` for the cpu and xla engines (XLA:CPU
    here), the CUDA device's name on cuda (`h100`, `h200`, `b200`, `gb200`), the Trainium
    generation on `neuron[:trnN]` (trn3 by default). JobError for a GPU without a peak entry."""
    name, _, variant = engine.strip().lower().partition(":")
    if name in ("cpu", "xla"):
        return "cpu"
    if name == "neuron":
        kind = variant or DEFAULT_VARIANT
        if kind not in PEAKS:
            raise JobError(f"unknown Trainium target {engine!r}", fix="use neuron:trn1|trn2|trn3")
        return kind
    if name == "cuda":
        return _cuda_kind()
    raise JobError(f"unknown engine {engine!r}", fix="use cpu, xla, cuda or neuron")


def _cuda_kind() -> str:
    if not torch.cuda.is_available():
        raise JobError("engine cuda, but torch sees no CUDA device", fix="run on a GPU machine")
    gpu = torch.cuda.get_device_name()
    flat = re.sub(r"[^a-z0-9]", "", gpu.lower())
    for needle, kind in _GPU_NAMES:
        if needle in flat:
            return kind
    raise JobError(
        f"no peak FLOP rate is known for GPU {gpu!r}",
        fix=f"MFU needs one of {', '.join(k for _, k in _GPU_NAMES)}",
    )


def mfu(flops_per_step: float, step_time_s: float, peak_flops: float, devices: int) -> float:
    """Model FLOPs utilization: `flops_per_step` (the whole step, all devices) over what
    `devices` devices at `peak_flops` each could do in `step_time_s`."""
    positive = {"step_time_s": step_time_s, "peak_flops": peak_flops, "devices": devices}
    bad = [f"{k}={v}" for k, v in positive.items() if not (math.isfinite(v) and v > 0)]
    if not (math.isfinite(flops_per_step) and flops_per_step >= 0):
        bad.insert(0, f"flops_per_step={flops_per_step}")
    if bad:
        raise JobError(
            f"MFU needs finite FLOPs and positive finite times, peaks and counts: {', '.join(bad)}",
            fix="pass the step's FLOPs, a measured step time, a device peak and a device count",
        )
    return flops_per_step / (step_time_s * peak_flops * devices)
