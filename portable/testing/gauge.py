"""Outputs defined only up to a gauge, and how parity compares them.

A real SVD's singular vectors (U's columns, with Vh's matching rows) and a symmetric
eigendecomposition's eigenvectors are each unique only up to sign (for distinct values): every
sign choice is a correct factorization, and two LAPACK builds (torch's MKL, jaxlib's) pick
different ones. A program output that is such a factor, straight from the op, is compared after
flipping each of the backend's vectors to the sign of the reference's (the sign of their dot
product); U and Vh of one SVD are flipped together by U's signs, so a Vh inconsistent with its U
still fails, as does any vector that is not the reference's up to sign. The extra vectors of a
full_matrices=True SVD of a non-square matrix (a basis of the null space or its complement's
complement) are unique only as a subspace and are compared as one. Repeated singular values or
eigenvalues have a larger gauge (any basis of their eigenspace) that is not modelled: such inputs
compare as different. Outputs computed from
the factors are compared as they are (a gauge-invariant use agrees; a gauge-dependent one does
not, as it differs between correct backends).
"""

from __future__ import annotations

import operator

import torch

from ..ir.program import Program
from ..ir.signature import OutputKind

__all__ = ["GaugeOutput", "align", "gauge_outputs"]

aten = torch.ops.aten

# op -> {result index: the axis its vectors run along (-2: columns, -1: rows)}
_VECTORS: dict[object, dict[int, int]] = {
    aten._linalg_svd.default: {0: -2, 2: -1},
    aten._linalg_eigh.default: {1: -2},
}


class GaugeOutput:
    """An output that is a factor with per-vector sign freedom: its vectors run along `axis`;
    `group` names the factorization node (U and Vh of one SVD share it), `index` is the
    factor's result index (the lowest decides a group's signs), `k` the number of singular or
    eigen values (None: every vector is one's); vectors past k span a complement subspace."""

    def __init__(self, axis: int, group: str, index: int, k: int | None = None) -> None:
        self.axis = axis
        self.group = group
        self.index = index
        self.k = k


def gauge_outputs(program: Program) -> dict[str, GaugeOutput]:
    """`output <name>` -> its gauge, for each program output taken straight from a factor."""
    outputs = [o for o in program.signature.outputs if o.kind is OutputKind.OUTPUT]
    out_node = program.graph_module.graph.output_node()
    returned = out_node.args[0]
    args = list(returned) if isinstance(returned, (tuple, list)) else [returned]
    found: dict[str, GaugeOutput] = {}
    specs = list(program.signature.outputs)
    for spec, arg in zip(specs, args, strict=False):
        if spec not in outputs or not isinstance(arg, torch.fx.Node):
            continue
        if arg.op != "call_function" or arg.target is not operator.getitem:
            continue
        source, index = arg.args
        if not isinstance(source, torch.fx.Node) or not isinstance(index, int):
            continue
        axes = _VECTORS.get(source.target, {})
        if index in axes:
            operand = source.args[0] if source.args else None
            matrix = operand.meta.get("tensor") if isinstance(operand, torch.fx.Node) else None
            k = min(int(d) for d in matrix.shape[-2:]) if matrix is not None else None
            found[f"output {spec.name}"] = GaugeOutput(axes[index], source.name, index, k)
    return found


def _signs(got: torch.Tensor, want: torch.Tensor, axis: int) -> torch.Tensor:
    """Per vector, +1 or -1 as [..., 1, k]: the sign that brings `got`'s vector nearest
    `want`'s."""
    dot = (got.double() * want.double()).sum(dim=axis, keepdim=True)
    signs = torch.where(dot < 0, -1.0, 1.0).to(got.dtype)
    return signs.transpose(-1, -2) if axis == -1 else signs


def _subspace(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Columns `got` [..., m, r] rotated onto `want`'s: got @ (want^T got)^T. When got = want R
    for an orthogonal R (another orthonormal basis of the same subspace) this is `want`; for any
    other `got` it is not (the projection of want onto got's span, rescaled by got's norms)."""
    g, w = got.double(), want.double()
    return (g @ (w.mT @ g).mT).to(got.dtype)


def align(
    gauges: dict[str, GaugeOutput], got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """`got` with each gauge output's vectors flipped to the reference's signs. One SVD's U and
    Vh share the signs of their first min(m, n) vectors (U's when U is returned, else Vh's).
    The further vectors of full_matrices=True factors are any orthonormal basis of the
    complement (unique only as a subspace): they are rotated onto the reference's basis."""
    aligned = dict(got)
    groups: dict[str, list[str]] = {}
    for key, gauge in gauges.items():
        if key in got and key in want and got[key].shape == want[key].shape:
            groups.setdefault(gauge.group, []).append(key)
    for keys in groups.values():
        lead = min(keys, key=lambda k: gauges[k].index)
        shared = _signs(got[lead], want[lead], gauges[lead].axis)
        for key in keys:
            k = gauges[key].k
            k = min(got[key].shape[-2:]) if k is None else k  # the singular / eigen vectors
            rows = gauges[key].axis == -1
            g, w = (got[key].mT, want[key].mT) if rows else (got[key], want[key])
            first = g[..., :k] * shared[..., :k]
            if g.shape[-1] > k:
                first = torch.cat([first, _subspace(g[..., k:], w[..., k:])], dim=-1)
            aligned[key] = first.mT if rows else first
    return aligned
