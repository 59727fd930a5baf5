"""The backend protocol's stages and data (issue 14, items 4 and 5): capabilities are data that
import nothing of what they require, the rule table's op names are declared without JAX, options
parse from the target string in the pass-option grammar, and the stages have their names."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import portable
from portable.backends import CompileReport, Target, Written, get_backend, registry
from portable.backends.cuda import CudaBackend, CudaOptions
from portable.backends.neuron import NeuronBackend
from portable.backends.neuron.options import NeuronOptions
from portable.errors import BackendError


def test_declared_op_names_are_the_rule_tables():
    pytest.importorskip("jax")
    from portable.backends.xla.rules import PLATFORMS, load_rules
    from portable.backends.xla.rules.names import names

    table = load_rules()
    for platform in PLATFORMS:
        assert names(platform) == table.names(platform), platform


def test_capabilities_import_nothing_they_require():
    code = (
        "import sys\n"
        "from portable.backends import get_backend, registry\n"
        "caps = {n: get_backend(n).capabilities() for n in registry.names()}\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('jax', 'jaxlib', 'triton', 'onnx', 'onnxruntime', 'onnxscript'))\n"
        "print(heavy, len(caps['xla'].ops), len(caps['neuron'].ops))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    heavy, xla_ops, neuron_ops = done.stdout.strip().rsplit(" ", 2)
    assert heavy == "[]" and int(xla_ops) > 100 and int(neuron_ops) > 100


def test_requires_and_extra_are_data_and_give_the_pip_install():
    caps = get_backend("neuron").capabilities()
    assert caps.requires == ("jax", "jaxlib") and caps.extra == "xla"
    assert get_backend("onnx").requirements.install == "pip install 'portable[onnx]'"
    assert get_backend("cpu").requirements is None


@pytest.mark.parametrize(
    ("text", "target"),
    [
        ("cpu", Target("cpu")),
        ("neuron:trn3{fp64=error}", Target("neuron", "trn3", "fp64=error")),
        ("cuda{aot=true}", Target("cuda", None, "aot=true")),
        ("cuda:sm_90,sm_100{aot=true}", Target("cuda", "sm_90,sm_100", "aot=true")),
    ],
)
def test_target_strings_carry_options_outside_their_name(text, target):
    parsed = Target.parse(text)
    assert parsed == target and "{" not in str(parsed)


def test_options_parse_in_the_pass_grammar():
    assert CudaBackend.parse_options("aot=true") == CudaOptions(aot=True)
    assert CudaBackend.parse_options("") is None
    assert CudaBackend.parse_options("", aot=True) == CudaOptions(aot=True)
    assert NeuronBackend.parse_options('fp64=error,model_type="generic"') == NeuronOptions(
        fp64="error", model_type="generic"
    )
    assert NeuronBackend.parse_options("optlevel=2").optlevel == 2
    assert "aot" in CudaBackend.option_names() and registry.get("cpu").option_names() == set()


@pytest.mark.parametrize(
    ("backend", "text", "message"),
    [
        (CudaBackend, "aot=yes", "option 'aot' of backend 'cuda' must be true or false"),
        (CudaBackend, "speed=1", "backend 'cuda' has no option 'speed'"),
        (CudaBackend, "aot", "option 'aot' of backend 'cuda' has no `=value`"),
        (NeuronBackend, "fp64=maybe", "neuron option fp64='maybe' is not one of"),
    ],
)
def test_bad_options_are_backend_errors(backend, text, message):
    with pytest.raises(BackendError, match=message.replace("(", r"\(")):
        backend.parse_options(text)


def test_a_backend_without_options_refuses_them():
    with pytest.raises(BackendError, match="backend cpu takes no options"):
        registry.get("cpu").parse_options("x=1")


def test_write_writes_and_compile_without_a_toolchain_does_nothing(tmp_path):
    program = portable.capture(torch.nn.Linear(4, 2), (torch.randn(3, 4),))
    cpu = get_backend("cpu")
    lowered = cpu.lower(program, Target("cpu"))
    written = cpu.write(lowered, tmp_path)
    assert isinstance(written, Written) and written.files == [tmp_path / "graph.txt"]
    assert written.out_dir == tmp_path
    from portable.backends import Toolchain

    report = cpu.compile(written, Toolchain("none", "0"))
    assert report == CompileReport(Toolchain("none", "0"), 0) and report.ok
