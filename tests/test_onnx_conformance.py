"""The onnx backend against `cpu` on the OpInfo sweep's former failures: identity programs,
bfloat16 result dtypes and the bfloat16 kernels ONNX Runtime lacks, integer and bool kernels it
lacks, avg_pool2d's divisor_override, complex results, reductions over every dim, reductions of
0-d tensors (on `xla` too) and bool index_put accumulation (`xla`). Each either matches `cpu`
(value and dtype) or is refused with a typed portable error; none is silently wrong."""

from __future__ import annotations

import gc

import pytest
import torch

import portable
import portable.errors
from portable.ir.signature import TensorSpec
from portable.testing import check_parity

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")


class _Fn(torch.nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


def _parity(fn, *inputs: torch.Tensor, backends=("onnx",)):
    program = portable.capture(_Fn(fn), inputs)
    report = check_parity(program, inputs, backends=list(backends))
    assert report.ok, report
    return program


@pytest.mark.parametrize(
    "fn, x",
    [
        (lambda x: x.contiguous(), torch.randn(3, 4)),
        (torch.positive, torch.randn(3)),
        (lambda x: x.t(), torch.randn(5)),
    ],
    ids=["contiguous", "positive", "t_1d"],
)
def test_identity_programs_run(fn, x):
    _parity(fn, x)


def test_an_identity_output_outlives_its_input():
    # ORT returns the feed itself for an input the model returns: a view of the caller's memory
    program = portable.capture(_Fn(lambda x: x.t()), (torch.randn(5),))
    exe = portable.compile(program, backend="onnx")
    x = torch.randn(64)[:5].clone()
    want = x.clone()
    out = exe(x)
    del x
    gc.collect()
    junk = [torch.full((5,), 7.0) for _ in range(200)]  # reuse the freed memory
    assert junk and torch.equal(out, want)


@pytest.mark.parametrize(
    "fn",
    [torch.abs, torch.sum, lambda x: torch.cumsum(x, 0)],
    ids=["abs", "sum", "cumsum"],
)
def test_bfloat16_results_stay_bfloat16(fn):
    x = torch.randn(6, dtype=torch.bfloat16)
    program = _parity(fn, x)
    outputs = [o for o in program.signature.outputs if o.kind.name == "OUTPUT"]
    assert outputs[0].spec.dtype == torch.bfloat16  # parity compares dtypes as well


@pytest.mark.parametrize(
    "fn",
    [
        torch.sin,
        lambda x: x + x * 3,
        lambda x: x - 1,
        torch.nn.functional.gelu,
        lambda x: torch.exp(1 - x),  # rsub: its ONNX value is not named after the fx node
    ],
    ids=["sin", "add_mul", "sub", "gelu", "rsub_exp"],
)
def test_bfloat16_ops_without_ort_kernels_compute_in_float32(fn):
    # ORT's CPU provider has no bfloat16 Sin/Add/Sub/Gelu: the model computes them in float32
    # and rounds each op's result once, as torch's CPU kernels do (backends/onnx/bfloat16.py)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    program = portable.capture(_Fn(fn), (x,))
    got = portable.compile(program, backend="onnx")(x)
    want = fn(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_avg_pool2d_divisor_override_refused():
    x = torch.randn(1, 1, 4, 4)
    program = portable.capture(
        _Fn(lambda x: torch.nn.functional.avg_pool2d(x, 2, divisor_override=3)), (x,)
    )
    with pytest.raises(portable.errors.PortableError, match="divisor_override"):
        check_parity(program, (x,), backends=["onnx"])


def test_avg_pool2d_plain_matches():
    _parity(lambda x: torch.nn.functional.avg_pool2d(x, 2), torch.randn(1, 2, 4, 4))


def test_complex_result_refused():
    x = torch.randn(3)
    program = portable.capture(_Fn(lambda x: x * 2), (x,))
    node = next(n for n in program.graph.nodes if n.op == "call_function")
    node.meta["tensor"] = TensorSpec((3,), torch.complex64)  # a node with a complex result
    with pytest.raises(portable.errors.PortableError, match="complex"):
        check_parity(program, (x,), backends=["onnx"])


@pytest.mark.parametrize(
    "fn",
    [
        torch.amax,
        torch.amin,
        lambda x: torch.amax(x, dim=[]),
        lambda x: torch.amin(x, dim=[], keepdim=True),
        lambda x: torch.aminmax(x),
    ],
    ids=["amax", "amin", "amax_empty", "amin_keepdim", "aminmax"],
)
def test_reductions_over_every_dim(fn):
    _parity(fn, torch.randn(3, 4))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.sum(x, dim=0),
        lambda x: torch.amax(x, dim=0),
        lambda x: torch.amin(x, dim=-1),
        lambda x: torch.mean(x, dim=0),
        lambda x: torch.logsumexp(x, dim=0),
        lambda x: torch.count_nonzero(x, dim=0),
        lambda x: torch.var(x, dim=0, correction=0),
        lambda x: torch.var(x, dim=0),  # NaN: one element, correction 1
    ],
    ids=["sum", "amax", "amin", "mean", "logsumexp", "count_nonzero", "var0", "var1"],
)
def test_reductions_of_0d(fn):
    # a 0-d tensor takes dim 0 and -1, and reducing over it is the identity (xla and onnx both
    # refused it: xla with an axis error, onnx in its checker)
    pytest.importorskip("jax")
    _parity(fn, torch.tensor(3.0), backends=("onnx", "xla"))


def test_index_put_accumulates_bools_as_logical_or():
    pytest.importorskip("jax")
    x, i, v = torch.zeros(5, dtype=torch.bool), torch.tensor([0, 2, 2]), torch.tensor([1, 0, 1])
    _parity(
        lambda x, i, v: torch.index_put(x, (i,), v.bool(), accumulate=True),
        x,
        i,
        v,
        backends=("xla",),
    )


def test_squeeze_dims_matches():
    _parity(lambda x: x.squeeze((0, 2)), torch.randn(1, 3, 1, 2))


_I = torch.arange(-6, 6).reshape(3, 4)
_W = torch.arange(20).reshape(4, 5) % 3 - 1
_B = torch.tensor([[True, False, True, False]] * 3)


@pytest.mark.parametrize(
    "fn, inputs",
    [
        (lambda c, a, w: torch.addmm(c, a, w), (torch.arange(5), _I, _W)),
        (
            lambda c, a, w: torch.addmm(c, a, w, beta=2, alpha=3),
            (torch.arange(5), _I, _W),
        ),
        (lambda c, a, w: torch.addmm(c, a, w, beta=0), (torch.arange(5), _I, _W)),
        (torch.relu, (_I,)),
        (lambda c, x, y: torch.where(c, x, y), (_B, _B, ~_B)),
        (lambda x, m: x.masked_fill(m, True), (_B, ~_B)),
        (torch.isnan, (_I,)),
        (torch.isnan, (_B,)),
        (lambda x: torch.empty_permuted((2, 3), (1, 0)).fill_(1.0) + x.sum(), (torch.randn(3),)),
    ],
    ids=[
        "addmm",
        "addmm_scaled",
        "addmm_beta0",
        "relu",
        "where",
        "masked_fill",
        "isnan_int",
        "isnan_bool",
        "empty_permuted",
    ],
)
def test_integer_and_bool_dtypes_ort_lacks_kernels_for(fn, inputs):
    # ORT's CPU provider has no int64 Gemm/Relu, bool Where, integer IsNaN: translations/dtypes.py
    _parity(fn, *inputs)


def _with_nans() -> torch.Tensor:
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    x[1, 2] = x[2, 0] = float("nan")
    return x


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x.argmax(1),
        lambda x: x.argmax(),
        lambda x: x.max(1),
        lambda x: x.amax(1),
        lambda x: x.amin(),
        lambda x: torch.aminmax(x, dim=0),
    ],
    ids=["argmax", "argmax_all", "max_dim", "amax", "amin_all", "aminmax"],
)
def test_nan_propagates_through_max_and_min_as_in_torch(fn):
    # ORT's ArgMax / ReduceMax skip NaN; torch returns it (and its first index)
    _parity(fn, _with_nans())


@pytest.mark.parametrize("fn", [torch.asin, torch.erf, torch.nn.functional.leaky_relu])
def test_float64_kernels_ort_lacks_are_refused_before_lowering(fn):
    x = torch.rand(4, dtype=torch.float64) - 0.5
    program = portable.capture(_Fn(fn), (x,))
    with pytest.raises(portable.errors.LoweringError, match="float64") as info:
        portable.compile(program, backend="onnx")
    assert "cpu" in str(info.value)  # names the backends that take it
