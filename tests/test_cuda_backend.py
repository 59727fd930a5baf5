"""The `cuda` backend on a machine without a GPU: lowering decisions, the written layout, the
`.pt2` (reloaded and run on CPU, equal to the `cpu` backend), the kernel graph run on CPU with
its Triton kernels in Triton's interpreter, and the refusals.

What needs a GPU (torch.compile on CUDA, native MX matmul, kernel bandwidth) is checked by
`benchmarks/gpu_check.py` on a GPU machine (docs/backends/cuda.md).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

import portable
from portable.backends import Target, get_backend
from portable.errors import ArchiveError, BackendError
from portable.ir.program import ProgramKind
from tests.support import EXAMPLES, load_spec

pytest.importorskip("triton")

from portable.backends.cuda import CudaBackend, CudaOptions, load_pt2  # noqa: E402
from portable.backends.cuda.lowering import export_graph, retarget_devices  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
aten = torch.ops.aten


@functools.cache
def _spec(stem: str):
    return load_spec(stem)


@functools.cache
def _program(stem: str, kind: str):
    return portable.capture_spec(_spec(stem), training=kind == "training")


def _inputs(stem: str, kind: str):
    spec = _spec(stem)
    return spec.batch() if kind == "training" else spec.inputs()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """`written(stem, kind)` -> (Written, out_dir) for cuda:sm_90,sm_100, once per module."""
    cache: dict[tuple, tuple] = {}

    def get(stem: str, kind: str):
        if (stem, kind) not in cache:
            out = tmp_path_factory.mktemp(f"{stem}_{kind}") / "cuda"
            compiled = portable.lower(_program(stem, kind), "cuda:sm_90,sm_100", out)
            cache[stem, kind] = (compiled, out)
        return cache[stem, kind]

    return get


# -- registration and refusal ------------------------------------------------------------------


def test_registered_and_refuses_to_run_without_a_gpu():
    backend = get_backend("cuda")
    assert backend.capabilities().combines_variants
    assert set(backend.capabilities().variants) == {"sm_90", "sm_100"}
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    ok, why = backend.can_execute_here()
    assert not ok and "no CUDA device" in why
    with pytest.raises(BackendError) as err:
        portable.compile(_program("mlp", "inference"), backend="cuda")
    message = str(err.value)
    assert "cuda" in message and "cpu" in message and "portable lower" in message


def test_unknown_arch_lists_the_archs():
    with pytest.raises(BackendError, match="sm_90, sm_100"):
        portable.lower(_program("mlp", "inference"), "cuda:sm_80")


def test_bare_cuda_lowers_every_arch():
    compiled = portable.lower(_program("mlp", "inference"), "cuda")
    assert [a.name for a in compiled.lowered.payload.archs] == ["sm_90", "sm_100"]
    assert str(compiled.lowered.target) == "cuda:sm_90,sm_100"


# -- lowering decisions ------------------------------------------------------------------------


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_portable_ops_become_pytorch_ops_where_pytorch_covers_them():
    program = _program("llama", "training")
    gm, decisions = export_graph(program)
    targets = _targets(gm)
    assert aten.scaled_dot_product_attention.default in targets
    assert aten.rms_norm.default in targets
    assert torch.ops.portable.attention.default not in targets
    assert torch.ops.portable.rms_norm.default not in targets
    # backward ops keep their device-generic kernels
    assert torch.ops.portable.attention_backward.default in targets
    sdpa = [d for d in decisions if d.impl == "sdpa"]
    assert len(sdpa) == 2 and all("llama.py" in d.source for d in sdpa)
    # grouped-query attention passes enable_gqa
    node = next(n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default)
    assert node.kwargs["enable_gqa"] is True and node.kwargs["is_causal"] is True


class _MaskedCausal(torch.nn.Module):
    """Attention with a padding mask *and* causal: SDPA refuses both, the Triton kernel takes it."""

    def forward(self, q, k, v, keep):
        return torch.ops.portable.attention(q, k, v, keep, True, None)


def _masked_causal_inputs():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    keep = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    keep[..., 6:] = False  # padded keys
    return q, k, v, keep


def test_mask_with_causal_goes_to_the_triton_attention_kernel():
    program = portable.capture(_MaskedCausal(), _masked_causal_inputs())
    compiled = portable.lower(program, "cuda:sm_90")
    payload = compiled.lowered.payload
    (decision,) = payload.decisions
    assert decision.impl == "triton:attention" and "is_causal" in decision.reason
    assert torch.ops.portable.attention.default in _targets(payload.export_gm)
    kernels = {p.kernel for p in payload.launches["sm_90"]}
    assert len(kernels) == 1 and next(iter(kernels)).startswith("attention")


def test_softmax_runs_as_the_fused_softmax_kernel(written):
    compiled, _ = written("gpt", "inference")
    payload = compiled.lowered.payload
    for arch in ("sm_90", "sm_100"):
        decisions = payload.arch_decisions[arch]
        assert decisions and all(d.impl == "triton:scale_mask_softmax" for d in decisions)
        assert aten._softmax.default not in _targets(payload.kernel_gms[arch])
    assert aten._softmax.default in _targets(payload.export_gm)  # the .pt2 keeps ATen's softmax


# -- the written layout ------------------------------------------------------------------------


def _elf_arch(cubin: bytes) -> int:
    """The SM a CUDA ELF is for (EM_CUDA = 190; ELF ABI v8 keeps the SM in e_flags[15:8])."""
    assert cubin[:4] == b"\x7fELF" and cubin[4] == 2  # 64-bit ELF
    assert int.from_bytes(cubin[18:20], "little") == 190
    return (int.from_bytes(cubin[48:52], "little") >> 8) & 0xFF


@pytest.mark.parametrize("kind", ["inference", "training"])
def test_layout_and_manifest(written, kind):
    compiled, out = written("gpt", kind)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "portable.cuda" and manifest["format_version"] == 1
    assert manifest["program"]["kind"] == kind.replace("training", "training_step")
    assert set(manifest["toolchain"]) >= {"torch", "triton", "ptxas"}
    assert (out / "program.pt2").is_file() and (out / "graph.py").is_file()
    assert set(manifest["archs"]) == {"sm_90", "sm_100"}
    for arch, cap in (("sm_90", 90), ("sm_100", 100)):
        record = manifest["archs"][arch]
        assert record["ptx_target"] == f"{arch}a"
        assert record["native_mx_matmul"] is (arch == "sm_100")
        assert record["triton_kernels"] == ["scale_mask_softmax"]
        assert (out / arch / "graph.py").is_file()
        assert record["kernels"], "GPT's softmax needs a kernel"
        for kernel in record["kernels"]:
            files = {Path(f).suffix: out / f for f in kernel["files"]}
            assert set(files) == {".ptx", ".cubin", ".json"}
            ptx = files[".ptx"].read_text()
            assert f".target {arch}a" in ptx and f".entry {kernel['function']}" in ptx
            assert _elf_arch(files[".cubin"].read_bytes()) == cap
            meta = json.loads(files[".json"].read_text())
            assert meta["arch"] == arch and meta["num_warps"] == kernel["num_warps"]
            assert {"signature", "constexprs", "grid", "grid_rule", "shared_memory_bytes"} <= set(
                meta
            )
            import hashlib

            assert meta["cubin_sha256"] == hashlib.sha256(files[".cubin"].read_bytes()).hexdigest()


def test_identical_programs_give_identical_kernels(written, tmp_path):
    _, out = written("gpt", "inference")
    again = tmp_path / "cuda"
    portable.lower(_program("gpt", "inference"), "cuda:sm_90,sm_100", again)
    for path in out.rglob("*"):
        if path.suffix in (".ptx", ".cubin", ".py"):
            assert path.read_bytes() == (again / path.relative_to(out)).read_bytes(), path


# -- the .pt2 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stem", EXAMPLES)
def test_pt2_reloads_and_matches_the_cpu_backend(written, stem):
    _, out = written(stem, "inference")
    module = load_pt2(out / "program.pt2").module()
    inputs = _inputs(stem, "inference")
    want = portable.compile(_program(stem, "inference"), backend="cpu")(*inputs)
    got = module(*inputs)
    assert torch.equal(got, want)


@pytest.mark.parametrize("stem", ["mlp", "gpt", "llama"])
def test_pt2_training_step_updates_its_buffers_like_the_cpu_backend(written, stem):
    _, out = written(stem, "training")
    manifest = json.loads((out / "manifest.json").read_text())
    module = load_pt2(out / "program.pt2").module()
    cpu = portable.compile(_program(stem, "training"), backend="cpu")
    for _ in range(3):
        batch = _inputs(stem, "training")
        loss = module(*batch)
        step = cpu(*batch)
        assert torch.equal(loss, step.loss)
    buffers = dict(module.named_buffers())
    for name, key in manifest["pt2"]["buffers"].items():
        assert torch.equal(buffers[name], cpu.state[key]), key


def test_a_failed_pt2_export_writes_nothing_and_says_so(tmp_path, monkeypatch):
    """The layout is written whole or not at all: when torch.export refuses the program, the
    error says nothing was written (it used to promise kernels and graph.py that were not)."""

    def refuse(*args, **kwargs):
        raise RuntimeError("export refused")

    program = _program("mlp", "inference")
    monkeypatch.setattr(torch.export, "export", refuse)
    out = tmp_path / "cuda"
    with pytest.raises(portable.LoweringError) as err:
        portable.lower(program, "cuda:sm_90", out)
    assert "export refused" in str(err.value) and "nothing was written" in err.value.fix
    assert "still usable" not in str(err.value)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_pt2_has_no_pickle_and_pickled_archives_are_refused(written, tmp_path):
    import zipfile

    _, out = written("mlp", "inference")
    with zipfile.ZipFile(out / "program.pt2") as z:
        pickled = [i for i in z.infolist() if i.filename.endswith(".pt") and i.file_size]
    assert not pickled
    # a .pt2 as torch.export.save writes it by default (example inputs pickled) is refused
    ep = torch.export.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),))
    torch.export.save(ep, tmp_path / "default.pt2")
    with pytest.raises(ArchiveError, match="pickle"):
        load_pt2(tmp_path / "default.pt2")
    (tmp_path / "junk.pt2").write_bytes(b"not a zip")
    with pytest.raises(ArchiveError, match="not a .pt2"):
        load_pt2(tmp_path / "junk.pt2")


# -- the kernel graph on CPU, Triton kernels interpreted ---------------------------------------


def _interpreted(program, arch="sm_90"):
    backend = CudaBackend(CudaOptions(device="cpu", torch_compile=False))
    return backend.executable(backend.write(backend.lower(program, Target("cuda", arch))))


@pytest.mark.parametrize("stem", ["mlp", "gpt", "llama"])
def test_kernel_graph_matches_cpu_in_the_interpreter(stem):
    program = _program(stem, "inference")
    inputs = _inputs(stem, "inference")
    got = _interpreted(program)(*inputs)
    want = portable.compile(program, backend="cpu")(*inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_training_steps_in_the_interpreter_match_cpu():
    program = _program("gpt", "training")
    assert program.kind is ProgramKind.TRAINING_STEP
    exe, cpu = _interpreted(program, "sm_100"), portable.compile(program, backend="cpu")
    for _ in range(3):
        batch = _inputs("gpt", "training")
        got, want = exe(*batch), cpu(*batch)
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    for key, value in cpu.state.items():
        torch.testing.assert_close(exe.state[key], value, rtol=1e-4, atol=5e-5, msg=key)


@pytest.mark.parametrize("kind", ["inference", "training"])
def test_kernel_graph_traces_whole_under_torch_compile(kind):
    """Dynamo sees one opaque op per Triton kernel: the whole graph traces without a break."""
    program = _program("gpt", kind)
    gm = portable.lower(program, "cuda:sm_90").lowered.payload.kernel_gms["sm_90"]
    retarget_devices(gm, "cpu")  # run here (the kernel graph creates its tensors on the GPU)
    batch = iter(_inputs("gpt", kind))
    flat = [
        next(batch) if i.target is None else program.weights[i.target]
        for i in program.signature.inputs
    ]
    compiled = torch.compile(gm, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        for got, want in zip(compiled(*flat), gm(*flat), strict=True):
            assert torch.equal(got, want)


def test_executable_with_inductor_on_cpu():
    """The executable's torch.compile path (Inductor), here on CPU with interpreted kernels."""
    x = torch.randn(16, 64)
    program = portable.capture(_MXLinear("e4m3"), (x,))
    backend = CudaBackend(CudaOptions(device="cpu", torch_compile=True))
    exe = backend.executable(backend.write(backend.lower(program, Target("cuda", "sm_100"))))
    want = portable.compile(program, backend="cpu")(x)
    torch.testing.assert_close(exe(x), want, rtol=1e-6, atol=1e-6)


def test_masked_causal_attention_kernel_in_the_graph():
    inputs = _masked_causal_inputs()
    program = portable.capture(_MaskedCausal(), inputs)
    got = _interpreted(program)(*inputs)
    want = portable.compile(program, backend="cpu")(*inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# -- the CLI -----------------------------------------------------------------------------------


def test_cli_lowers_both_archs_into_one_folder(tmp_path):
    from portable.cli.app import main

    out = tmp_path / "out"
    code = main(
        [
            "lower",
            str(REPO / "examples" / "gpt.py") + ":GPT",
            "--target",
            "cuda:sm_90",
            "--target",
            "cuda:sm_100",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    top = json.loads((out / "manifest.json").read_text())
    (target,) = top["targets"]
    assert target["target"] == "cuda:sm_90,sm_100" and target["dir"] == "cuda"
    assert (out / "cuda" / "sm_90" / "kernels").is_dir()
    assert (out / "cuda" / "sm_100" / "kernels").is_dir()


def test_cli_aot_needs_a_cuda_device(tmp_path, capsys):
    from portable.cli.app import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    spec = str(REPO / "examples" / "mlp.py") + ":MLP"
    code = main(["lower", spec, "--target", "cuda", "--aot", "--out", str(tmp_path / "o")])
    assert code != 0
    err = capsys.readouterr().err
    assert "--aot" in err and "CUDA device" in err
    assert not (tmp_path / "o").exists()


# -- MX: quantize/dequantize kernels and the native MX matmul on sm_100 ------------------------


class _MXLinear(torch.nn.Module):
    """A linear layer whose operands are MX quantize-dequantized along K (what the mx-quantize
    pass writes in `real` mode): `addmm(b, dq(x), t(dq(w)))`."""

    def __init__(self, fmt: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(32, 64))
        self.b = torch.nn.Parameter(torch.randn(32))
        self.fmt = fmt

    def forward(self, x):
        ops = torch.ops.portable
        cx, sx = ops.mx_quantize(x, self.fmt, 1, "rceil", 32)
        cw, sw = ops.mx_quantize(self.w, self.fmt, 1, "rceil", 32)
        xq = ops.mx_dequantize(cx, sx, self.fmt, 1, torch.float32, 32)
        wq = ops.mx_dequantize(cw, sw, self.fmt, 1, torch.float32, 32)
        return torch.nn.functional.linear(xq, wq, self.b)


def test_mx_matmul_is_native_on_sm_100_and_emulated_on_sm_90(tmp_path):
    x = torch.randn(16, 64)
    program = portable.capture(_MXLinear("e4m3"), (x,))
    portable.lower(program, "cuda:sm_90,sm_100", tmp_path / "cuda")
    manifest = json.loads((tmp_path / "cuda" / "manifest.json").read_text())
    sm90, sm100 = manifest["archs"]["sm_90"], manifest["archs"]["sm_100"]
    assert [d["impl"] for d in sm100["native"]] == ["native-mx"] and not sm100["emulated"]
    assert [d["impl"] for d in sm90["emulated"]] == ["emulated-mx"] and not sm90["native"]
    assert "no MX matmul" in sm90["emulated"][0]["reason"]
    assert "mx_matmul" in (tmp_path / "cuda" / "sm_100" / "graph.py").read_text()
    assert "mx_matmul" not in (tmp_path / "cuda" / "sm_90" / "graph.py").read_text()
    for record in (sm90, sm100):
        assert {"mx_quantize", "mx_dequantize"} <= set(record["triton_kernels"])
        assert {k["kernel"] for k in record["kernels"]} >= {"mx_quantize", "mx_dequantize"}


def test_mx_formats_without_native_gemm_stay_emulated_on_sm_100():
    program = portable.capture(_MXLinear("e2m1"), (torch.randn(16, 64),))
    compiled = portable.lower(program, "cuda:sm_100")
    (decision,) = compiled.lowered.payload.arch_decisions["sm_100"]
    assert decision.impl == "emulated-mx" and "e2m1" in decision.reason


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_mx_program_in_the_interpreter_is_bit_exact_with_cpu(arch):
    x = torch.randn(16, 64) * 3
    program = portable.capture(_MXLinear("e4m3"), (x,))
    got = _interpreted(program, arch)(x)
    want = portable.compile(program, backend="cpu")(x)
    assert torch.equal(got, want)  # quantize kernels are bit-exact; same addmm on both


def test_a_failed_lowering_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    from portable.backends.cuda import aot
    from portable.errors import LoweringError

    out = tmp_path / "cuda"
    out.mkdir()
    (out / "keep.txt").write_text("mine")

    def refuse(launches, arch):
        raise LoweringError("Triton refused", backend="cuda", fix="-")

    monkeypatch.setattr(aot, "compile_kernels", refuse)
    with pytest.raises(LoweringError):
        portable.lower(_program("gpt", "inference"), "cuda:sm_90", out)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["cuda"]  # no temporary folder left


def test_kernel_graphs_create_tensors_on_the_gpu_and_executables_on_their_device(written):
    """Capture traced on CPU (`arange(..., device=cpu)`); the kernel graph is for the GPU."""
    compiled, out = written("gpt", "training")
    export_code = (out / "graph.py").read_text()
    assert "device(type='cpu')" in export_code  # the .pt2's graph: move_to_device_pass moves it
    for arch in ("sm_90", "sm_100"):
        code = (out / arch / "graph.py").read_text()
        assert "device(type='cpu')" not in code and "device(type='cuda')" in code


class _MXBackwardGemms(torch.nn.Module):
    """The input- and weight-gradient GEMMs of the MX training recipe, written out:
    dX = dq(dY along N) @ dq(W along N) and dW = dq(dY along M)^T @ dq(X along M)."""

    def forward(self, dy, w, x):
        ops = torch.ops.portable

        def qdq(t, axis):
            codes, scales = ops.mx_quantize(t, "e4m3", axis, "rceil", 32)
            return ops.mx_dequantize(codes, scales, "e4m3", axis, torch.float32, 32)

        return qdq(dy, 1) @ qdq(w, 0), qdq(dy, 0).t() @ qdq(x, 0)


def _backward_gemm_inputs():
    torch.manual_seed(0)
    return torch.randn(32, 64), torch.randn(64, 96), torch.randn(32, 96)  # dy [M,N], w [N,K], x


def test_gradient_gemms_in_either_orientation_go_native_on_sm_100():
    inputs = _backward_gemm_inputs()
    program = portable.capture(_MXBackwardGemms(), inputs)
    decisions = portable.lower(program, "cuda:sm_100").lowered.payload.arch_decisions["sm_100"]
    assert [d.impl for d in decisions] == ["native-mx", "native-mx"]
    got = _interpreted(program, "sm_100")(*inputs)  # on CPU: the emulation inside mx_matmul
    want = portable.compile(program, backend="cpu")(*inputs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


class _MXScaledAddmm(torch.nn.Module):
    """beta * bias + alpha * (dq(x) @ dq(w)): the native GEMM has no alpha or beta."""

    def forward(self, bias, x, w):
        ops = torch.ops.portable

        def qdq(t, axis):
            codes, scales = ops.mx_quantize(t, "e4m3", axis, "rceil", 32)
            return ops.mx_dequantize(codes, scales, "e4m3", axis, torch.float32, 32)

        return torch.addmm(bias, qdq(x, 1), qdq(w, 0), beta=0.5, alpha=2.0)


def test_addmm_with_alpha_or_beta_stays_emulated_and_right_on_sm_100():
    torch.manual_seed(0)
    inputs = (torch.randn(16, 32), torch.randn(16, 64), torch.randn(64, 32))
    program = portable.capture(_MXScaledAddmm(), inputs)
    (decision,) = portable.lower(program, "cuda:sm_100").lowered.payload.arch_decisions["sm_100"]
    assert decision.impl == "emulated-mx" and "alpha or beta" in decision.reason
    got = _interpreted(program, "sm_100")(*inputs)
    want = portable.compile(program, backend="cpu")(*inputs)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_fake_quantization_stays_emulated_on_sm_100():
    program = portable.capture(_MXLinear("e4m3"), (torch.randn(16, 64),))
    program.metadata["mx_quantize"] = {"mode": "fake"}
    (decision,) = portable.lower(program, "cuda:sm_100").lowered.payload.arch_decisions["sm_100"]
    assert decision.impl == "emulated-mx" and "mode=fake" in decision.reason


def test_a_program_with_a_dynamic_dim_exports_a_pt2_that_takes_other_sizes(tmp_path):
    """The .pt2 of a program with a dynamic batch (the format-2 fixture) declares the dim again
    for `forward(*inputs)`'s one vararg (it was refused: `dynamic_shapes[0]` was the first input's
    declaration) and runs other batch sizes as the cpu backend does."""
    fixture = Path(__file__).parent / "fixtures" / "archive_v2" / "mlp.portable"
    program = portable.load(fixture)
    backend = CudaBackend(CudaOptions(device="cpu", torch_compile=False))
    backend.write(backend.lower(program, Target("cuda", "sm_90")), tmp_path / "cuda")
    module = load_pt2(tmp_path / "cuda" / "program.pt2").module()
    cpu = portable.compile(program, backend="cpu")
    features = program.signature.user_inputs[0].spec.shape[1]
    for batch in (3, 7):
        x = torch.randn(batch, features)
        assert torch.equal(module(x), cpu(x))
