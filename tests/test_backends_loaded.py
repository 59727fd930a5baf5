"""Capture once, lower anywhere: a program loaded from its archive lowers on every backend exactly
as the fresh capture it was saved from, and runs to the same numbers.

An archive stores each node's `meta["tensor"]` (TensorSpec) and `meta["source"]`, not what
capture leaves besides (torch.export's fake values in `meta["val"]`, stack traces, module
stacks). For every example (inference and training step) and every backend that takes it:

- the lowered texts (cpu's graph, xla's StableHLO/HLO, neuron's HLO, cuda's export and kernel
  graphs, onnx's model text) of the loaded program equal those of the fresh one, and so do
  cuda's planned Triton launches (what its kernels are compiled from);
- the backends that run here (cpu, xla, onnx, cuda's kernel graph in Triton's interpreter) give
  bit-identical outputs, losses and updated state for both.

CI runs every example on cpu, xla, neuron and cuda, onnx on the MLP and GPT, and numbers on the
runnable backends for inference and for the MLP's and CNN's training steps; PORTABLE_SLOW=full
runs onnx on every example and numbers for every training step.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch

import portable
from portable.backends import Target, get_backend
from tests.support import EXAMPLES

pytest.importorskip("jax")
pytest.importorskip("triton")
pytest.importorskip("onnxruntime")

from portable.backends.cuda import CudaBackend, CudaOptions  # noqa: E402

FULL = os.environ.get("PORTABLE_SLOW") == "full"
REPO = Path(__file__).resolve().parents[1]
BACKENDS = ("cpu", "xla", "neuron", "cuda", "onnx")
ONNX_STEMS = EXAMPLES if FULL else ("mlp", "gpt")  # one export costs seconds whatever the model
TRAINED_STEMS = EXAMPLES if FULL else ("mlp", "cnn")  # training steps run on every backend here


def _same_program(program: portable.Program, tmp_path: Path) -> portable.Program:
    return portable.load(program.save(tmp_path / f"{program.name}.portable"))


def _launches(lowered) -> dict[str, list]:
    """cuda: every planned Triton launch per arch, as the kernel compiler sees it."""
    return {
        arch: [(k.kernel, k.signature, k.constexprs, k.grid, k.grid_rule) for k in launches]
        for arch, launches in lowered.payload.launches.items()
    }


def _lowerings(backend: str, program: portable.Program):
    impl = get_backend(backend)
    if program.kind not in impl.capabilities().program_kinds:
        return None
    return impl.lower(program, Target(backend))


def _runner(backend: str):
    """The backend as it runs here: cuda's kernel graph on CPU, Triton in its interpreter."""
    if backend == "cuda":
        return CudaBackend(CudaOptions(device="cpu", torch_compile=False))
    return get_backend(backend)


def _runs(backend: str, stem: str, kind: str) -> bool:
    if backend == "neuron":
        return False  # NeuronCores are not here: the HLO texts are what is compared
    if backend == "onnx" and stem not in ONNX_STEMS:
        return False
    return kind == "inference" or stem in TRAINED_STEMS


def _results(impl, lowered, inputs) -> list[torch.Tensor]:
    """Outputs of one call, or a training step's loss and updated state (in key order)."""
    exe = impl.executable(impl.write(lowered))
    out = exe(*inputs)
    if isinstance(out, portable.StepResult):
        return [out.loss, *(v for _, v in sorted(out.state.items()))]
    return list(out) if isinstance(out, (tuple, list)) else [out]


@pytest.mark.parametrize("kind", ["inference", "training"])
@pytest.mark.parametrize("stem", EXAMPLES)
def test_a_loaded_archive_lowers_and_runs_as_its_fresh_capture(example_spec, stem, kind, tmp_path):
    spec = example_spec(stem)
    fresh = portable.capture_spec(spec, training=kind == "training")
    loaded = _same_program(fresh, tmp_path)
    assert loaded.content_hash == fresh.content_hash
    assert all("val" not in n.meta for n in loaded.graph.nodes)  # what the archive does not hold
    inputs = spec.batch() if kind == "training" else spec.inputs()
    for backend in BACKENDS:
        if backend == "onnx" and stem not in ONNX_STEMS:
            continue
        want = _lowerings(backend, fresh)
        if want is None:  # onnx takes inference programs only
            continue
        got = _lowerings(backend, loaded)
        assert got.texts.keys() == want.texts.keys(), backend
        for name, text in want.texts.items():
            assert got.texts[name] == text, f"{backend}: {name} differs for the loaded archive"
        if backend == "cuda":
            assert _launches(got) == _launches(want)
        if _runs(backend, stem, kind):
            impl = _runner(backend)
            expected, actual = _results(impl, want, inputs), _results(impl, got, inputs)
            assert len(actual) == len(expected), backend
            for k, (a, e) in enumerate(zip(actual, expected, strict=True)):
                assert torch.equal(a, e), f"{backend}: result {k} differs for the loaded archive"


def test_a_loaded_mx_program_takes_the_same_native_matmul_decisions(example_spec, tmp_path):
    """cuda decides native MX matmuls from operand shapes: a loaded mx-quantized program decides
    the same (sm_100 native, sm_90 emulated) and plans the same kernels."""
    from portable.passes import PassManager, parse_pipeline

    fresh = portable.capture_spec(example_spec("llama"))
    fresh, _ = PassManager(parse_pipeline("mx-quantize{mode=real}")).run(fresh)
    loaded = _same_program(fresh, tmp_path)
    want, got = (_lowerings("cuda", p) for p in (fresh, loaded))
    assert got.texts == want.texts and _launches(got) == _launches(want)
    assert got.payload.arch_decisions == want.payload.arch_decisions
    assert {d.impl for d in got.payload.arch_decisions["sm_100"]} == {"native-mx"}
    assert {d.impl for d in got.payload.arch_decisions["sm_90"]} == {"emulated-mx"}


def test_a_loaded_program_with_dynamic_dims_lowers_as_its_fresh_capture(example_spec, tmp_path):
    """Kernels of dynamic dims are planned at each dim's planning size, from the archive's
    declared ranges, never from the example the fresh capture was traced with."""
    from torch.export import Dim

    spec = example_spec("gpt")
    batch, seq = Dim("batch", min=1, max=8), Dim("seq", min=2, max=31)
    fresh = portable.capture(
        spec.build().eval(), spec.inputs(), dynamic_shapes=({0: batch, 1: seq},)
    )
    loaded = _same_program(fresh, tmp_path)
    want, got = (_lowerings("cuda", p) for p in (fresh, loaded))
    assert got.texts == want.texts and _launches(got) == _launches(want)
    # the softmax rows of the attention are seq long: planned at seq's planning size, 4
    rows = {k[2]["BLOCK_N"] for k in _launches(got)["sm_90"] if k[0] == "scale_mask_softmax"}
    assert rows == {4}


_ARCHIVED_META = {"tensor", "source"}  # what portable/ir/serialize.py stores per node


def _meta_keys_read(path: Path) -> set[str]:
    """String keys a module reads from a node's `meta` (`x.meta["k"]`, `x.meta.get("k")`)."""
    keys = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            target, key = node.value, node.slice
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and node.args
        ):
            target, key = node.func.value, node.args[0]
        else:
            continue
        if isinstance(target, ast.Attribute) and target.attr == "meta":
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                keys.add(key.value)
    return keys


def test_backends_read_only_the_node_meta_an_archive_stores():
    """The structural half of the promise: no backend reads capture-only meta. The cuda backend
    reads `meta["val"]` only on its own copy of the graph, where `values.py` derives it from
    the archived specs."""
    for path in sorted((REPO / "backends").rglob("*.py")):
        allowed = _ARCHIVED_META | ({"val"} if "cuda" in path.parts else set())
        extra = _meta_keys_read(path) - allowed
        assert not extra, f"{path.relative_to(REPO)} reads meta {sorted(extra)}"
