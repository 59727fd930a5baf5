"""The `mx-quantize` pass: how it quantizes, and that the result is the recipe (which layers and
GEMMs it picks: tests/test_mx_layer_selection.py).

Every pass run goes through `PassManager(..., verify_each=True)` (valid IR, input not mutated).
The acceptance test compares a quantized training step with a hand-written reference: linears as
a custom `torch.autograd.Function` that quantizes each operand of each of the three GEMMs with
`portable.mx` (shared/reference/mx.md, "Training recipe"). Expected layers and GEMMs come from the
models' own `nn.Linear` modules and the recipe's contraction dims, not from the pass.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import portable
from portable.cli import main
from portable.passes import parse_pass, registry
from portable.passes.mx_quantize import MXQuantize, mx_error_report, sqnr_db
from tests.support import filecheck
from tests.support.mx_pass import GEMMS, Q, calls, captured, qdq, run_pass

# ---- models ----------------------------------------------------------------------------------


class MXLinearFn(torch.autograd.Function):
    """The recipe by hand: Y = qdq(X, K) qdq(W, K)^T + b, dX = qdq(dY, N) qdq(W, N),
    dW = qdq(dY, M)^T qdq(X, M) (X: [M, K], W: [N, K], dY: [M, N])."""

    @staticmethod
    def forward(ctx, x, w, b, fmt, axes):
        ctx.save_for_backward(x, w)
        ctx.fmt, ctx.axes = fmt, axes
        return torch.addmm(b, qdq(x, 1, fmt), qdq(w, 1, fmt).t())

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        fmt, (dy_m, x_m) = ctx.fmt, ctx.axes
        dx = qdq(dy, 1, fmt) @ qdq(w, 0, fmt)
        dw = qdq(dy, dy_m, fmt).t() @ qdq(x, x_m, fmt)
        return dx, dw, dy.sum(0), None, None


class Net(nn.Module):
    """Four linears on [B, T, C] activations (T * B = 32 tokens: every contraction dim is a
    multiple of 32). `mx_layers` names the linears computed with MXLinearFn; `wgrad_axes` are
    the dims of dY and X blocked in the weight gradient (the recipe: 0, 0, i.e. M)."""

    def __init__(self, mx_layers: tuple[str, ...] = (), fmt: str = "e4m3", wgrad_axes=(0, 0)):
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.hidden = nn.ModuleList([nn.Linear(64, 128), nn.Linear(128, 64)])
        self.out = nn.Linear(64, 32)
        self.mx_layers, self.fmt, self.wgrad_axes = mx_layers, fmt, wgrad_axes

    def linear(self, name: str, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if name not in self.mx_layers:
            return layer(x)
        y = MXLinearFn.apply(
            x.reshape(-1, x.shape[-1]), layer.weight, layer.bias, self.fmt, self.wgrad_axes
        )
        return y.reshape(*x.shape[:-1], -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.linear("inp", self.inp, x))
        for i, layer in enumerate(self.hidden):
            x = F.gelu(self.linear(f"hidden.{i}", layer, x))
        return self.linear("out", self.out, x)


HIDDEN = ("hidden.0", "hidden.1")  # what keep_first_last=true quantizes
# xla vs the reference: fp32 rounding of another accumulation order (loss within ~2 ulp, weights
# within 1 ulp of their magnitude); quantization moves the weights by far more
XLA_TOLERANCE = {"rtol": 1e-5, "atol": 1e-7}
LR = 0.05


def net_batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(2, 16, 32, generator=g), torch.randn(2, 16, 32, generator=g)) for _ in range(n)
    ]


def net_step(model: nn.Module, batch) -> portable.Program:
    return portable.capture(
        model,
        batch,
        loss_fn=lambda m, x, y: F.mse_loss(m(x), y),
        optimizer=portable.optim.SGD(lr=LR),
    )


def reference_steps(model: Net, batches) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Eager SGD with `model`'s autograd (the graph's update: p.add(grad, alpha=-lr))."""
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    results = []
    for x, y in batches:
        loss = F.mse_loss(torch.func.functional_call(model, params, (x,)), y)
        grads = torch.autograd.grad(loss, list(params.values()))
        with torch.no_grad():
            params = {
                k: p.add(g, alpha=-LR).requires_grad_()
                for (k, p), g in zip(params.items(), grads, strict=True)
            }
        results.append((loss.detach(), {k: p.detach() for k, p in params.items()}))
    return results


# ---- golden text -----------------------------------------------------------------------------


def test_golden_mlp_inference(example_spec):
    program, _ = captured(example_spec, "mlp", False)
    out, report = run_pass(program, "mx-quantize{keep_first_last=false}")
    filecheck(
        out.text(),
        r"""
        CHECK: in  x: user_input float32[8x32]
        CHECK-NEXT: %mx_quantize = portable.mx_quantize.default(%x, e4m3, 1, rceil) : (uint8[8x32], uint8[8x1])  # fc1
        CHECK-NEXT: %getitem = %mx_quantize[0] : uint8[8x32]  # fc1
        CHECK-NEXT: %getitem_1 = %mx_quantize[1] : uint8[8x1]  # fc1
        CHECK-NEXT: %mx_dequantize = portable.mx_dequantize.default(%getitem, %getitem_1, e4m3, 1, torch.float32) : float32[8x32]  # fc1
        CHECK-NEXT: %mx_quantize_1 = portable.mx_quantize.default(%p_fc1_weight, e4m3, 1, rceil) : (uint8[64x32], uint8[64x1])  # fc1
        CHECK: %mx_dequantize_1 = portable.mx_dequantize.default(%getitem_2, %getitem_3, e4m3, 1, torch.float32) : float32[64x32]  # fc1
        CHECK-NEXT: %{{t_\d+}} = aten.t.default(%mx_dequantize_1) : float32[32x64]  # fc1
        CHECK-NEXT: %addmm = aten.addmm.default(%p_fc1_bias, %mx_dequantize, %{{t_\d+}}) : float32[8x64]  # fc1
        CHECK-NEXT: %gelu = aten.gelu.default(%addmm)
        CHECK-NEXT: %mx_quantize_2 = portable.mx_quantize.default(%gelu, e4m3, 1, rceil) : (uint8[8x64], uint8[8x2])  # fc2
        CHECK: %mx_quantize_3 = portable.mx_quantize.default(%p_fc2_weight, e4m3, 1, rceil) : (uint8[4x64], uint8[4x2])  # fc2
        CHECK: %addmm_1 = aten.addmm.default(%p_fc2_bias, %mx_dequantize_2, %{{t_\d+}}) : float32[8x4]  # fc2
        CHECK-NEXT: out 0: output = %addmm_1
        CHECK-NOT: aten.t.default(%p_fc
        """,
    )
    assert "aten.t.default(%p_fc" not in out.text()  # the replaced transposes are gone
    assert report.counts == {"layers": 2, "forward": 2, "input_grad": 0, "weight_grad": 0}
    assert out.metadata["mx_quantize"]["layers"][0]["operands"][1] == {
        "gemm": "forward",
        "node": "addmm",
        "operand": "w",
        "dim": "K",
        "size": 32,
        "tensor": "p_fc1_weight",
        "axis": 1,
        "quantize": "mx_quantize_1",
        "dequantize": "mx_dequantize_1",
    }


def test_golden_training_gemms():
    """hidden.0's three GEMMs: each operand quantized from high precision along that GEMM's
    contraction dim (X: [32, 64], W: [128, 64], dY: [32, 128]); transposes looked through."""
    program = net_step(Net(), net_batches(1)[0])
    out, report = run_pass(program)
    assert report.counts == {"layers": 2, "forward": 2, "input_grad": 2, "weight_grad": 2}
    filecheck(
        out.text(),
        r"""
        CHECK: %mx_quantize = portable.mx_quantize.default(%{{view_\d+}}, e4m3, 1, rceil) : (uint8[32x64], uint8[32x2])  # hidden.0
        CHECK: %mx_quantize_1 = portable.mx_quantize.default(%p_model_hidden_0_weight, e4m3, 1, rceil) : (uint8[128x64], uint8[128x2])  # hidden.0
        CHECK: %{{t_\d+}} = aten.t.default(%mx_dequantize_1) : float32[64x128]  # hidden.0
        CHECK-NEXT: %addmm_1 = aten.addmm.default(%p_model_hidden_0_bias, %mx_dequantize, %{{t_\d+}}) : float32[32x128]  # hidden.0
        CHECK: %mx_quantize_2 = portable.mx_quantize.default(%{{view_\d+}}, e4m3, 1, rceil) : (uint8[32x128], uint8[32x4])  # hidden.0
        CHECK: %mx_quantize_3 = portable.mx_quantize.default(%p_model_hidden_0_weight, e4m3, 0, rceil) : (uint8[128x64], uint8[4x64])  # hidden.0
        CHECK: %mx_dequantize_3 = portable.mx_dequantize.default(%getitem_6, %getitem_7, e4m3, 0, torch.float32) : float32[128x64]  # hidden.0
        CHECK-NEXT: %{{mm_\d+}} = aten.mm.default(%mx_dequantize_2, %mx_dequantize_3) : float32[32x64]  # hidden.0
        CHECK-NEXT: %mx_quantize_4 = portable.mx_quantize.default(%{{view_\d+}}, e4m3, 0, rceil) : (uint8[32x128], uint8[1x128])  # hidden.0
        CHECK: %{{t_\d+}} = aten.t.default(%mx_dequantize_4) : float32[128x32]  # hidden.0
        CHECK-NEXT: %mx_quantize_5 = portable.mx_quantize.default(%{{view_\d+}}, e4m3, 0, rceil) : (uint8[32x64], uint8[1x64])  # hidden.0
        CHECK: %{{mm_\d+}} = aten.mm.default(%{{t_\d+}}, %mx_dequantize_5) : float32[128x64]  # hidden.0
        """,
    )
    quantized = {n.name: n.args[0] for n in calls(out, Q)}
    assert quantized["mx_quantize"] is quantized["mx_quantize_5"]  # X: along K, then along M
    assert quantized["mx_quantize_2"] is quantized["mx_quantize_4"]  # dY: along N, then along M
    layer = out.metadata["mx_quantize"]["layers"][0]
    assert layer["module"] == "hidden.0" and layer["gemms"] == list(GEMMS)
    axes = {(o["gemm"], o["operand"]): (o["dim"], o["size"], o["axis"]) for o in layer["operands"]}
    assert axes == {
        ("forward", "x"): ("K", 64, 1),
        ("forward", "w"): ("K", 64, 1),  # W [N, K] along K
        ("input_grad", "dy"): ("N", 128, 1),
        ("input_grad", "w"): ("N", 128, 0),  # W [N, K] along N
        ("weight_grad", "dy"): ("M", 32, 0),  # dY [M, N] along M (the GEMM takes its transpose)
        ("weight_grad", "x"): ("M", 32, 0),
    }


# ---- numerics --------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["cpu", "xla"])
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_training_step_matches_the_hand_written_recipe(backend, fmt):
    """The acceptance test: 3 SGD steps of the quantized program == the reference Net whose
    hidden linears run MXLinearFn. cpu is bit-exact (same fp32 kernels on the same operands in
    the same order); xla matches to fp32 rounding (its dot and reductions accumulate in another
    order, as for any program: see the unquantized comparison)."""
    torch.manual_seed(0)
    model, batches = Net(), net_batches(3)
    program, _ = run_pass(net_step(model, batches[0]), f"mx-quantize{{format={fmt}}}")
    exe = portable.compile(program, backend)
    reference = Net(mx_layers=HIDDEN, fmt=fmt)
    reference.load_state_dict(model.state_dict())
    expected = reference_steps(reference, batches)
    plain = reference_steps(model, batches)
    for (loss, state), (_, plain_state), batch in zip(expected, plain, batches, strict=True):
        result = exe(*batch)
        assert set(result.state) >= set(state)
        if backend == "cpu":
            assert torch.equal(result.loss, loss)
            for name, value in state.items():
                assert torch.equal(result.state[name], value), name
        else:
            torch.testing.assert_close(result.loss, loss, **XLA_TOLERANCE)
            for name, value in state.items():
                torch.testing.assert_close(result.state[name], value, **XLA_TOLERANCE)
        # without quantization the weights are outside that tolerance: the comparison has teeth
        for name in ("hidden.0.weight", "hidden.1.weight"):
            assert not torch.allclose(state[name], plain_state[name], **XLA_TOLERANCE), name


def test_reference_with_the_wrong_weight_gradient_axis_differs():
    """The weight gradient must block dY and X along M (tokens): blocking along the other dim
    gives other numbers. Checked with FP4, whose coarse grid makes the blocking visible."""
    torch.manual_seed(0)
    model, batches = Net(), net_batches(1)
    program, _ = run_pass(net_step(model, batches[0]), "mx-quantize{format=e2m1}")
    result = portable.compile(program, "cpu")(*batches[0])
    wrong = Net(mx_layers=HIDDEN, fmt="e2m1", wgrad_axes=(1, 1))
    wrong.load_state_dict(model.state_dict())
    ((_, state),) = reference_steps(wrong, batches)
    assert not torch.equal(result.state["hidden.0.weight"], state["hidden.0.weight"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inference_output_equals_hand_quantized_model(dtype):
    """After the pass, inference = the model with qdq'd operands computed by hand (exactly)."""
    torch.manual_seed(1)
    model = Net().to(dtype).eval()
    x = torch.randn(2, 16, 32, dtype=dtype)
    out, report = run_pass(portable.capture(model, (x,)), "mx-quantize{scale=floor}")
    assert report.counts["forward"] == 2

    def mx_linear(layer, h, fmt="e4m3"):
        h2 = h.reshape(-1, h.shape[-1])
        y = torch.addmm(
            layer.bias, qdq(h2, 1, fmt, "floor"), qdq(layer.weight, 1, fmt, "floor").t()
        )
        return y.reshape(*h.shape[:-1], -1)

    with torch.no_grad():
        h = F.gelu(model.inp(x))
        h = F.gelu(mx_linear(model.hidden[0], h))
        h = F.gelu(mx_linear(model.hidden[1], h))
        expected = model.out(h)
        plain = model(x)
    got = portable.compile(out, "cpu")(x)
    assert got.dtype == dtype and torch.equal(got, expected)
    assert not torch.equal(got, plain)


def test_fake_and_real_write_the_same_graph_and_record_the_mode():
    program = net_step(Net(), net_batches(1)[0])
    fake, _ = run_pass(program, "mx-quantize{mode=fake}")
    real, _ = run_pass(program, "mx-quantize{mode=real,format=e5m2,scale=floor}")
    assert fake.text() == real.text().replace("e5m2", "e4m3").replace("floor", "rceil")
    assert fake.metadata["mx_quantize"]["mode"] == "fake"
    record = real.metadata["mx_quantize"]
    assert (record["mode"], record["format"], record["scale"], record["block_size"]) == (
        "real",
        "e5m2",
        "floor",
        32,
    )
    json.dumps(record)  # saved in the archive


def test_cuda_lowering_fuses_real_mode_on_sm_100_only():
    """The structure the pass writes is what the cuda backend matches: `mode=real` GEMMs become
    native block-scaled MX GEMMs on sm_100; sm_90 and `mode=fake` stay emulated."""
    pytest.importorskip("triton")
    from portable.backends.cuda.lowering import export_graph, kernel_graph, mx_mode
    from portable.backends.cuda.targets import parse_archs

    program = net_step(Net(), net_batches(1)[0])
    impls = {}
    for mode in ("real", "fake"):
        out, report = run_pass(program, f"mx-quantize{{mode={mode}}}")
        gm, _ = export_graph(out)
        for arch in parse_archs("sm_90,sm_100"):
            _, decisions = kernel_graph(gm, arch, mx_mode(out))
            impls[mode, arch.name] = [d.impl for d in decisions if d.op == "mx_matmul"]
    n = 6  # 2 layers x 3 GEMMs
    assert impls["real", "sm_100"] == ["native-mx"] * n
    assert (
        impls["real", "sm_90"]
        == impls["fake", "sm_100"]
        == impls["fake", "sm_90"]
        == ["emulated-mx"] * n
    )


# ---- the error report ------------------------------------------------------------------------


def test_error_report_is_the_sqnr_of_each_operand(example_spec):
    program, spec = captured(example_spec, "mlp", False)
    out, _ = run_pass(program, "mx-quantize{keep_first_last=false}")
    (x,) = spec.inputs()
    rows = mx_error_report(out, (x,))
    assert [(r["module"], r["gemm"], r["operand"], r["dim"]) for r in rows] == [
        ("fc1", "forward", "x", "K=32"),
        ("fc1", "forward", "w", "K=32"),
        ("fc2", "forward", "x", "K=64"),
        ("fc2", "forward", "w", "K=64"),
    ]
    w = out.weights["fc1.weight"]
    by_hand = [
        10 * math.log10((x.double() ** 2).sum() / ((x - qdq(x, 1)).double() ** 2).sum()),
        10 * math.log10((w.double() ** 2).sum() / ((w - qdq(w, 1)).double() ** 2).sum()),
    ]
    assert [r["sqnr_db"] for r in rows[:2]] == pytest.approx(by_hand, rel=1e-12)
    assert rows[0]["shape"] == [8, 32] and rows[1]["shape"] == [64, 32]
    assert mx_error_report(program, (x,)) == []  # not quantized: nothing to report
    assert sqnr_db(x, x) is None and sqnr_db(torch.zeros(3), torch.zeros(3)) is None


@pytest.mark.parametrize(("fmt", "low", "high"), [("e4m3", 29, 34), ("e2m1", 14, 21)])
def test_error_report_on_a_training_step(example_spec, fmt, low, high):
    program, spec = captured(example_spec, "gpt", True)
    out, report = run_pass(program, f"mx-quantize{{format={fmt}}}")
    rows = mx_error_report(out, spec.batch())
    assert len(rows) == 2 * sum(report.counts[g] for g in GEMMS)
    assert {(r["gemm"], r["operand"]) for r in rows} == {
        ("forward", "x"),
        ("forward", "w"),
        ("input_grad", "dy"),
        ("input_grad", "w"),
        ("weight_grad", "dy"),
        ("weight_grad", "x"),
    }
    assert all(low < r["sqnr_db"] < high for r in rows), [r["sqnr_db"] for r in rows]
    with pytest.raises(portable.InputError, match="takes 2 input"):
        mx_error_report(out, spec.batch()[:1])


def test_cli_prints_and_records_the_error_table(example_spec, tmp_path, capsys):
    out_dir = tmp_path / "out"
    code = main(
        [
            "lower",
            "examples/mlp.py:MLP",
            "-t",
            "cpu",
            "-p",
            "mx-quantize{keep_first_last=false}",
            "-o",
            str(out_dir),
        ]
    )
    _, err = capsys.readouterr()
    assert code == 0
    filecheck(
        err,
        """
        CHECK: mx-quantize: changed (layers=2, forward=2)
        CHECK-NEXT: module  GEMM     operand  dim   SQNR dB
        CHECK-NEXT: fc1     forward  x        K=32  {{\\d+\\.\\d}}
        CHECK-NEXT: fc1     forward  w        K=32
        CHECK-NEXT: fc2     forward  x        K=64
        CHECK-NEXT: fc2     forward  w        K=64
        """,
    )
    record = json.loads((out_dir / "manifest.json").read_text())["passes"][0]
    assert record["spec"] == "mx-quantize{keep_first_last=false}"
    assert [layer["module"] for layer in record["layers"]] == ["fc1", "fc2"]
    assert all(25 < o["sqnr_db"] < 40 for layer in record["layers"] for o in layer["operands"])
    loaded = portable.load(out_dir / "program.portable")
    assert loaded.metadata["mx_quantize"]["layers"][1]["module"] == "fc2"
    assert len(mx_error_report(loaded, example_spec("mlp").inputs())) == 4


# ---- options and errors ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message", "valid"),
    [
        ("mx-quantize{format=fp8}", "option 'format'", "e4m3, e5m2, e3m2, e2m3, e2m1, int8"),
        ("mx-quantize{scale=round}", "option 'scale'", "floor, rceil, ceil, even"),
        ("mx-quantize{mode=int4}", "option 'mode'", "fake, real"),
        ('mx-quantize{include="("}', "not a valid regex", "module path"),
        ("mx-quantize{keep_first_last=1}", "must be true or false", "keep_first_last: bool = True"),
    ],
)
def test_bad_options(text, message, valid):
    with pytest.raises(portable.PassError, match=message) as info:
        parse_pass(text)
    assert valid in str(info.value)


def test_registered_with_round_trip_spec():
    cls = registry.get("mx-quantize")
    assert cls is MXQuantize and cls.name == "mx-quantize"
    p = MXQuantize(format="e2m1", scale="floor", mode="real", include="mlp", keep_first_last=False)
    assert parse_pass(p.spec()) == p
    assert MXQuantize().spec() == "mx-quantize"


def test_applying_twice_is_an_error():
    program = net_step(Net(), net_batches(1)[0])
    out, _ = run_pass(program)
    with pytest.raises(portable.PassError, match="already MX-quantized") as info:
        run_pass(out)
    assert "include=" in str(info.value)


def test_a_program_without_linears_is_unchanged():
    program = portable.capture(nn.GELU(), (torch.randn(4, 32),))
    out, report = run_pass(program)
    assert not report.changed and "mx_quantize" not in out.metadata
    assert report.counts == {"layers": 0, "forward": 0, "input_grad": 0, "weight_grad": 0}
    assert any("no linear layer" in n for n in report.notes)
