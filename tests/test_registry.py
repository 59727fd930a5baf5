"""Backend and pass registries: lazy, plug-in aware, duplicate names rejected, claims checked."""

from __future__ import annotations

import dataclasses
import importlib.metadata

import pytest
import torch

import portable
from portable.backends import Backend, get_backend
from portable.backends import registry as backend_registry
from portable.passes import registry as pass_registry
from portable.registry import Registry


def test_registered_names_match_their_objects():
    for name in backend_registry.names():
        assert get_backend(name).name == name
    for name in pass_registry.names():
        assert pass_registry.get(name).name == name


def test_duplicate_name_is_rejected():
    reg = Registry("backend", "portable.test-none", {"cpu": "portable.backends.cpu:CpuBackend"})
    with pytest.raises(portable.RegistryError, match="already registered"):
        reg.register("cpu", "x:y")


def test_broken_plugin_names_itself():
    reg = Registry("backend", "portable.test-none", {"ghost": "no_such_module:Ghost"})
    with pytest.raises(portable.RegistryError) as info:
        reg.get("ghost")
    assert "no_such_module:Ghost" in str(info.value)


def test_entry_point_plugins_are_loaded_lazily(monkeypatch):
    ep = importlib.metadata.EntryPoint(
        name="mine", value="portable.backends.cpu:CpuBackend", group="portable.test-group"
    )
    calls = []

    def fake_entry_points(group):
        calls.append(group)
        return [ep] if group == "portable.test-group" else []

    monkeypatch.setattr("portable.registry.entry_points", fake_entry_points)
    reg = Registry("backend", "portable.test-group", {})
    assert calls == []  # nothing is read at construction
    assert reg.names() == ["mine"]
    assert reg.get("mine").__name__ == "CpuBackend"


def test_plugin_clashing_with_builtin_is_rejected(monkeypatch):
    ep = importlib.metadata.EntryPoint(name="cpu", value="x:y", group="g")
    monkeypatch.setattr("portable.registry.entry_points", lambda group: [ep])
    reg = Registry("backend", "g", {"cpu": "portable.backends.cpu:CpuBackend"})
    with pytest.raises(portable.RegistryError, match="already registered"):
        reg.names()


def test_importing_portable_does_not_import_heavy_backends():
    import subprocess
    import sys

    code = (
        "import sys, portable, portable.backends, portable.passes; "
        "print(','.join(m for m in ('jax', 'triton', 'onnx', 'onnxruntime') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_cpu_capabilities_hold_for_every_claimed_op_used_by_examples(example_spec):
    """What `cpu` claims it lowers, it runs: every op in the examples' programs is claimed,
    and the programs execute."""
    backend = get_backend("cpu")
    caps = backend.capabilities()
    for stem in ("mlp", "cnn"):
        for training in (False, True):
            program = portable.capture_spec(example_spec(stem), training=training)
            used = {
                portable.opset.op_name(n.target)
                for n in program.graph.nodes
                if n.op == "call_function" and portable.opset.lookup(n.target)
            }
            assert used <= caps.ops
            inputs = example_spec(stem).batch() if training else example_spec(stem).inputs()
            portable.compile(program, backend="cpu")(*inputs)
    assert backend.can_execute_here() == (True, "")


def test_backend_refuses_ops_outside_its_capabilities():
    """Capabilities are data: an op a backend does not claim fails lowering with a
    LoweringError naming the op, the backend and the user's source line."""
    from portable.backends.base import Target
    from portable.backends.cpu import CpuBackend

    class CpuWithoutMx(CpuBackend):
        name = "cpu-without-mx"

        def capabilities(self):
            caps = super().capabilities()
            return dataclasses.replace(caps, ops=caps.ops - {"portable.mx_quantize.default"})

    class Quantizes(torch.nn.Module):
        def forward(self, x):
            codes, scales = torch.ops.portable.mx_quantize(x, "e4m3", -1, "floor", 32)
            return codes

    assert "portable.mx_quantize.default" in get_backend("cpu").capabilities().ops
    program = portable.capture(Quantizes(), (torch.randn(2, 64),))
    with pytest.raises(portable.LoweringError) as info:
        CpuWithoutMx().lower(program, Target("cpu-without-mx"))
    assert info.value.op == "portable.mx_quantize.default"
    assert info.value.backend == "cpu-without-mx"
    message = str(info.value)
    assert "cpu-without-mx has no rule for portable.mx_quantize.default" in message
    assert "test_registry.py" in message
    get_backend("cpu").lower(program, Target("cpu"))  # the real cpu backend takes it


def test_backend_subclass_contract():
    assert issubclass(type(get_backend("cpu")), Backend)
    with pytest.raises(portable.BackendError, match="unknown target cpu:fast"):
        portable.compile(
            portable.capture(torch.nn.Linear(2, 2), (torch.randn(1, 2),)), backend="cpu:fast"
        )
