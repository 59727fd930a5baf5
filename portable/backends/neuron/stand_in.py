"""Run a neuron lowering's HLO on XLA:CPU: the stand-in for a NeuronCore, for parity checks here.

`HloRunner(record)` compiles one lowered program's serialized HloModuleProto (graph.hlo, the
bytes that are written) with jaxlib's CPU client. A trn3 program lowered with
`NeuronOptions(mx="stand-in")` has each MX custom call replaced by its XLA:CPU stand-in
(mx_calls.py) and runs here; one with the custom calls themselves does not (XLA:CPU has no
`QuantizeMX`). `steps` runs a training step several times, feeding each updated state output
back to the input it aliases, as a Neuron runtime does with donated buffers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from portable.errors import BackendError
from portable.ir.signature import OutputKind
from portable.runtime import flatten_inputs

from .artifact import NeuronProgram
from .mx_calls import QUANTIZE_MX, SCALED_DOT

__all__ = ["HloRunner"]


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    import ml_dtypes

    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    return t.numpy().copy()


def _to_torch(a: Any) -> torch.Tensor:
    import ml_dtypes

    a = np.array(a, copy=True)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


class HloRunner:
    """One lowered program's graph.hlo, compiled for XLA:CPU (see the module docstring)."""

    def __init__(self, record: NeuronProgram) -> None:
        import jax
        from jax._src.lib import xla_client

        calls = [
            c for c in (QUANTIZE_MX, SCALED_DOT) if f'custom_call_target="{c}"' in record.hlo_text
        ]
        if calls:
            raise BackendError(
                f"{record.key} has custom calls XLA:CPU cannot run ({', '.join(calls)})",
                fix="lower with NeuronOptions(mx='stand-in') to run a trn3 MX program here",
            )
        self.record = record
        signature = record.program.signature
        names = [s.name for s in signature.inputs]
        self.order = [names.index(entry["name"]) for entry in record.io_spec["inputs"]]
        computation = xla_client.XlaComputation(record.hlo)
        module = xla_client._xla.mlir.xla_computation_to_mlir_module(computation)
        self.device = jax.devices("cpu")[0]
        devices = xla_client.DeviceList((self.device,))
        options = xla_client.CompileOptions()
        self.executable = self.device.client.compile_and_load(module, devices, options)

    def __call__(self, flat: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The program's outputs for its flat signature inputs (every input, in order)."""
        import jax

        with jax.enable_x64(True):
            args = [jax.device_put(_to_numpy(flat[k]), self.device) for k in self.order]
            results = self.executable.execute_sharded(args).disassemble_into_single_device_arrays()
        return [_to_torch(r[0]) for r in results]

    def steps(
        self, batches: Iterable[Sequence[torch.Tensor]], weights: Mapping[str, torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Run a training step once per batch from `weights`; (losses, final flat inputs)."""
        program = self.record.program
        sig = program.signature
        index = {s.name: k for k, s in enumerate(sig.inputs)}
        loss = [i for i, o in enumerate(sig.outputs) if o.kind is OutputKind.LOSS][0]
        flat: list[torch.Tensor] | None = None
        losses = []
        for batch in batches:
            fresh = flatten_inputs(program, list(batch), dict(weights))
            if flat is None:
                flat = list(fresh)
            else:  # the batch is new, the state is what the last step returned
                for k, spec in enumerate(sig.inputs):
                    if spec.kind.value == "user_input":
                        flat[k] = fresh[k]
            outputs = self(flat)
            losses.append(outputs[loss])
            for i, out in enumerate(sig.outputs):
                if out.aliases is not None:
                    flat[index[out.aliases]] = outputs[i]
        return losses, flat or []
