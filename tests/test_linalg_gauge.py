"""The `linalg` family beyond the rule table: singular vectors and eigenvectors compared up to
their sign gauge (portable/testing/gauge.py), a wrong factor still failing, gauge-invariant
training steps of SVD and eigh, and the `info` codes a compiled program returns where eager
raises (capture/decompositions.py `without_error_checks`)."""

from __future__ import annotations

import pytest
import torch

import portable
from portable.testing import check_parity
from portable.testing.gauge import GaugeOutput, align, gauge_outputs

pytest.importorskip("jax")


class _Svd(torch.nn.Module):
    def __init__(self, full_matrices: bool = False) -> None:
        super().__init__()
        self.full_matrices = full_matrices

    def forward(self, x):
        return torch.linalg.svd(x, full_matrices=self.full_matrices)


class _Eigh(torch.nn.Module):
    def forward(self, x):
        return torch.linalg.eigh(x)


def _wide(*shape):
    torch.manual_seed(0)
    return torch.randn(*shape)


@pytest.mark.parametrize("full_matrices", [False, True])
@pytest.mark.parametrize("shape", [(3, 5), (2, 5, 3), (4, 4)])
def test_singular_vectors_match_up_to_sign(shape, full_matrices):
    x = _wide(*shape)
    program = portable.capture(_Svd(full_matrices), (x,))
    assert sorted(g.axis for g in gauge_outputs(program).values()) == [-2, -1]  # U, Vh
    report = check_parity(program, (x,), backends=["xla"])
    assert report.ok, report.format()


def test_eigenvectors_match_up_to_sign():
    torch.manual_seed(0)
    a = torch.randn(3, 6, 6)
    a = a + a.mT
    program = portable.capture(_Eigh(), (a,))
    assert [g.axis for g in gauge_outputs(program).values()] == [-2]
    report = check_parity(program, (a,), backends=["xla"])
    assert report.ok, report.format()


def _svd_gauges():
    return {"output U": GaugeOutput(-2, "svd", 0), "output Vh": GaugeOutput(-1, "svd", 2)}


def test_alignment_flips_signs_and_nothing_else():
    u, s, vh = torch.linalg.svd(_wide(3, 5), full_matrices=False)
    flip = torch.tensor([1.0, -1.0, -1.0])
    got = {"output U": u * flip, "output Vh": vh * flip[:, None], "output S": s}
    want = {"output U": u, "output Vh": vh, "output S": s}
    aligned = align(_svd_gauges(), got, want)
    assert torch.equal(aligned["output U"], u) and torch.equal(aligned["output Vh"], vh)


@pytest.mark.parametrize("wrong", ["Vh not flipped with U", "columns swapped", "perturbed"])
def test_a_wrong_factor_still_fails(wrong):
    u, s, vh = torch.linalg.svd(_wide(3, 5), full_matrices=False)
    bad_u, bad_vh = u.clone(), vh.clone()
    if wrong == "Vh not flipped with U":
        bad_u[:, 1] = -bad_u[:, 1]  # a valid U sign, but Vh's row 1 keeps its sign: U S Vh != A
    elif wrong == "columns swapped":
        bad_u, bad_vh = bad_u[:, [1, 0, 2]], bad_vh[[1, 0, 2]]
    else:
        bad_u[0, 0] += 1e-3
    got = {"output U": bad_u, "output Vh": bad_vh}
    aligned = align(_svd_gauges(), got, {"output U": u, "output Vh": vh})
    close = [
        torch.allclose(aligned[k], w, rtol=1e-5, atol=1e-5)
        for k, w in (("output U", u), ("output Vh", vh))
    ]
    assert not all(close)


class _InvariantSvd(torch.nn.Module):
    """A gauge-invariant use of the factors: U Vh (the polar factor) and S."""

    def __init__(self, x):
        super().__init__()
        self.x = torch.nn.Parameter(x)

    def forward(self):
        u, s, vh = torch.linalg.svd(self.x, full_matrices=False)
        return u @ vh, s


class _InvariantEigh(torch.nn.Module):
    """|V| and the eigenvalues: invariant under each eigenvector's sign."""

    def __init__(self, a):
        super().__init__()
        self.a = torch.nn.Parameter(a)

    def forward(self):
        w, v = torch.linalg.eigh(self.a + self.a.mT)
        return w, v.abs()


def _loss(model):
    torch.manual_seed(1)
    cotangents = [torch.randn(o.shape) for o in model()]

    def loss_fn(m):
        return sum((o * c).sum() for o, c in zip(m(), cotangents, strict=True))

    return loss_fn


@pytest.mark.parametrize("make", [_InvariantSvd, _InvariantEigh], ids=["svd", "eigh"])
def test_gauge_invariant_training_steps_match_eager_on_xla(make):
    torch.manual_seed(0)
    model = make(torch.randn(4, 4))
    loss_fn = _loss(model)
    program = portable.capture(model, (), loss_fn=loss_fn, optimizer=portable.optim.SGD(lr=0.1))
    report = check_parity(program, (), backends=["xla"], eager_model=model, loss_fn=loss_fn)
    assert report.ok, report.format()


class _CholeskyEx(torch.nn.Module):
    def forward(self, x):
        return torch.linalg.cholesky_ex(x).info


class _LuInfo(torch.nn.Module):
    def forward(self, x):
        return torch.linalg.lu_factor_ex(x).info


@pytest.mark.parametrize(
    ("module", "matrix"),
    [
        (_CholeskyEx(), [[4.0, 2.0, 0.0], [2.0, 1.0, 0.0], [0.0, 0.0, 1.0]]),  # minor 2 is 0
        (_CholeskyEx(), [[1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, -3.0]]),  # minor 3 < 0
        (_CholeskyEx(), [[2.0, 1.0, 0.0], [1.0, 2.0, 1.0], [0.0, 1.0, 2.0]]),  # SPD: 0
        (_LuInfo(), [[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [1.0, 0.0, 1.0]]),  # singular
        (_LuInfo(), [[0.0, 0.0], [0.0, 0.0]]),
    ],
)
def test_info_is_lapacks_code_where_eager_would_raise(module, matrix):
    x = torch.tensor(matrix)
    program = portable.capture(module, (x,))
    want = module(x)
    assert torch.equal(portable.compile(program, backend="cpu")(x), want)
    assert torch.equal(portable.compile(program, backend="xla")(x), want)


def test_inverse_of_a_singular_matrix_captures_and_does_not_raise():
    class Inv(torch.nn.Module):
        def forward(self, x):
            return torch.linalg.inv(x)

    x = torch.eye(3)
    program = portable.capture(Inv(), (x,))
    assert not any("check_errors" in str(n.target) for n in program.graph_module.graph.nodes)
    with pytest.raises(torch.linalg.LinAlgError):
        Inv()(torch.zeros(3, 3))
    out = portable.compile(program, backend="cpu")(torch.zeros(3, 3))  # no check: inf/NaN
    assert not torch.isfinite(out).all()


def test_the_extra_vectors_of_a_full_svd_compare_as_a_subspace():
    x = _wide(5, 3)
    u, s, vh = torch.linalg.svd(x, full_matrices=True)  # U's columns 3, 4: x's left null space
    gauges = {"output U": GaugeOutput(-2, "svd", 0, k=3)}
    c, sn = 0.6, 0.8  # another orthonormal basis of the same null space: rotated, still right
    rotated = u.clone()
    rotated[:, 3], rotated[:, 4] = c * u[:, 3] + sn * u[:, 4], -sn * u[:, 3] + c * u[:, 4]
    aligned = align(gauges, {"output U": rotated}, {"output U": u})["output U"]
    torch.testing.assert_close(aligned, u, rtol=1e-6, atol=1e-6)
    wrong = u.clone()
    wrong[:, 4] = u[:, 0]  # not a basis of the null space
    aligned = align(gauges, {"output U": wrong}, {"output U": u})["output U"]
    assert not torch.allclose(aligned, u, rtol=1e-5, atol=1e-5)
