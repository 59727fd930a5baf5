"""The `neuron` backend: the artifact layout, the offline validator, determinism, and the written
graph.hlo executed on XLA:CPU against the cpu reference.

No Neuron SDK exists here. The checks that stand in for it: the HLO proto read back by XLA, the
validator's rules (hand-written bad HLO for each class it rejects), byte-identical artifacts for
identical programs, and parity of the very module written to disk (deserialized, compiled by
jaxlib's CPU client, run on the example inputs) with `portable.compile(program, "cpu")`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import portable
from portable.backends import get_backend, registry
from portable.backends.neuron import TARGETS, NeuronBackend, NeuronOptions
from portable.backends.neuron.findings import Severity
from portable.backends.neuron.hlo import (
    module_from_proto,
    parse_hlo_text,
    proto_from_text,
    proto_to_text,
)
from portable.backends.neuron.memory import spec_bytes
from portable.backends.neuron.validate import validate
from portable.errors import BackendError
from portable.ir.signature import InputKind
from portable.runtime import Executable
from tests.support import EXAMPLES, load_spec

REPO = Path(__file__).resolve().parents[1]
FAKE_COMPILER = REPO / "tests" / "fixtures" / "fake_neuronx_cc"
CASES = [(stem, kind) for stem in EXAMPLES for kind in ("inference", "training")]
IDS = [f"{stem}-{kind}" for stem, kind in CASES]


# -- shared: capture and lower each example once -----------------------------------------------


@functools.cache
def _spec(stem: str):
    return load_spec(stem)


@functools.cache
def _program(stem: str, kind: str):
    return portable.capture_spec(_spec(stem), training=kind == "training")


@pytest.fixture(scope="module")
def lowered(tmp_path_factory):
    """`lowered(stem, kind, variant="trn3")` -> (Written, out_dir), lowered once per module."""
    cache: dict[tuple, tuple] = {}

    def get(stem: str, kind: str, variant: str = "trn3"):
        key = (stem, kind, variant)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{stem}_{kind}_{variant}") / "neuron"
            compiled = portable.lower(_program(stem, kind), f"neuron:{variant}", out)
            cache[key] = (compiled, out)
        return cache[key]

    return get


def _record(compiled):
    (record,) = compiled.payload.programs
    return record


def _files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}


# -- registration and refusal ------------------------------------------------------------------


def test_registered_with_variants_and_refuses_to_run_here():
    backend = get_backend("neuron")
    assert isinstance(backend, NeuronBackend) and "neuron" in registry.names()
    caps = backend.capabilities()
    assert caps.variants == ("trn3", "trn2", "trn1") and caps.writes_artifacts
    assert "aten.topk.default" in caps.ops
    ok, why = backend.can_execute_here()
    assert not ok and "Trainium" in why


def test_executable_names_the_backends_that_run_here(lowered):
    compiled, _ = lowered("mlp", "inference")
    with pytest.raises(BackendError) as info:
        NeuronBackend().executable(compiled)
    message = str(info.value)
    assert message.startswith(
        "neuron programs run on Trainium; lowered artifacts are written, use "
        "`portable lower --target neuron:trn3`; backends that run here: "
    )
    assert "cpu" in message and "xla" in message
    with pytest.raises(BackendError, match="cannot run on this machine"):
        portable.compile(_program("mlp", "inference"), "neuron:trn3")


def test_unknown_variant_lists_the_generations():
    with pytest.raises(BackendError, match=r"unknown target neuron:trn9") as info:
        portable.lower(_program("mlp", "inference"), "neuron:trn9")
    assert "trn3, trn2, trn1" in str(info.value)


def test_default_variant_is_trn3(tmp_path):
    compiled = portable.lower(_program("mlp", "inference"), "neuron", tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert compiled.lowered.target.variant == "trn3" and manifest["target"]["variant"] == "trn3"


def test_options_are_checked():
    with pytest.raises(BackendError, match=r"fp64='single' is not one of 'downcast', 'error'"):
        NeuronOptions(fp64="single")
    with pytest.raises(BackendError, match="hbm_headroom"):
        NeuronOptions(hbm_headroom=1.5)


# -- the layout, per example -------------------------------------------------------------------


@pytest.mark.parametrize(("stem", "kind"), CASES, ids=IDS)
def test_layout(lowered, stem, kind):
    compiled, out = lowered(stem, kind)
    record = _record(compiled)
    base = out / "programs" / record.key
    expected = {
        "manifest.json",
        "scripts/compile.sh",
        f"programs/{record.key}/model/graph.hlo",
        f"programs/{record.key}/model/graph.hlo.txt",
        f"programs/{record.key}/model/graph.stablehlo.mlir",
        f"programs/{record.key}/command.txt",
        f"programs/{record.key}/io_spec.json",
    }
    assert set(_files(out)) == expected
    assert sorted(compiled.files) == sorted(out / name for name in expected)
    assert (out / "scripts" / "compile.sh").stat().st_mode & stat.S_IXUSR

    hlo = (base / "model" / "graph.hlo").read_bytes()
    module = module_from_proto(hlo)  # XLA reads the proto back
    assert module.entry.root.opcode == "tuple"
    assert (base / "model" / "graph.hlo.txt").read_text() == proto_to_text(hlo)
    assert "module @jit_fn" in (base / "model" / "graph.stablehlo.mlir").read_text()

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "portable-neuron" and manifest["format_version"] == 1
    assert manifest["program"]["kind"] == record.program.kind.value
    assert manifest["validation"]["errors"] == 0
    assert manifest["collectives"] == {
        "total": 0,
        "by_kind": {},
        "summary": "none: single-device program",
    }
    (entry,) = manifest["programs"]
    assert entry["hlo_sha256"] == hashlib.sha256(hlo).hexdigest()
    command = (base / "command.txt").read_bytes()
    assert entry["cache_key"] == hashlib.sha256(hlo + command).hexdigest()
    assert shlex.split(command.decode()) == entry["argv"]
    assert entry["io_spec"] == json.loads((base / "io_spec.json").read_text())
    assert {"verified_offline", "needs_hardware"} <= set(manifest["verification"])
    assert any("accepts graph.hlo" in s for s in manifest["verification"]["needs_hardware"])
    assert set(manifest["dependencies"]) >= {"portable", "torch", "jax", "jaxlib"}
    # warnings in the manifest are the findings of the lowering, all located
    assert [f["code"] for f in entry["findings"]] == [f.code for f in record.findings]
    assert all(f.severity is Severity.WARNING for f in record.findings)


@pytest.mark.parametrize(("stem", "kind"), CASES, ids=IDS)
def test_io_spec_and_aliasing(lowered, stem, kind):
    compiled, out = lowered(stem, kind)
    record = _record(compiled)
    sig = record.program.signature
    spec = json.loads((out / "programs" / record.key / "io_spec.json").read_text())
    module = record.module
    params = module.parameters()
    assert len(spec["inputs"]) == len(params)
    names = [e["name"] for e in spec["inputs"]] + [u["name"] for u in spec["unused_inputs"]]
    assert sorted(names) == sorted(i.name for i in sig.inputs)
    by_name = {i.name: i for i in sig.inputs}
    for number, entry in enumerate(spec["inputs"]):
        want = by_name[entry["name"]]
        assert entry["index"] == number and entry["role"] == want.kind.value
        assert entry["shape"] == list(want.spec.shape)
        assert entry["hlo_type"] == str(params[number].leaves[0])
    assert [o["name"] for o in spec["outputs"]] == [o.name for o in sig.outputs]
    aliased = {o["name"]: o["alias"]["name"] for o in spec["outputs"] if o["alias"]}
    if kind == "inference":
        assert aliased == {} and not module.aliases
        return
    # training: every parameter and optimizer-state input is an HLO parameter, donated to the
    # output that replaces it (input_output_alias), never a constant
    assert aliased == sig.aliasing()
    header = (out / "programs" / record.key / "model" / "graph.hlo.txt").read_text()
    assert header.startswith("HloModule") and "input_output_alias={" in header.splitlines()[0]
    donated = {e["name"] for e in spec["inputs"] if e["donated_to"]}
    state = {i.name for i in sig.inputs_of(InputKind.PARAMETER, InputKind.OPTIMIZER_STATE)}
    assert state and state <= donated
    for entry in spec["inputs"]:
        if entry["donated_to"]:
            out_spec = sig.outputs[entry["donated_to"]["index"]]
            assert out_spec.aliases == entry["name"] == entry["name"]


@pytest.mark.parametrize(("stem", "kind"), CASES, ids=IDS)
def test_memory_estimate(lowered, stem, kind):
    compiled, out = lowered(stem, kind)
    record = _record(compiled)
    manifest = json.loads((out / "manifest.json").read_text())
    memory = manifest["programs"][0]["memory"]
    program = record.program
    params = sum(spec_bytes(i.spec) for i in program.signature.inputs_of(InputKind.PARAMETER))
    assert memory["weights_bytes"] == params > 0
    assert params == sum(t.numel() * t.element_size() for t in program.parameters().values())
    optimizer = program.signature.inputs_of(InputKind.OPTIMIZER_STATE)
    assert memory["optimizer_state_bytes"] == sum(spec_bytes(i.spec) for i in optimizer)
    assert memory["gradients_bytes"] == (params if kind == "training" else 0)
    parts = (
        "weights_bytes",
        "buffers_bytes",
        "constants_bytes",
        "optimizer_state_bytes",
        "inputs_bytes",
        "gradients_bytes",
        "activations_bytes",
    )
    assert memory["total_bytes"] == sum(memory[p] for p in parts)
    assert 0 < memory["activations_bytes"] <= memory["intermediates_bytes"]
    assert memory["budget_bytes"] == TARGETS["trn3"].hbm_per_core_bytes == 36 << 30
    assert memory["method"]


# -- determinism -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stem", "kind"), [("mlp", "training"), ("gpt", "training"), ("moe", "inference")]
)
def test_identical_programs_give_identical_bytes(tmp_path, stem, kind):
    """Capture twice, lower twice: every file (graph.hlo first) is byte-identical."""
    outs = []
    for run in range(2):
        program = portable.capture_spec(_spec(stem), training=kind == "training")
        out = tmp_path / f"run{run}"
        portable.lower(program, "neuron:trn3", out)
        outs.append(_files(out))
    first, second = outs
    hlo = next(name for name in first if name.endswith("model/graph.hlo"))
    assert first[hlo] == second[hlo]
    assert first == second


# -- compiler command per target ---------------------------------------------------------------


@pytest.mark.parametrize("variant", ["trn1", "trn2", "trn3"])
@pytest.mark.parametrize("kind", ["inference", "training"])
def test_command_per_target(lowered, variant, kind):
    compiled, out = lowered("mlp", kind, variant)
    record = _record(compiled)
    argv = shlex.split((out / "programs" / record.key / "command.txt").read_text())
    assert argv[:5] == [
        "neuronx-cc",
        "compile",
        "--framework=XLA",
        f"--target={variant}",
        "model/graph.hlo",
    ]
    assert argv[5:9] == ["--output", "graph.neff", "--logfile", "log-neuron-cc.txt"]
    for flag in (
        "--model-type=transformer",
        "--auto-cast=none",
        "-O1",
        "--implicit-integer-downcast=all",
    ):
        assert flag in argv
    # the CLI reference: --native-int64 is "only available on trn2 and later"
    assert ("--native-int64=disabled" in argv) == (variant != "trn1")
    lnc = [a for a in argv if a.startswith(("--logical-nc-config", "-lnc"))]
    assert lnc == ([] if variant == "trn1" else ["--logical-nc-config=2"])
    assert ("--distribution-strategy=llm-training" in argv) == (kind == "training")

    manifest = json.loads((out / "manifest.json").read_text())
    not_flags = set(argv[:3] + argv[4:9]) | {"--verbose=35"}  # argv minus in/out paths
    assert manifest["neuron_cc_flags"] == shlex.join(a for a in argv if a not in not_flags)
    env = manifest["runtime_env"]
    assert ("NEURON_LOGICAL_NC_CONFIG" in env) == (variant != "trn1")
    if variant != "trn1":
        assert env["NEURON_LOGICAL_NC_CONFIG"]["value"] == "2"
    assert env["NEURON_RT_VISIBLE_CORES"]["value"] == "0"
    assert "NEURON_RT_STOCHASTIC_ROUNDING_EN" not in env  # float32 training: no bf16 rounding
    assert manifest["target"]["hbm_per_core_bytes"] == TARGETS[variant].hbm_per_core_bytes


def test_stochastic_rounding_for_bf16_training():
    from portable.backends.neuron.runtime_env import runtime_env

    bf16 = module_from_proto(
        proto_from_text(
            "HloModule m\nENTRY %main (p: f32[4]) -> bf16[4] {\n"
            "  %p = f32[4]{0} parameter(0)\n  ROOT %c = bf16[4]{0} convert(%p)\n}"
        )
    )
    options = NeuronOptions()
    training, inference = _program("mlp", "training"), _program("mlp", "inference")
    env = runtime_env(TARGETS["trn2"], options, training, bf16)
    assert env["NEURON_RT_STOCHASTIC_ROUNDING_EN"]["value"] == "1"
    assert "NEURON_RT_STOCHASTIC_ROUNDING_EN" not in runtime_env(
        TARGETS["trn2"], options, inference, bf16
    )
    assert "NEURON_LOGICAL_NC_CONFIG" not in runtime_env(TARGETS["trn1"], options, training, bf16)


def test_options_reach_the_command(tmp_path):
    backend = NeuronBackend(NeuronOptions(model_type="generic", auto_cast="matmult", optlevel=2))
    lowered = backend.lower(_program("mlp", "training"), portable.backends.Target("neuron"))
    backend.write(lowered, tmp_path)
    (record,) = lowered.payload.programs
    argv = shlex.split((tmp_path / "programs" / record.key / "command.txt").read_text())
    assert {"--model-type=generic", "--auto-cast=matmult", "-O2"} <= set(argv)
    assert "--distribution-strategy=llm-training" not in argv  # only for transformer training


# -- the written module, executed on XLA:CPU ---------------------------------------------------


def _run_written_hlo(path: Path, flat: list[torch.Tensor]) -> list[torch.Tensor]:
    """Deserialize graph.hlo as written, compile it with jaxlib's CPU client, run it."""
    import jax
    import jax.numpy as jnp
    from jax._src.lib import xla_client

    computation = xla_client.XlaComputation(path.read_bytes())
    module = xla_client._xla.mlir.xla_computation_to_mlir_module(computation)
    device = jax.devices("cpu")[0]
    devices = xla_client.DeviceList((device,))
    executable = device.client.compile_and_load(module, devices, xla_client.CompileOptions())
    with jax.enable_x64(True):  # copies: donated inputs must not be the program's own tensors
        args = [jax.device_put(jnp.array(t.detach().numpy(), copy=True), device) for t in flat]
        results = executable.execute_sharded(args).disassemble_into_single_device_arrays()
    return [torch.from_numpy(np.array(r[0], copy=True)) for r in results]


def _written_executable(compiled, out: Path) -> Executable:
    """An Executable whose every call runs the graph.hlo on disk, fed by io_spec.json."""
    record = _record(compiled)
    base = out / "programs" / record.key
    spec = json.loads((base / "io_spec.json").read_text())
    names = [i.name for i in record.program.signature.inputs]
    order = [names.index(entry["name"]) for entry in spec["inputs"]]
    hlo = base / "model" / "graph.hlo"
    return Executable(
        record.program, lambda flat: _run_written_hlo(hlo, [flat[k] for k in order]), "hlo"
    )


@pytest.mark.parametrize(("stem", "kind"), CASES, ids=IDS)
def test_written_hlo_matches_cpu(lowered, stem, kind):
    compiled, out = lowered(stem, kind)
    program = _program(stem, kind)
    got_exe, want_exe = _written_executable(compiled, out), portable.compile(program, "cpu")
    if kind == "inference":
        inputs = _spec(stem).inputs()
        got, want = got_exe(*inputs), want_exe(*inputs)
        got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        return
    batch = _spec(stem).batch()
    got, want = got_exe(*batch), want_exe(*batch)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-4, atol=0)
    assert set(got.state) == set(want.state)
    # AdamW moves a parameter by about lr * m / sqrt(v): where a gradient is rounding noise,
    # m / sqrt(v) is O(1) whatever its size, so a reordered sum shifts that element by a few
    # percent of lr (1e-3 in the examples; the xla backend shows the same). atol = 2% of lr.
    for key, value in want.state.items():
        torch.testing.assert_close(got.state[key], value, rtol=1e-4, atol=2e-5, msg=key)


# -- scripts/compile.sh ------------------------------------------------------------------------


@pytest.fixture
def fake_compiler(tmp_path, monkeypatch):
    """tests/fixtures/fake_neuronx_cc on PATH as `neuronx-cc`; returns its argv log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "neuronx-cc"
    source = FAKE_COMPILER.read_text().split("\n", 1)[1]
    exe.write_text(f"#!{sys.executable}\n{source}")
    exe.chmod(0o755)
    log = tmp_path / "argv.jsonl"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_NEURONX_CC_ARGV_LOG", str(log))
    return log


def _compile_sh(out: Path, cache: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(out / "scripts" / "compile.sh"), str(cache)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )


def test_compile_script_compiles_and_caches(lowered, tmp_path, fake_compiler):
    compiled, original = lowered("gpt", "training")
    out = tmp_path / "neuron"
    shutil.copytree(original, out)
    record = _record(compiled)
    cache = tmp_path / "cache"
    first = _compile_sh(out, cache)
    assert first.returncode == 0, first.stderr
    base = out / "programs" / record.key
    assert (base / "graph.neff").read_bytes().startswith(b"NEFF-FAKE")
    assert "Compiler status PASS" in (base / "log-neuron-cc.txt").read_text()
    (version,) = [p.name for p in cache.iterdir()]
    assert "2.99.0.0" in version
    assert (cache / version / record.cache_key / "graph.neff").is_file()
    (call,) = [json.loads(line) for line in fake_compiler.read_text().splitlines()]
    assert call["argv"] == list(record.argv[1:]) and Path(call["cwd"]) == base

    (base / "graph.neff").unlink()
    second = _compile_sh(out, cache)
    assert second.returncode == 0 and f"{record.key}: cached" in second.stdout
    assert (base / "graph.neff").is_file()
    assert len(fake_compiler.read_text().splitlines()) == 1  # not compiled again


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("oom", "the host ran out of memory"),
        ("crash", "crashed (exit 134: signal 6)"),
        ("unsupported", "error codes NCC_EVRF001"),
        ("cfg", "error codes NCC_CFG015 NCC_EVRF011"),  # three- and four-letter families
        ("nopass", "without 'Compiler status PASS'"),
    ],
)
def test_compile_script_explains_failures(lowered, tmp_path, fake_compiler, mode, message):
    _, original = lowered("mlp", "inference")
    out = tmp_path / "neuron"
    shutil.copytree(original, out)
    result = _compile_sh(out, tmp_path / "cache", FAKE_NEURONX_CC_FAIL=mode)
    assert result.returncode == 1
    assert message in result.stderr and "1 of 1 program(s) failed: MLP" in result.stderr
    assert not list((tmp_path / "cache").rglob("graph.neff"))  # failures are never cached


def test_compile_script_without_compiler(lowered, tmp_path):
    _, out = lowered("mlp", "inference")
    env = {"PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        ["bash", str(out / "scripts" / "compile.sh"), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode == 127 and "neuronx-cc is not on PATH" in result.stderr
    assert subprocess.run(["bash", "-n", str(out / "scripts" / "compile.sh")]).returncode == 0


def test_fp64_downcast_warns_and_lowers_float32(tmp_path):
    class Doubles(torch.nn.Module):
        def forward(self, x):
            return (x.double() * 2).float()  # the float64 line

    program = portable.capture(Doubles(), (torch.randn(4),))
    compiled = portable.lower(program, "neuron:trn3", tmp_path)
    record = _record(compiled)
    assert not any("f64" in i.elements for i in record.module.instructions())
    (warning,) = [f for f in record.findings if f.code == "fp64-downcast"]
    assert warning.count == 2 and "the float64 line" in warning.source
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["validation"]["warnings"] == len(record.findings)
    x = torch.randn(4)
    (got,) = _run_written_hlo(tmp_path / "programs" / record.key / "model" / "graph.hlo", [x])
    torch.testing.assert_close(got, x * 2)


def test_int64_warning_names_the_node_and_line():
    class Index(torch.nn.Module):
        def forward(self, i):
            return i * 3 + 1  # the int64 line

    program = portable.capture(Index(), (torch.arange(4),))
    record = _record(portable.lower(program, "neuron:trn1"))
    (warning,) = [f for f in record.findings if f.code == "int64-downcast" and f.node == "mul"]
    assert "the int64 line" in warning.source and "int32" in warning.what


def test_manifest_states_the_layout_and_target_claims_exactly(lowered):
    _, out = lowered("mlp", "inference")
    manifest = json.loads((out / "manifest.json").read_text())
    layout = manifest["compile"]["layout"]
    assert "model/graph.hlo, graph.neff and the compiler log" in layout["nxd_model_builder"]
    assert "_tp0_bk<N>" in layout["nxd_model_builder"]
    for ours in ("command.txt", "io_spec.json", "manifest.json", "scripts/compile.sh"):
        assert ours in layout["portable_only"]
    assert "not yet in the 2.32 CLI reference" in manifest["toolchain"]["target_flag"]
    assert "trn2 and later" in manifest["toolchain"]["int64_flags"]
    needs = manifest["verification"]["needs_hardware"]
    assert any("--target=trn3 included" in s for s in needs)
    assert any("readings of the documentation" in s and "TOTALORDER" in s for s in needs)


@pytest.mark.parametrize("stem", ["gpt", "llama"])
@pytest.mark.parametrize("kind", ["inference", "training"])
def test_token_models_give_no_int64_warning(lowered, stem, kind):
    """Token ids index the embedding and the loss's gather; positions are iotas over static
    shapes: the int64 range analysis proves every int64 value of these programs exact in int32."""
    compiled, _ = lowered(stem, kind)
    record = _record(compiled)
    assert any("s64" in i.elements for i in record.module.instructions())
    assert [f.render() for f in record.findings if f.code == "int64-downcast"] == []


# -- the HLO reader ----------------------------------------------------------------------------


def test_parser_agrees_with_xla(lowered):
    """Every computation's instruction names and opcodes match jaxlib's own HloModule."""
    from jax._src.lib import xla_client

    compiled, _ = lowered("gpt", "training")
    record = _record(compiled)
    xla_module = xla_client.XlaComputation(record.hlo).get_hlo_module()
    ours = {c.name: c for c in record.module.computations}
    assert set(ours) == {c.name for c in xla_module.computations()}
    for computation in xla_module.computations():
        mine = ours[computation.name].by_name()
        theirs = list(computation.instructions())
        assert sorted(mine) == sorted(i.name for i in theirs)
        for instruction in theirs:  # XLA's own one-line print has the opcode we parsed
            assert f" {mine[instruction.name].opcode}(" in instruction.to_string()


def test_state_must_be_aliased(lowered):
    compiled, _ = lowered("mlp", "training")
    record = _record(compiled)
    header, rest = record.hlo_text.split("\n", 1)
    unaliased = header.split(" input_output_alias=")[0] + " " + header.split("}, ", 1)[1]
    module = parse_hlo_text(unaliased + "\n" + rest)
    assert not module.aliases
    findings = validate(module, TARGETS["trn3"], program=record.program)
    state = record.program.signature.aliasing()
    assert [f.code for f in findings if f.severity is Severity.ERROR] == (
        ["state-not-aliased"] * len(state)
    )
    assert {f.node for f in findings} == set(state.values())
    assert "never constants" in findings[0].fix


def test_parser_reads_types_aliases_and_metadata():
    text = """HloModule m, input_output_alias={ {0}: (1, {}, may-alias) }

ENTRY %main (a: f32[2,3], b: f32[4]) -> (f32[4], (s32[], f32[<=8])) {
  %a = f32[2,3]{1,0} parameter(0)
  %b = f32[4]{0} parameter(1), metadata={op_name="flat[1]"}
  %n = f32[4]{0} negate(%b), metadata={op_name="jit(fn)/neg_1/neg" source_file="x.py"}
  %i = s32[] constant(3)
  %d = f32[<=8]{0} parameter(2)
  ROOT %t = (f32[4]{0}, (s32[], f32[<=8]{0})) tuple(%n, %i)
}
"""
    module = parse_hlo_text(text)
    assert [(a.output_index, a.parameter) for a in module.aliases] == [((0,), 1)]
    by_name = module.entry.by_name()
    assert by_name["n"].op_name == "jit(fn)/neg_1/neg" and by_name["n"].operands == ("b",)
    assert by_name["a"].leaves[0].nbytes == 24 and by_name["a"].parameter_number == 0
    root = module.entry.root
    assert (
        root.is_root
        and root.is_tuple
        and [str(x) for x in root.leaves]
        == [
            "f32[4]",
            "s32[]",
            "f32[<=8]",
        ]
    )
    assert not root.leaves[2].is_static


# -- the CLI -----------------------------------------------------------------------------------


def test_cli_lowers_for_neuron(tmp_path):
    from portable.cli import main

    out = tmp_path / "out"
    code = main(
        [
            "lower",
            f"{REPO / 'examples' / 'mlp.py'}:MLP",
            "--target",
            "neuron:trn3",
            "--train",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    manifest = json.loads((out / "neuron_trn3" / "manifest.json").read_text())
    assert manifest["program"]["kind"] == "training_step"
    assert (out / "neuron_trn3" / "programs" / "MLP.train_step" / "model" / "graph.hlo").is_file()
