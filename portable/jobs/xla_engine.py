"""The `xla` and `neuron` engines: one JAX controller running the per-rank program over the
host's devices under `shard_map` (portable/backends/xla/spmd.py).

The state lives on the devices from step to step as global jax arrays laid out by the plan
(updated outputs replace the inputs they alias, donated); only each step's batch is put, and only
the loss and metrics come back. Checkpoints see the state as whole tensors (one writer), which
DCP reshards into any plan's DTensors on load.

`neuron`: the same controller running the per-rank program as the neuron backend lowers it for
`neuron:trn3` (the backend's default target; a job config names no variant), through the path
`portable.compile(program, "neuron:trn3")` takes (`neuron.backend.neuron_spmd_function`): float64 computed
as float32, each MX GEMM native (QuantizeMX + block-scaled dot) where it fits, the validator's
errors raised before anything runs. It runs over the devices of the Neuron PJRT plugin (jax-neuronx
on a Trn host), where the MX GEMMs are the compiler's custom calls. Where that plugin is absent the
engine stops with a BackendError naming the boundary, unless PORTABLE_NEURON_STAND_IN=cpu, which
runs the same lowering on XLA:CPU devices, the MX custom calls as their bit-exact stand-ins: how
this path is tested off Trainium. The devices are chosen by the neuron backend's helper
(backends/neuron/devices.py). The target and the MX GEMM decisions are recorded in the `start`
event (`XlaEngine.lowering`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import torch

from ..backends.neuron.devices import NEURON_STAND_IN, neuron_devices
from ..backends.neuron.targets import DEFAULT_VARIANT
from ..backends.xla.spmd import spmd_function, to_torch
from ..errors import BackendError
from ..ir.program import Program
from ..ir.signature import InputKind, OutputKind
from .checkpoint import checkpoint_key
from .comm_stats import CommStats
from .engine import StepOut
from .prepare import JobFiles

__all__ = ["NEURON_STAND_IN", "XlaEngine"]


def _devices(platform: str) -> list[Any]:
    import jax

    cache = os.environ.get("PORTABLE_JAX_CACHE")
    if cache:  # a restarted job compiles from the cache the first start filled
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

    if platform == "xla":
        return jax.devices("cpu")
    return neuron_devices()  # the plugin's devices, XLA:CPU with the stand-in, or BackendError


class XlaEngine:
    """One controller over the mesh's devices (see the module docstring)."""

    rank = 0
    world = 1

    def __init__(self, files: JobFiles, *, platform: str) -> None:

        devices = _devices(platform)
        on_cpu = devices[0].platform == "cpu"
        target = f"neuron:{DEFAULT_VARIANT}" if platform == "neuron" else None
        # the plugin's devices are the target's generation (peaks.detect_device)
        self.device_kind = "cpu" if on_cpu else (target or devices[0].platform)
        program = files.per_rank
        self.program = program
        self.comm = CommStats()  # XLA schedules the collectives inside the step
        self.lowering: dict[str, Any] = {}
        start = time.perf_counter()
        self.fn = self._function(program, platform, devices)
        self.eval_fn = None
        if files.eval_per_rank is not None:
            self.eval_fn = self._function(files.eval_per_rank, platform, devices)
        self.compile_s = time.perf_counter() - start
        self.devices = self.fn.layout.mesh.size
        sig = program.signature
        self._index = {s.name: k for k, s in enumerate(sig.inputs)}
        self._keys = {s.key: s.name for s in sig.state_inputs}
        self._users = [self._index[u.name] for u in sig.user_inputs]
        self._arrays: list[Any] = [None] * len(sig.inputs)
        self.set_state({spec.key: program.weights[spec.key] for spec in sig.state_inputs})
        self._loss = [i for i, o in enumerate(sig.outputs) if o.kind is OutputKind.LOSS][0]
        self._metrics = {
            o.name: i for i, o in enumerate(sig.outputs) if o.kind is OutputKind.METRIC
        }

    def _function(self, program: Program, platform: str, devices: list[Any]) -> Any:
        """`program` traced over `devices`: as the xla backend lowers it, or (neuron) as
        `portable.compile(program, "neuron:trn3")` does, its decisions added to `lowering`."""
        if platform != "neuron":
            return spmd_function(program, platform, devices)
        from ..backends.neuron.backend import neuron_spmd_function

        fn, record = neuron_spmd_function(program, DEFAULT_VARIANT, devices)
        if not self.lowering:  # the training step's; an eval program's GEMMs are its forwards
            self.lowering = {
                "target": f"neuron:{DEFAULT_VARIANT}",
                "mx_gemms": [g.to_json() for g in record.mx_gemms],
            }
        return fn

    def rows(self, batch: int) -> tuple[int, int] | None:
        return (0, batch)  # the controller feeds the whole global batch

    def step(self, idx: torch.Tensor, targets: torch.Tensor) -> StepOut:
        for k, value in zip(self._users, (idx, targets), strict=True):
            self._arrays[k] = self.fn.put_one(k, value)
        outputs = self.fn(self._arrays)
        loss = float(outputs[self._loss])  # waits for the step
        metrics = {name: float(outputs[i]) for name, i in self._metrics.items()}
        self._arrays = self.fn.thread(self._arrays, outputs)
        return StepOut(loss, metrics)

    def eval_loss(self, idx: torch.Tensor, targets: torch.Tensor) -> float:
        if self.eval_fn is None:
            raise BackendError("this job has no validation program", fix="pass --eval-data")
        sig = self.eval_fn.program.signature
        arrays = []
        batch = iter((idx, targets))
        for k, spec in enumerate(sig.inputs):
            if spec.kind is InputKind.USER_INPUT:
                arrays.append(self.eval_fn.put_one(k, next(batch)))
            else:
                arrays.append(self._arrays[self._index[self._keys[spec.key]]])
        (loss,) = [
            v
            for v, o in zip(self.eval_fn(arrays), sig.outputs, strict=True)
            if o.kind is OutputKind.OUTPUT
        ]
        return float(loss)

    def checkpoint_state(self) -> dict[str, torch.Tensor]:

        return {
            checkpoint_key(key): to_torch(self._arrays[self._index[name]])
            for key, name in self._keys.items()
        }

    def load_state(self, load: Any) -> None:
        targets = {k: torch.zeros_like(v) for k, v in self.checkpoint_state().items()}
        load(targets)
        for key, name in self._keys.items():
            k = self._index[name]
            self._arrays[k] = self.fn.put_one(k, targets[checkpoint_key(key)])

    def state_slices(self, key: str, shape: tuple[int, ...]) -> tuple[slice, ...]:
        return tuple(slice(0, n) for n in shape)  # the controller holds global values

    def set_state(self, values: Mapping[str, torch.Tensor]) -> None:
        for key, value in values.items():
            k = self._index[self._keys[key]]
            dtype = self.fn.program.signature.inputs[k].spec.dtype  # as lowered (fp64 -> fp32)
            self._arrays[k] = self.fn.put_one(k, value.to(dtype))

    def snapshot(self) -> dict[str, torch.Tensor]:
        return self.checkpoint_state()

    def restore(self, snapshot: dict[str, torch.Tensor]) -> None:
        self.load_state(lambda targets: [t.copy_(snapshot[k]) for k, t in targets.items()])

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass
