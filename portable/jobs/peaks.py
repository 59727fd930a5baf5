"""Peak FLOP rates per device and number format, and model FLOPs utilization.

`PEAKS` holds one chip of each accelerator a job can run on, dense rates (no structured
sparsity), per number format: `float32`, `tfloat32`, `bfloat16`, `float16`, `float8`, `mxfp8`,
`mxfp4`, `float4`. A format a chip has no rate for is absent (Hopper has no native MX: its MX
GEMMs are emulated and run at the rate of the format they dequantize to). The figures are the
chip table of portable/planner/systems.toml (one source for jobs' MFU and the planner; each
figure's source is there, mostly shared/reference/hardware.md). `h100` is the SXM part (H100
PCIe and NVL boards are slower; a CUDA device named H100 reads as it). The CPU has no table
entry: its peak is measured (`measure_cpu_peak`).

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
from ..planner.systems import canonical_format, chips

__all__ = ["PEAKS", "DevicePeak", "detect_device", "device_peak", "measure_cpu_peak", "mfu"]


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
        key = canonical_format(number_format)
        if key not in self.flops:
            raise JobError(
                f"{self.kind} has no peak rate for {number_format!r}",
                fix=f"use one of {', '.join(sorted(self.flops))}",
            )
        return self.flops[key]


# The devices `detect_device` reports (the planner's chip table also has the A100, which jobs do
# not detect).
_JOB_CHIPS = ("trn1", "trn2", "trn3", "h100", "h200", "b200", "gb200")


def _from_chip(kind: str) -> DevicePeak:
    chip = chips()[kind]
    return DevicePeak(kind, dict(chip.peak_flops), chip.hbm_bytes, chip.source)


PEAKS: Mapping[str, DevicePeak] = MappingProxyType({kind: _from_chip(kind) for kind in _JOB_CHIPS})


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
