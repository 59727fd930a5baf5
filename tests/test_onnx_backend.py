"""The `onnx` backend: export through torch.onnx (dynamo), run on ONNX Runtime (CPU), compare
with the `cpu` reference.

Tolerance: rtol 1e-5, atol 1e-6 (|onnx - cpu| <= atol + rtol * |cpu|), the project's inference
tolerance. The atol covers outputs that cancel to ~0 (max rel error there reaches 1e-2 while
the abs error stays ~2e-7): ORT's MLAS GEMMs accumulate in another order than PyTorch's.

Covered: every example and Hugging Face GPT-2, Llama and BERT (small configs, no downloads), as
captured and after `softmax-fusion,mx-quantize{mode=fake}` (the ONNX graph then holds `Attention`
and the MX rules); the attention, norm, softmax and one-rank collective rules op by op; dynamic
batch and sequence dims; external data; the checker; the refusals; the CLI.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from torch.export import Dim

import portable
from portable.backends import Target, get_backend
from portable.cli import ExitCode, main
from portable.opset import op_name
from portable.passes import PassManager, parse_pipeline
from portable.testing import assert_parity, compare
from tests.support import EXAMPLES, load_spec

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

P = torch.ops.portable
TOL = {"rtol": 1e-5, "atol": 1e-6}
FUSED_MX = "softmax-fusion,mx-quantize{mode=fake}"
# every linear layer, the first and last too (the MLP has only those two)
FUSED_MX_ALL = "softmax-fusion,mx-quantize{mode=fake,keep_first_last=false}"
GPT = f"{Path(__file__).resolve().parents[1] / 'examples' / 'gpt.py'}:GPT"


def _ops(program) -> set[str]:
    return {op_name(n.target) for n in program.graph.nodes if n.op == "call_function"}


def _onnx_ops(lowered) -> set[str]:
    model = onnx.load(str(lowered.payload.path), load_external_data=False)
    return {node.op_type for node in model.graph.node}


def _check(program, *input_sets) -> set[str]:
    """Lower once, run the ONNX model and `cpu` on each input set, compare every output within
    TOL; the ONNX graph's op types."""
    lowered = get_backend("onnx").lower(program, Target("onnx"))
    _compare(lowered, *input_sets)
    return _onnx_ops(lowered)


def _compare(lowered, *input_sets) -> None:
    backend, program = get_backend("onnx"), lowered.program
    run = backend.executable(backend.write(lowered))
    reference = portable.compile(program)
    names = [o.name for o in program.signature.outputs]
    for inputs in input_sets:
        got, want = run(*inputs), reference(*inputs)
        got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
        assert len(got) == len(want) == len(names)
        for name, g, w in zip(names, got, want, strict=True):
            row = compare("onnx", f"output {name}", g, w, **TOL)
            assert row.ok, row


def _after(program, pipeline: str):
    return PassManager(parse_pipeline(pipeline)).run(program)[0]


@functools.cache
def _captured(stem: str) -> portable.Program:
    """The inference capture of examples/<stem>.py, once per module: passes and backends copy
    what they change, so the tests share it."""
    return portable.capture_spec(load_spec(stem))


# --------------------------------------------------------------------------- examples


@pytest.mark.parametrize("stem", EXAMPLES)
def test_example_inference(stem, example_spec):
    spec = example_spec(stem)
    program = _captured(stem)
    report = assert_parity(program, spec.inputs(), backends=["cpu", "onnx"], **TOL)
    compared = {r.quantity for r in report.rows if r.backend == "onnx"}
    assert compared == {f"output {o.name}" for o in program.signature.outputs}


@pytest.mark.parametrize("stem", EXAMPLES)
def test_example_after_softmax_fusion_and_mx(stem, example_spec):
    spec = example_spec(stem)
    program = _after(_captured(stem), FUSED_MX_ALL)
    ops = _ops(program)
    assert {"portable.mx_quantize.default", "portable.mx_dequantize.default"} <= ops
    onnx_ops = _check(program, spec.inputs())
    if "portable.attention.default" in ops:  # GPT's softmax(q @ k^T) @ v is fused here
        assert "Attention" in onnx_ops


# --------------------------------------------------------------------------- Hugging Face

HF = ["gpt2", "llama", "bert"]


def _hf_inputs(name):
    ids = torch.randint(0, 128, (2, 16))
    if name != "bert":
        return (ids,)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 8:] = 0  # a padded sequence: attention gets a mask
    return ids, mask


_HF_CAPTURED: dict[str, tuple] = {}


@pytest.mark.hf
@pytest.mark.parametrize("pipeline", ["", FUSED_MX])
@pytest.mark.parametrize("name", HF)
def test_hf_inference(name, pipeline, hf_model):
    if name not in _HF_CAPTURED:  # one capture per model, as captured and after the pipeline
        torch.manual_seed(0)
        model = hf_model(name).eval()
        inputs = _hf_inputs(name)
        _HF_CAPTURED[name] = portable.capture(model, inputs), inputs
    program, inputs = _HF_CAPTURED[name]
    if pipeline:
        program = _after(program, pipeline)
        assert "portable.mx_quantize.default" in _ops(program)
    assert "Attention" in _check(program, inputs)  # HF's sdpa -> portable.attention -> Attention


# --------------------------------------------------------------------------- op by op


class _Attention(torch.nn.Module):
    def __init__(self, masked: bool, is_causal: bool, scale: float | None, rank: int) -> None:
        super().__init__()
        self.masked, self.is_causal, self.scale, self.rank = masked, is_causal, scale, rank

    def forward(self, q, k, v, mask):
        if self.rank == 3:  # [heads, seq, dim]: the decomposition, not ONNX's 3-D Attention
            q, k, v, mask = q[0], k[0], v[0], mask[0]
        return P.attention(q, k, v, mask if self.masked else None, self.is_causal, self.scale)


ATTENTION_CASES = {
    # name: (masked, bool mask, causal, scale, kv heads, rank)
    "plain": (False, True, False, None, 4, 4),
    "causal": (False, True, True, None, 4, 4),
    "bool mask, scale": (True, True, False, 0.3, 4, 4),
    "float mask": (True, False, False, None, 4, 4),
    "causal and mask, gqa": (True, True, True, None, 2, 4),
    "gqa": (False, True, False, None, 2, 4),
    "3-d causal and mask": (True, True, True, None, 4, 3),
    "3-d float mask": (True, False, False, 0.2, 4, 3),
    "3-d gqa, causal": (False, True, True, None, 2, 3),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_rule(case):
    masked, bool_mask, causal, scale, kv_heads, rank = ATTENTION_CASES[case]
    torch.manual_seed(0)
    lk = 6 if causal else 7  # Lq != Lk where causal does not need a square
    q = torch.randn(2, 4, 6, 8)
    k, v = torch.randn(2, kv_heads, lk, 8), torch.randn(2, kv_heads, lk, 5)
    if bool_mask:
        mask = torch.rand(2, 1, 6, lk) > 0.3
        mask[..., 0] = True  # no fully masked row
    else:
        mask = torch.randn(2, 1, 6, lk)
    program = portable.capture(_Attention(masked, causal, scale, rank), (q, k, v, mask))
    assert ("Attention" in _check(program, (q, k, v, mask))) == (rank == 4)


def test_attention_fully_masked_row_is_zero_as_on_cpu():
    q = torch.randn(1, 2, 3, 4)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    mask[0, 0, 1] = False
    program = portable.capture(_Attention(True, False, None, 4), (q, q, q, mask))
    _check(program, (q, q, q, mask))
    out = portable.compile(program, backend="onnx")(q, q, q, mask)
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))


class _Softmax(torch.nn.Module):
    def __init__(self, mask: str | None, dim: int) -> None:
        super().__init__()
        self.mask, self.dim = mask, dim

    def forward(self, x, mask):
        return P.scale_mask_softmax(x, mask if self.mask else None, 0.7, self.dim)


@pytest.mark.parametrize("mask, dim", [(None, -1), ("bool", -1), ("float", 1)])
def test_scale_mask_softmax_rule(mask, dim):
    x = torch.randn(2, 3, 5)
    m = torch.rand(1, 3, 5) > 0.3 if mask == "bool" else torch.randn(1, 3, 5)
    _check(portable.capture(_Softmax(mask, dim), (x, m)), (x, m))


class _NormsAndCollectives(torch.nn.Module):
    def forward(self, x, w):
        return (
            P.rms_norm(x, [4, 5], None, None),  # no weight, eps from the dtype, two dims
            P.rms_norm(x, [5], w, 1e-6),
            P.layer_norm(x, [5], None, None, 1e-3),
            P.layer_norm(x, [5], w, w, 1e-5),
            P.all_reduce(x, "sum", "dp", 1),
            P.all_gather(x, 0, "dp", 1),
            P.reduce_scatter(x, "sum", 0, "dp", 1),
            P.all_to_all(x, 0, 1, "dp", 1),
            P.local_shard(x, 0, "tp", 1),
            P.wait(x),
        )


def test_norm_and_one_rank_collective_rules():
    x, w = torch.randn(3, 4, 5), torch.randn(5)
    program = portable.capture(_NormsAndCollectives(), (x, w))
    assert {"RMSNormalization", "LayerNormalization", "Identity"} <= _check(program, (x, w))


class _Bfloat16(torch.nn.Module):
    def forward(self, x, y):
        return x.float() * 2, y.to(torch.bfloat16)


class _Bfloat16Add(torch.nn.Module):
    def forward(self, x):
        return x + x


def test_bfloat16_crosses_in_and_out():
    x, y = torch.randn(3, 4).bfloat16(), torch.randn(4)
    program = portable.capture(_Bfloat16(), (x, y))
    _check(program, (x, y))  # numpy has no bfloat16: bit patterns in, DLPack out


def test_a_kernel_onnx_runtime_lacks_is_a_backend_error(monkeypatch):
    # bfloat16 Add has no ORT CPU kernel; the export computes it in float32, unless that
    # rewrite is off, which leaves the kernel ORT lacks
    from portable.backends.onnx import export

    monkeypatch.setattr(export, "compute_in_float32", lambda model, rounded: False)
    x = torch.randn(3, 4).bfloat16()
    program = portable.capture(_Bfloat16Add(), (x,))
    with pytest.raises(portable.BackendError, match="ONNX Runtime .CPU. cannot run") as info:
        portable.compile(program, backend="onnx")
    assert "Add" in str(info.value)


def test_every_portable_op_has_a_rule_or_is_refused():
    from portable.backends.onnx.translations import translation_table
    from portable.opset import opset_table

    caps = get_backend("onnx").capabilities()
    portable_ops = {n for n in opset_table() if n.startswith("portable.")}
    ruled = {n for n in (op_name(o) for o in translation_table()) if n.startswith("portable.")}
    refused = {n for n in portable_ops if not caps.supports_op(n)}
    assert refused == {
        "portable.attention_backward.default",
        "portable.attention_backward.mask_grad",
        "portable.rms_norm_backward.default",
    }
    assert portable_ops - refused == ruled


# --------------------------------------------------------------------------- the model


def test_files_checker_and_text(tmp_path):
    program = _captured("gpt")
    compiled = portable.lower(program, "onnx", tmp_path)
    assert sorted(p.name for p in compiled.files) == ["model.onnx", "model.onnx.txt"]
    onnx.checker.check_model(str(tmp_path / "model.onnx"), full_check=True)
    model = onnx.load(str(tmp_path / "model.onnx"))
    assert {o.domain: o.version for o in model.opset_import}[""] == 23
    assert [i.name for i in model.graph.input] == ["idx"]
    props = {p.key: p.value for p in model.metadata_props}
    assert props["portable.content_hash"] == program.content_hash
    text = (tmp_path / "model.onnx.txt").read_text()
    assert "LayerNormalization" in text and "# w_lm_head_weight: float[128, 64]" in text
    assert len(text) < 200_000  # weights are listed, not printed


def test_checker_failure_is_refused(monkeypatch):
    def failing(*args, **kwargs):
        raise onnx.checker.ValidationError("Field 'type' of 'value_info' is required")

    monkeypatch.setattr(onnx.checker, "check_model", failing)
    program = _captured("mlp")
    with pytest.raises(portable.BackendError, match="fails onnx.checker .full check.: Field"):
        get_backend("onnx").lower(program, Target("onnx"))


def test_dynamic_batch_and_sequence(example_spec):
    spec = example_spec("gpt")
    batch, seq = Dim("batch", min=1, max=8), Dim("seq", min=2, max=31)
    program = portable.capture(
        spec.build().eval(), spec.inputs(), dynamic_shapes=({0: batch, 1: seq},)
    )
    program = _after(program, FUSED_MX)  # Attention and the MX rules over dynamic dims
    lowered = get_backend("onnx").lower(program, Target("onnx"))
    model = onnx.load(str(lowered.payload.path))
    (idx,) = model.graph.input
    assert [d.dim_param for d in idx.type.tensor_type.shape.dim] == ["idx_dim0", "idx_dim1"]
    assert {"Attention", "ReduceMax"} <= _onnx_ops(lowered)
    shapes = [(1, 5), (3, 17), (8, 31)]  # captured at (2, 16)
    _compare(lowered, *[(torch.randint(0, 128, shape),) for shape in shapes])


def test_external_data_above_the_threshold(monkeypatch, tmp_path, example_spec):
    from portable.backends.onnx import export

    monkeypatch.setattr(export, "EXTERNAL_DATA_THRESHOLD", 1024)  # GPT's weights: ~200 KB
    spec = example_spec("gpt")
    program = _captured("gpt")
    compiled = portable.lower(program, "onnx", tmp_path)
    assert sorted(p.name for p in compiled.files) == [
        "model.onnx",
        "model.onnx.data",
        "model.onnx.txt",
    ]
    assert (tmp_path / "model.onnx").stat().st_size < (tmp_path / "model.onnx.data").stat().st_size
    model = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)
    assert any(i.data_location == onnx.TensorProto.EXTERNAL for i in model.graph.initializer)
    onnx.checker.check_model(str(tmp_path / "model.onnx"), full_check=True)
    _check(program, spec.inputs())  # the session reads model.onnx.data


# --------------------------------------------------------------------------- refusals


def test_training_step_is_refused_naming_the_forward(example_spec):
    spec = example_spec("mlp")
    program = portable.capture(
        spec.build(), spec.batch(), loss_fn=spec.loss_fn, optimizer=portable.optim.SGD(lr=0.1)
    )
    with pytest.raises(portable.BackendError) as info:
        portable.compile(program, backend="onnx")
    message = str(info.value)
    assert "training step" in message
    assert "portable.capture(model, example_inputs)" in message and "without --train" in message


def _per_rank_mlp(example_spec):
    from portable.ir.plan import Mesh, Plan
    from portable.parallel import column_parallel, row_parallel
    from portable.passes.spmd_partition import partition

    program = portable.capture_spec(example_spec("mlp"))
    plan = Plan(Mesh({"tp": 2}), rules=[*column_parallel("fc1"), *row_parallel("fc2")])
    return partition(program.replace(plan=plan))[0]


def test_per_rank_program_is_refused(example_spec):
    with pytest.raises(portable.BackendError) as info:
        get_backend("onnx").lower(_per_rank_mlp(example_spec), Target("onnx"))
    message = str(info.value)
    assert "per-rank program over a mesh of 2 devices" in message
    assert "before `spmd-partition`" in message


def test_collective_over_two_ranks_is_refused_at_its_node(example_spec):
    per_rank = _per_rank_mlp(example_spec)
    with pytest.raises(portable.LoweringError) as info:
        get_backend("onnx").lower(per_rank.replace(spmd=None), Target("onnx"))
    assert "portable.all_reduce.default over a group of 2 ranks" in str(info.value)
    assert info.value.backend == "onnx"


class _Backward(torch.nn.Module):
    def forward(self, g, x):
        return P.rms_norm_backward(g, x, [5], None, None)[0]


def test_unsupported_op_names_op_module_and_line():
    x = torch.randn(3, 5)
    program = portable.capture(_Backward(), (x, x))
    with pytest.raises(portable.LoweringError) as info:
        get_backend("onnx").lower(program, Target("onnx"))
    error = info.value
    assert error.op == "portable.rms_norm_backward.default" and error.backend == "onnx"
    assert error.module == "<root>"
    assert "test_onnx_backend.py" in error.source and "rms_norm_backward" in str(error)


def test_missing_onnxruntime_says_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else real(name)
    )
    ok, why = get_backend("onnx").can_execute_here()
    assert not ok and why == "onnxruntime is not installed (pip install 'portable[onnx]')"


# --------------------------------------------------------------------------- CLI


def test_cli_lower_onnx_with_parity(tmp_path, capsys):
    out = tmp_path / "o"
    code = main(["lower", GPT, "-t", "onnx", "-p", "softmax-fusion", "--parity", "--json",
                 "--out", str(out)])  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert code == ExitCode.OK, doc
    (target,) = doc["manifest"]["targets"]
    assert target["target"] == "onnx" and target["can_execute_here"] is True
    assert {f["path"] for f in target["files"]} == {"onnx/model.onnx", "onnx/model.onnx.txt"}
    parity = doc["manifest"]["parity"]
    assert parity["ok"] is True and parity["backends"] == ["onnx"]
    assert "Attention" in (out / "onnx" / "model.onnx.txt").read_text()
