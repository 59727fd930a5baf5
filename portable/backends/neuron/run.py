"""`portable.compile(program, "neuron")` where neuron devices exist: the neuron lowering run through
JAX on them (devices.py: the Neuron PJRT plugin's, or XLA:CPU standing in).

The program run is the one the lowering validated (`NeuronProgram.program`: float64 computed as
float32, MX GEMMs decided), traced by the same JAX rules (platform "neuron", the native MX GEMM
rules of `NeuronOptions.mx`) that emit.py converts into graph.hlo:

- single-device: `jax.jit` of that function, compiled for the first neuron device; on the plugin
  this is where neuronx-cc runs and the NEFF is cached (the plugin's compile cache, not ours).
  Inputs are cast to the lowered program's dtypes and copied to the device each call; outputs
  come back as torch tensors (float32 where the program computed float64).
- per-rank (`Program.is_per_rank`): one rank per device under `shard_map` (xla/spmd.py), the
  executable taking and returning GLOBAL values as the xla backend's does, with JAX's collectives
  over named mesh axes: the path the `neuron` job engine runs. The written graph.hlo, with
  explicit replica groups and a rank input, is the input for neuronx-cc on its own; this path
  does not execute it.

Native MX GEMMs (`native_mx_gemm`, mx_native.py) lower by the devices' platform, not by an
environment variable: on the plugin as the custom calls (`QuantizeMX`, `__op$block_scaled_dot`),
which neuronx-cc compiles; on XLA:CPU, which has no such calls, as their bit-exact stand-ins
(`NeuronOptions(mx="stand-in")` semantics), so a stand-in run of a trn3 MX program equals the
trn2 emulation bit for bit (`run_rules`).

`neuron_spmd_function` is the per-rank path on its own: the program lowered by the neuron backend
for a target (every decision `portable.compile(program, "neuron:<variant>")` makes) and traced
over the devices; the `neuron` job engine runs it.

On XLA:CPU the compile uses the xla backend's options (optimization level 0), so a stand-in run
matches `portable.compile(program, "xla")` bit for bit where the neuron rules equal xla's; on the
plugin, its own defaults. The Executable keeps training state as torch tensors between calls
(copied in and out each step); `portable train --engine neuron` keeps it on the devices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from portable.ir.program import Program
from portable.runtime import Executable

from .artifact import NeuronLowered, NeuronProgram
from .options import NeuronOptions

if TYPE_CHECKING:
    from ..xla.spmd import _SpmdFunction

__all__ = ["neuron_executable", "run_rules", "spmd_of"]


def neuron_executable(
    program: Program, lowered: NeuronLowered, devices: Sequence[Any], backend: str = "neuron"
) -> Executable:
    """An Executable of `program` (as given to `lower`) running `lowered`'s program on
    `devices` (see the module docstring)."""
    record = lowered.programs[0]
    if program.is_per_rank:
        from ..xla.spmd import SpmdExecutable

        fn = spmd_of(record, lowered.options, devices)
        return SpmdExecutable(program, backend, fn)
    return Executable(program, _single_device(record.program, lowered, devices[0]), backend)


def run_rules(
    options: NeuronOptions, platform: str
) -> dict[Callable[..., Any], Callable[..., Any]]:
    """The rules of the backend's graph targets for a run on `platform`: the MX custom calls on
    the plugin; their stand-ins on XLA:CPU (no QuantizeMX there) or with mx="stand-in"."""
    from .mx_native import gemm_rules

    native = options.mx != "stand-in" and platform != "cpu"
    return gemm_rules("custom-call" if native else "stand-in")


def spmd_of(record: NeuronProgram, options: NeuronOptions, devices: Sequence[Any]) -> _SpmdFunction:
    """The per-rank program of `record` traced over the mesh of `devices` (shard_map), its MX
    calls lowered for the devices' platform (`run_rules`)."""
    from ..xla.spmd import spmd_function

    rules = run_rules(options, devices[0].platform)
    return spmd_function(record.program, "neuron", devices, rules)


def _single_device(
    program: Program, lowered: NeuronLowered, device: Any
) -> Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]:
    """run(flat torch inputs) -> flat torch outputs of `program` compiled for `device`."""
    import jax
    import jax.numpy as jnp

    from ..xla.compiler import COMPILER_OPTIONS
    from ..xla.dtypes import to_jax
    from ..xla.lowering import abstract_inputs, jax_function

    fn = jax_function(program, "neuron", None, run_rules(lowered.options, device.platform))
    sharding = jax.sharding.SingleDeviceSharding(device)
    args = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in abstract_inputs(program)
    ]
    options = COMPILER_OPTIONS if device.platform == "cpu" else {}
    with jax.enable_x64(True):
        compiled = jax.jit(fn).lower(*args).compile(compiler_options=options)  # type: ignore[arg-type]  # jax says str | bool; jaxlib takes ints
    dtypes = [to_jax(spec.spec.dtype) for spec in program.signature.inputs]

    def run(flat: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with jax.enable_x64(True):
            arrays = [
                jax.device_put(jnp.asarray(_numpy(t), dtype=d), device)
                for t, d in zip(flat, dtypes, strict=True)
            ]
            outputs = compiled(*arrays)
        return [_torch(o) for o in outputs]

    return run


def _numpy(t: torch.Tensor) -> Any:
    """A host array of `t` (bfloat16 through its bits: numpy has no bfloat16)."""
    import ml_dtypes

    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _torch(array: Any) -> torch.Tensor:
    """A device array as a torch tensor on the host (copied)."""
    import jax

    host = jax.device_get(array)
    import numpy as np

    value = np.asarray(host)
    if value.dtype.name == "bfloat16":
        return torch.from_numpy(value.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(value.copy())
