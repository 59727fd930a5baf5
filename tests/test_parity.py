"""The parity harness: reports, mismatch detection, training steps, the pytest plugin."""

from __future__ import annotations

import pytest
import torch

import portable
from portable.backends import registry as backend_registry
from portable.backends.cpu import CpuBackend
from portable.testing import ParityReport, assert_parity, check_parity, compare


class PerturbedBackend(CpuBackend):
    """A test backend: the cpu reference with one output element nudged."""

    name = "perturbed"

    def executable(self, compiled):
        exe = super().executable(compiled)
        inner = exe._fn

        def run(flat):
            outs = list(inner(flat))
            outs[0] = outs[0].clone()
            outs[0].view(-1)[min(3, outs[0].numel() - 1)] += 1e-3
            return outs

        exe._fn = run
        return exe


class UnavailableBackend(CpuBackend):
    name = "faraway"

    def can_execute_here(self):
        return False, "needs hardware this machine lacks"


@pytest.fixture
def test_backends(monkeypatch):
    monkeypatch.setitem(backend_registry._specs, "perturbed", PerturbedBackend)
    monkeypatch.setitem(backend_registry._specs, "faraway", UnavailableBackend)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))


def test_compare_reports_first_mismatch_and_errors():
    want = torch.zeros(2, 3)
    got = want.clone()
    got[1, 2] = 0.5
    row = compare("b", "output 0", got, want, rtol=1e-5, atol=1e-6)
    assert not row.ok and row.first_mismatch == (1, 2) and row.max_abs == pytest.approx(0.5)
    same = compare("b", "output 0", want, want, rtol=0, atol=0)
    assert same.ok and same.first_mismatch is None and same.max_abs == 0
    nan = torch.tensor([float("nan"), 1.0])
    assert compare("b", "x", nan, nan.clone(), 0, 0).ok  # NaN in the same place agrees
    shape = compare("b", "x", torch.zeros(2), torch.zeros(3), 0, 0)
    assert not shape.ok and "shape" in shape.note


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_result_may_differ_by_its_last_bit_only(dtype):
    """Two correct float32 computations can round to neighbouring 16-bit values: one step of
    the result's dtype agrees (at any magnitude, zero included), two steps do not."""
    want = torch.tensor([0.0, 1e-3, 1.0, 23.875, -300.0, 6e4 if dtype == torch.float16 else 3e38])
    want = want.to(dtype)
    up = torch.nextafter(want, torch.full_like(want, float("inf")))
    assert compare("b", "x", up, want, rtol=0, atol=0).ok
    twice = torch.nextafter(up, torch.full_like(want, float("inf")))
    row = compare("b", "x", twice, want, rtol=0, atol=0)
    assert not row.ok and row.first_mismatch == (0,)
    wide = compare("b", "x", up.float(), want.float(), rtol=0, atol=0)  # float32: exact
    assert not wide.ok


def test_the_perturbation_moves_every_16_bit_element():
    """A sub-ulp perturbation of a bfloat16 input rounds back to the input for about half its
    elements, which would then get no allowance: 16-bit inputs move by one or two whole steps."""
    from portable.testing.tolerance import perturbed

    x = torch.randn(4096).bfloat16()
    (moved,) = perturbed([x], torch.Generator().manual_seed(0))
    assert moved.dtype == x.dtype and bool((moved != x).all())
    step = (moved.double() - x.double()).abs() / x.double().abs()
    assert float(step.max()) <= 2 * torch.finfo(x.dtype).eps  # one or two ulps


INF, NAN = float("inf"), float("nan")
# (got, want, first element out of tolerance or None, max abs, max rel) at rtol 1e-5, atol 1e-6
SPECIAL_VALUES = [
    ([INF], [INF], None, 0.0, 0.0),
    ([-INF], [-INF], None, 0.0, 0.0),
    ([INF], [-INF], (0,), INF, INF),
    ([-INF], [INF], (0,), INF, INF),
    ([INF], [1.0], (0,), INF, INF),
    ([1.0], [INF], (0,), INF, INF),
    ([INF], [NAN], (0,), INF, INF),
    ([NAN], [NAN], None, 0.0, 0.0),
    ([NAN], [1.0], (0,), INF, INF),
    ([1.0], [NAN], (0,), INF, INF),
    ([0.0], [-0.0], None, 0.0, 0.0),
    ([1.0 + 1.05e-5], [1.0], None, 1.05e-5, 1.05e-5),
    ([1.0 + 1.2e-5], [1.0], (0,), 1.2e-5, 1.2e-5),
    ([1e-7], [0.0], None, 1e-7, 0.0),  # no relative error at a zero reference
    ([INF, 2.0, NAN], [INF, 2.0, NAN], None, 0.0, 0.0),
    ([INF, 2.0, 3.0], [INF, 2.0, 3.5], (2,), 0.5, 1 / 7),
    ([1 + 1j], [1 - 1j], (0,), 2.0, 2 / 2**0.5),  # the imaginary part counts
    ([1 + 1j], [1 + 1j], None, 0.0, 0.0),
    ([1j], [-1j], (0,), 2.0, 2.0),
    ([complex(INF, 0)], [complex(INF, 0)], None, 0.0, 0.0),
    ([complex(INF, 0)], [complex(-INF, 0)], (0,), INF, INF),
    ([complex(1, NAN)], [complex(1, NAN)], None, 0.0, 0.0),
    ([complex(INF, 1)], [complex(INF, 1.5)], (0,), 0.5, 0.5 / 1.5),
    ([complex(1, 1e-6)], [1 + 0j], None, 1e-6, 1e-6),  # rtol scales with |want|, not the part
    ([3], [3], None, 0.0, 0.0),
    ([3, 5], [3, 4], (1,), 1.0, 0.25),
    ([2**53 + 1], [2**53], (0,), 1.0, 2.0**-53),  # exact, not via float64
    ([True, False], [True, True], (1,), 1.0, 1.0),
]


@pytest.mark.parametrize(("got", "want", "first", "max_abs", "max_rel"), SPECIAL_VALUES)
def test_compare_special_values(got, want, first, max_abs, max_rel):
    row = compare("b", "x", _exact(got), _exact(want), rtol=1e-5, atol=1e-6)
    assert (row.ok, row.first_mismatch) == (first is None, first), row
    assert row.max_abs == pytest.approx(max_abs) and row.max_rel == pytest.approx(max_rel), row


def _exact(values: list) -> torch.Tensor:
    """The table's numbers without float32 rounding (float64, complex128; ints and bools)."""
    if any(isinstance(v, complex) for v in values):
        return torch.tensor(values, dtype=torch.complex128)
    if any(isinstance(v, float) for v in values):
        return torch.tensor(values, dtype=torch.float64)
    return torch.tensor(values)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_compare_infinities_in_low_precision(dtype):
    want = torch.tensor([INF, -INF, 1.0], dtype=dtype)
    assert compare("b", "x", want.clone(), want, 1e-5, 1e-6).ok
    flipped = compare("b", "x", -want, want, 1e-5, 1e-6)
    assert not flipped.ok and flipped.first_mismatch == (0,)


def test_compare_scalars_empty_and_dtype():
    assert compare("b", "x", torch.tensor(INF), torch.tensor(INF), 0, 0).ok
    row = compare("b", "x", torch.tensor(1.0), torch.tensor(2.0), 0, 0)
    assert not row.ok and row.first_mismatch == ()
    empty = compare("b", "x", torch.zeros(0, 3), torch.zeros(0, 3), 0, 0)
    assert empty.ok and (empty.max_abs, empty.max_rel) == (0.0, 0.0)
    dtype = compare("b", "x", torch.zeros(2), torch.zeros(2, dtype=torch.float64), 0, 0)
    assert not dtype.ok and "float64" in dtype.note


def test_compare_allowance_widens_only_where_given():
    want = torch.zeros(3)
    got = torch.tensor([1e-3, 1e-3, 0.0])
    allowance = torch.tensor([1e-3, 5e-4, 0.0])
    row = compare("b", "x", got, want, 1e-5, 1e-6, allowance=allowance)
    assert not row.ok and row.first_mismatch == (1,)


def test_cpu_against_itself_and_eager_is_exact():
    x = torch.randn(4, 8)
    report = assert_parity(_model(), (x,), backends=["cpu"])
    assert [r.backend for r in report.rows] == ["eager", "cpu"]
    assert report.ok and all(r.max_abs == 0 for r in report.rows)
    assert "eager: the model run by eager PyTorch" in report.format()


def test_eager_row_for_training_steps():
    model = _model()
    batch = (torch.randn(4, 8), torch.randn(4, 4))
    loss_fn = lambda m, x, y: ((m(x) - y) ** 2).mean()  # noqa: E731
    program = portable.capture(
        model, batch, loss_fn=loss_fn, optimizer=portable.optim.AdamW(lr=1e-2)
    )
    report = assert_parity(
        program, batch, backends=["cpu"], steps=3, eager_model=model, loss_fn=loss_fn
    )
    eager = {r.quantity for r in report.rows if r.backend == "eager"}
    assert {"loss step 3", "state 0.weight", "state optimizer.0.weight.exp_avg_sq"} <= eager


def test_mismatch_is_found_and_reported(test_backends):
    x = torch.randn(4, 8)
    report = check_parity(_model(), (x,), backends=["cpu", "perturbed"])
    assert not report.ok
    (row,) = report.mismatches()
    assert row.backend == "perturbed" and row.first_mismatch == (0, 3)
    text = report.format()
    assert "MISMATCH" in text and "first mismatch at [0, 3]" in text
    with pytest.raises(AssertionError, match="MISMATCH"):
        assert_parity(_model(), (x,), backends=["perturbed"])


def test_training_steps_compare_loss_per_step_and_state(test_backends):
    model = _model()
    batch = (torch.randn(4, 8), torch.randn(4, 4))
    program = portable.capture(
        model,
        batch,
        loss_fn=lambda m, x, y: ((m(x) - y) ** 2).mean(),
        optimizer=portable.optim.AdamW(lr=1e-2),
    )
    report = check_parity(program, batch, backends=["perturbed"], steps=3)
    quantities = [r.quantity for r in report.rows]
    assert quantities[:3] == ["loss step 1", "loss step 2", "loss step 3"]
    assert "state 0.weight" in quantities and "state optimizer.step" in quantities
    # the nudge lands on the loss (output 0), so step losses disagree and later state drifts
    assert not report.ok and report.mismatches()[0].quantity == "loss step 1"


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"rtol": -1e-5}, "rtol=-1e-05 must be a finite number >= 0"),
        ({"atol": float("nan")}, "atol=nan must be a finite number >= 0"),
        ({"steps": 0}, "steps=0 must be an integer >= 1"),
    ],
)
def test_bad_parity_options_are_input_errors(option, message):
    with pytest.raises(portable.InputError, match=message):
        check_parity(_model(), (torch.randn(4, 8),), backends=["cpu"], **option)


def test_eager_training_baseline_without_loss_fn_is_an_input_error():
    model, batch = _model(), (torch.randn(4, 8), torch.randn(4, 4))
    program = portable.capture(
        model,
        batch,
        loss_fn=lambda m, x, y: ((m(x) - y) ** 2).mean(),
        optimizer=portable.optim.SGD(),
    )
    with pytest.raises(portable.InputError, match="needs its loss_fn"):
        check_parity(program, batch, backends=["cpu"], eager_model=model)


def test_unavailable_backend_is_an_error_or_listed(test_backends):
    x = torch.randn(4, 8)
    with pytest.raises(portable.BackendError, match="needs hardware"):
        check_parity(_model(), (x,), backends=["faraway"])
    report = check_parity(_model(), (x,), backends=["faraway"], skip_unavailable=True)
    assert report.skipped == (("faraway", "needs hardware this machine lacks"),)
    assert "not run: needs hardware" in report.format()


def test_report_json_roundtrips(test_backends):
    report = check_parity(_model(), (torch.randn(4, 8),), backends=["perturbed"])
    data = report.to_json()
    # given an nn.Module, the cpu results are first checked against eager PyTorch
    assert [r["backend"] for r in data["rows"]] == ["eager", "perturbed"]
    assert data["ok"] is False and data["rows"][0]["max_abs"] == 0
    assert isinstance(report, ParityReport)


def test_decorated_model_uses_its_example_inputs():
    @portable.portable(example_inputs=lambda: (torch.randn(2, 8),))
    def tiny():
        return _model()

    assert assert_parity(tiny, backends=["cpu"]).ok


PLUGIN_TEST = """
import torch, portable
from portable.testing import assert_parity

def test_model(portable_backend):
    model = torch.nn.Linear(4, 2)
    assert_parity(model, (torch.randn(3, 4),), backends=[portable_backend])
"""


def test_pytest_plugin_parametrizes_backends(pytester):
    pytester.makepyfile(PLUGIN_TEST)
    result = pytester.runpytest("--portable-backends=cpu", "-v", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*test_model?cpu? PASSED*"])


def test_pytest_plugin_rejects_unknown_backend(pytester):
    """A usage error before collection (exit status 4, one message), not an error per test."""
    pytester.makepyfile(PLUGIN_TEST + PLUGIN_TEST.replace("test_model", "test_other"))
    result = pytester.runpytest("--portable-backends=cpu,nosuch", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*--portable-backends: unknown backend 'nosuch'; registered backends: cpu, *"]
    )
    assert "nosuch" not in result.stdout.str()  # no test ran, none errored
    empty = pytester.runpytest("--portable-backends=,", "-p", "no:cacheprovider")
    assert empty.ret == pytest.ExitCode.USAGE_ERROR
