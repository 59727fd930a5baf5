"""The OpInfo conformance suite (tests/support/opinfo.py): PyTorch's own op database, its samples
and dtypes, through capture, `cpu` against eager, every runnable backend against `cpu`, and the
training step.

CI runs the small form: the OpInfos of `SMALL` (ops real models use, and one op of each later
opset family), their first float32 sample, with the training step. PORTABLE_SLOW=full runs every
OpInfo in float32, bfloat16, int64 and bool (two samples each): the sweep whose figures docs/testing.md
quotes (`python -m tests.support.opinfo` writes them).

What every case must satisfy: no untyped error anywhere, no silent wrong answer on any backend
(a backend either matches `cpu` or refuses with a typed error), `cpu` matches eager, and a
captured training step matches eager `torch.optim`.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("expecttest")  # torch.testing._internal imports it
pytest.importorskip("jax")
pytest.importorskip("onnxruntime")

from tests.support import opinfo, opinfo_agreement  # noqa: E402

FULL = os.environ.get("PORTABLE_SLOW") == "full"

SMALL = (
    "add",
    "mul",
    "sin",
    "sum",
    "amax",
    "softmax",
    "matmul",
    "cat",
    "where",
    "nn.functional.relu",
    "nn.functional.gelu",
    "nn.functional.layer_norm",
    "nn.functional.embedding",
    "abs",
    "cumsum",
    # one of each opset 1.4 family, and an op that writes into its inputs
    "polygamma.polygamma_n_1",
    "median",
    "nn.functional.bilinear",
    "linalg.solve",
    "native_batch_norm",
)
# the SMALL ops whose first sample's training step must capture and match (abs needs sign in
# the backward, cumsum flip; add's first sample adds two parameters, whose gradients are one
# tensor)
TRAINED = (
    "add",
    "mul",
    "sin",
    "sum",
    "softmax",
    "matmul",
    "nn.functional.relu",
    "nn.functional.gelu",
    "nn.functional.layer_norm",
    "abs",
    "cumsum",
    "polygamma.polygamma_n_1",
    "nn.functional.bilinear",
    "linalg.solve",
)
# the small form's other dtypes: ops whose bfloat16 / int64 / bool samples each took a fix of
# their own (rounding of the last 16-bit step, ties of unstable sorts, integer pow and
# convolution, bool comparisons, bool values of (values, indices) ops, int64 shifts)
OTHER_DTYPES = (
    "var_mean",
    "logit",
    "sort",
    "topk",
    "pow",
    "nn.functional.conv2d",
    "nn.functional.avg_pool2d",
    "lt",
    "amax",
    "cummax",
    "floor",
    "bitwise_left_shift",
    "tril_indices",
)
_BAD = {"untyped", "wrong", "error"}


def _infos(names: tuple[str, ...] | None) -> list:
    infos = opinfo.op_db()
    if names is None:
        return infos
    found = [i for i in infos if opinfo.full_name(i) in names]
    assert {opinfo.full_name(i) for i in found} == set(names), "a SMALL name is not an OpInfo"
    return found


def _problems(case: opinfo.Case) -> list[str]:
    problems = []
    if case.capture == "untyped":
        problems.append(f"capture untyped: {case.why.get('capture')}")
    if case.cpu in _BAD:
        problems.append(f"cpu {case.cpu}: {case.why.get('cpu')}")
    problems += [f"{b} {r}: {case.why.get(b)}" for b, r in case.backends.items() if r in _BAD]
    if case.train in _BAD:
        problems.append(f"training {case.train}: {case.why.get('train')}")
    if case.train_xla in _BAD:
        problems.append(f"training on xla {case.train_xla}: {case.why.get('train')}")
    return problems


def _sweep(names: tuple[str, ...] | None, samples: int, dtypes: tuple) -> list[opinfo.Case]:
    found = []
    for info in _infos(names):
        found += list(opinfo.cases(info, samples, dtypes))
    return found


@pytest.mark.slow
def test_opinfo_samples_capture_and_agree_on_every_backend():
    names, samples, dtypes = (None, 2, opinfo.DTYPES) if FULL else (SMALL, 1, (torch.float32,))
    found = _sweep(names, samples, dtypes)
    problems = [f"{c.op} {c.dtype} #{c.index}: {p}" for c in found for p in _problems(c)]
    assert not problems, "\n".join(problems)
    if not FULL:  # the small form's ops are all in the opset, forward and backward
        assert all(c.capture == "ok" for c in found if c.eager == "ok")
        trained = {c.op for c in found if c.train == "pass"}
        assert trained >= set(TRAINED), sorted(set(TRAINED) - trained)


def test_a_wrong_backend_result_is_caught_as_wrong(monkeypatch):
    """The harness itself: a backend that computes something else is `wrong`, not `pass`."""
    from portable.backends.xla.rules import RULES, load_rules

    load_rules()
    sin = next(i for i in opinfo.op_db() if i.name == "sin")
    sample = next(iter(sin.sample_inputs("cpu", torch.float32)))
    monkeypatch.setitem(RULES._generic, "aten.sin.default", lambda ctx, x: x)
    case = opinfo.run_case(sin, sample, torch.float32, 0, backends=("xla",), train=False)
    assert case.capture == "ok" and case.cpu == "bit"
    assert case.backends["xla"] == "wrong", case


def test_sort_indices_compare_up_to_the_order_of_ties_only():
    """An unstable sort may order equal elements either way; any other index difference (an
    element taken twice, one that selects another value) and any value difference is wrong."""
    x = torch.tensor([[3, 1, 3, 2], [0, 0, 5, 0]])
    values, want = x.sort(dim=1, stable=True)
    ties = (x, (1,))
    swapped = want.clone()
    swapped[0, 2:] = want[0, 2:].flip(0)  # the two 3s
    swapped[1, :3] = want[1, :3].flip(0)  # the three 0s
    assert not torch.equal(swapped, want)
    assert opinfo_agreement.same_up_to_ties(ties, (values, swapped), (values, want))
    twice = want.clone()
    twice[1, 0] = want[1, 1]
    assert not opinfo_agreement.same_up_to_ties(ties, (values, twice), (values, want))
    other = want.clone()
    other[0, [0, 1]] = other[0, [1, 0]]  # 1 and 2 swapped: another order of distinct values
    assert not opinfo_agreement.same_up_to_ties(ties, (values, other), (values, want))
    assert not opinfo_agreement.same_up_to_ties(ties, (values + 1, swapped), (values, want))


@pytest.mark.slow
def test_opinfo_bfloat16_int64_and_bool_samples_agree():
    """The small form in the dtypes other than float32 (PORTABLE_SLOW=full sweeps them all)."""
    dtypes = (torch.bfloat16, torch.int64, torch.bool)
    found = _sweep(OTHER_DTYPES, 1, dtypes)
    problems = [f"{c.op} {c.dtype} #{c.index}: {p}" for c in found for p in _problems(c)]
    assert not problems, "\n".join(problems)
    assert all(c.capture == "ok" for c in found if c.eager == "ok"), [
        (c.op, c.dtype, c.why.get("capture"))
        for c in found
        if c.capture != "ok" and c.eager == "ok"
    ]
