"""PyTorch's OpInfo database as portable's conformance sweep.

Each OpInfo sample (`op.sample_inputs("cpu", dtype)`: the inputs, arguments and keyword arguments
the PyTorch project tests the op with) becomes a one-op module, `forward(*tensors) = op(...)`,
with every tensor of the sample as an input and everything else a constant. A case is one sample
of one dtype; `run_case` takes it through what a user does:

1. eager: the module run by PyTorch (a sample eager refuses, or whose result is not tensors, is
   `skip`; an op whose two seeded runs differ is `random`, out of scope until the generator of
   the training recipe);
2. capture (`portable.capture`): a PortableError is `refused` (typed); anything else `untyped`;
   when capture refuses, `torch.export` plus core-ATen decomposition is tried on its own, and a
   sample that does not even get that far is `not-core` (outside the acceptance denominator);
3. `cpu` against eager: `bit` (identical), `close` (within OpInfo's own tolerance for the dtype)
   or `wrong`;
4. each backend against `cpu` (`check_parity`, the one tolerance policy): `pass`, `refused` (a
   typed error before or while lowering), `wrong` (silent: it ran and disagrees) or `untyped`;
5. the training step (float32, when the op supports autograd and the sample has a float input):
   float inputs become parameters, the loss is the sum of each float output times a fixed random
   cotangent, one SGD step; captured and compared with eager (`torch.optim`) and on `xla`.

`python -m tests.support.opinfo [--samples N] [--ops a,b] [--out FILE]` sweeps the whole database
(each OpInfo in a subprocess-free loop, one JSON line per case) and prints the figures
docs/opset.md and docs/testing.md quote; tests/test_opinfo.py runs the small form.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import sys
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

import portable
from portable.errors import LoweringError, PortableError
from portable.testing import check_parity
from portable.testing.runs import executable

from .opinfo_agreement import close, mismatch, same, same_up_to_ties, tie_input

DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool)
BACKENDS = ("xla", "onnx")
# ops whose values are uninitialized memory: only their shapes and dtypes are the op's contract
_UNINITIALIZED = frozenset(
    {"empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided", "empty_permuted"}
)


@dataclasses.dataclass
class Case:
    """One sample of one OpInfo in one dtype, and what each stage made of it."""

    op: str  # OpInfo name, with its variant after a dot
    dtype: str
    index: int
    eager: str = ""  # ok | skip | random
    capture: str = ""  # ok | refused | untyped | not-core
    cpu: str = ""  # bit | close | wrong | error
    backends: dict[str, str] = dataclasses.field(default_factory=dict)
    train: str = ""  # "" (not differentiable) | pass | refused | untyped | wrong
    train_xla: str = ""
    why: dict[str, str] = dataclasses.field(default_factory=dict)  # stage -> first line

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def op_db() -> list[Any]:
    from torch.testing._internal.common_methods_invocations import op_db as db

    return list(db)


def full_name(info: Any) -> str:
    return f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name


# --------------------------------------------------------------------------- the one-op module


class _Slot:
    def __init__(self, index: int) -> None:
        self.index = index


def _template(value: Any, tensors: list[torch.Tensor]) -> Any:
    """`value` with every tensor replaced by a slot into `tensors` (appended in order)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach().clone())
        return _Slot(len(tensors) - 1)
    if isinstance(value, (list, tuple)):
        filled = [_template(v, tensors) for v in value]
        return type(value)(filled) if isinstance(value, list) else tuple(filled)
    if isinstance(value, dict):
        return {k: _template(v, tensors) for k, v in value.items()}
    return value


def _fill(value: Any, tensors: Sequence[torch.Tensor]) -> Any:
    if isinstance(value, _Slot):
        return tensors[value.index]
    if isinstance(value, list):
        return [_fill(v, tensors) for v in value]
    if isinstance(value, tuple):
        return tuple(_fill(v, tensors) for v in value)
    if isinstance(value, dict):
        return {k: _fill(v, tensors) for k, v in value.items()}
    return value


class OpCall(torch.nn.Module):
    """forward(*inputs) = op(*args, **kwargs) with the sample's tensors in their slots; the
    slots listed in `params` are the module's parameters instead of inputs."""

    def __init__(
        self,
        op: Any,
        template: tuple[Any, Any],
        tensors: list[torch.Tensor],
        params: Sequence[int] = (),
    ) -> None:
        super().__init__()
        self.op = op
        self.template = template
        self.n = len(tensors)
        self.param_slots = tuple(params)
        self.weights = torch.nn.ParameterList(
            [torch.nn.Parameter(tensors[i].clone()) for i in self.param_slots]
        )

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        given = iter(inputs)
        params = dict(zip(self.param_slots, self.weights, strict=True))
        tensors = [params[i] if i in params else next(given) for i in range(self.n)]
        args, kwargs = _fill(self.template, tensors)
        return tuple(pytree.tree_leaves(self.op(*args, **kwargs)))


def _module(info: Any, sample: Any, params: Sequence[int] = ()) -> tuple[OpCall, tuple]:
    tensors: list[torch.Tensor] = []
    template = _template(((sample.input, *sample.args), dict(sample.kwargs)), tensors)
    module = OpCall(info.op, template, tensors, params)
    inputs = tuple(t for i, t in enumerate(tensors) if i not in set(params))
    return module, inputs


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"[:300]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


# --------------------------------------------------------------------------- one case


def _eager(module: torch.nn.Module, inputs: tuple) -> tuple[torch.Tensor, ...] | None:
    with torch.no_grad():
        out = module(*inputs)
    if not out or not all(isinstance(o, torch.Tensor) for o in out):
        return None
    return tuple(o.detach().clone() for o in out)


def _seeded(module: torch.nn.Module, inputs: tuple, seed: int) -> tuple | None:
    torch.manual_seed(seed)
    return _eager(module, inputs)


def _decomposes(module: torch.nn.Module, inputs: tuple) -> bool:
    """Whether torch.export plus core-ATen decomposition takes the sample at all."""
    try:
        with _quiet():
            torch.export.export(module, inputs, strict=False).run_decompositions()
        return True
    except Exception:  # noqa: BLE001 (torch.export fails in many types)
        return False


def _classify(error: BaseException) -> str:
    return "refused" if isinstance(error, PortableError) else "untyped"


def _backend_rows(
    program: Any,
    inputs: tuple,
    case: Case,
    backends: Sequence[str],
    prefix: str = "",
    ties_of: tuple[torch.Tensor, tuple[int, ...]] | None = None,
) -> None:
    """Each backend against `cpu`; with `ties_of` (an unstable sort or topk: its input and index
    results), index results that differ only in the order of equal elements pass."""
    for backend in backends:
        key = prefix + backend
        try:
            with _quiet():
                report = check_parity(program, inputs, backends=[backend])
                ok = report.ok or (
                    ties_of is not None
                    and same_up_to_ties(
                        ties_of,
                        tuple(pytree.tree_leaves(executable(program, backend)(*inputs))),
                        tuple(pytree.tree_leaves(executable(program, "cpu")(*inputs))),
                    )
                )
        except Exception as error:  # noqa: BLE001
            case.backends[key] = _classify(error)
            case.why[key] = _first_line(error)
            continue
        case.backends[key] = "pass" if ok else "wrong"
        if not ok:
            case.why[key] = report.format().splitlines()[-1][:300]


def run_case(
    info: Any,
    sample: Any,
    dtype: torch.dtype,
    index: int,
    backends: Sequence[str] = BACKENDS,
    train: bool = True,
) -> Case:
    case = Case(full_name(info), str(dtype).removeprefix("torch."), index)
    module, inputs = _module(info, sample)
    try:
        first = _seeded(module, inputs, 0)
        again = _seeded(module, inputs, 1)
    except Exception as error:  # noqa: BLE001 (a sample eager refuses: not the op's contract)
        case.eager, case.why["eager"] = "skip", _first_line(error)
        return case
    if first is None or again is None:
        case.eager = "skip"
        case.why["eager"] = "the result is not tensors"
        return case
    try:
        repeatable = same(first, again)
    except Exception as error:  # noqa: BLE001 (sparse or complex-half results torch cannot compare)
        case.eager, case.why["eager"] = "skip", f"results not comparable: {_first_line(error)}"
        return case
    if not repeatable:
        case.eager = "random"
        return case
    case.eager = "ok"
    try:
        with _quiet():
            program = portable.capture(module, inputs)
    except Exception as error:  # noqa: BLE001
        case.capture, case.why["capture"] = _classify(error), _first_line(error)
        if not _decomposes(module, inputs):
            case.capture = "not-core"
        return case
    case.capture = "ok"
    if info.name in _UNINITIALIZED:
        _metadata_rows(program, inputs, first, case, backends)
        return case
    try:
        exe = executable(program, "cpu")
        result = exe(*inputs)
        got = tuple(pytree.tree_leaves(result))
        want = first
        case.cpu = "bit" if same(got, want) else ("close" if close(got, want) else "wrong")
        if case.cpu == "wrong":
            case.why["cpu"] = mismatch(got, want)
    except Exception as error:  # noqa: BLE001
        case.cpu, case.why["cpu"] = "error", _first_line(error)
    _backend_rows(program, inputs, case, backends, ties_of=tie_input(info, sample))
    if train and dtype == torch.float32 and info.supports_autograd:
        _train(info, sample, case, backends)
    return case


def _metadata_rows(
    program: Any, inputs: tuple, want: Sequence[torch.Tensor], case: Case, backends: Sequence[str]
) -> None:
    """`cpu` and each backend for an op of uninitialized values: shapes and dtypes only."""

    def same_specs(got: Sequence[torch.Tensor]) -> bool:
        return len(got) == len(want) and all(
            g.shape == w.shape and g.dtype == w.dtype for g, w in zip(got, want, strict=True)
        )

    for backend in ("cpu", *backends):
        try:
            with _quiet():
                got = tuple(pytree.tree_leaves(executable(program, backend)(*inputs)))
        except Exception as error:  # noqa: BLE001
            result, why = ("error" if backend == "cpu" else _classify(error)), _first_line(error)
        else:
            ok = same_specs(got)
            result = ("bit" if ok else "wrong") if backend == "cpu" else ("pass" if ok else "wrong")
            why = "" if ok else "shape or dtype differs"
        if backend == "cpu":
            case.cpu = result
        else:
            case.backends[backend] = result
        if why:
            case.why[backend] = why


def cotangent_loss(
    out: Sequence[torch.Tensor], floats: Sequence[bool], process: Any = lambda outs: outs
) -> Any:
    """The loss `loss_fn(model, *batch)` of a one-op training step: the sum of each result that
    carries a gradient (`floats`) times a fixed random cotangent of its shape (seed 0), so every
    element's gradient is exercised and the step is the same in eager and in the program.
    `process` maps the model's results to the ones the loss is taken of (`_processed`)."""
    generator = torch.Generator().manual_seed(0)
    cotangents = [
        torch.randn(o.shape, generator=generator) if f else None
        for o, f in zip(out, floats, strict=True)
    ]

    def loss_fn(model: torch.nn.Module, *batch: torch.Tensor) -> torch.Tensor:
        outs = process(model(*batch))
        terms = [(o * c).sum() for o, c in zip(outs, cotangents, strict=True) if c is not None]
        return torch.stack(terms).sum()

    return loss_fn


def _processed(sample: Any) -> Any:
    """The sample's `output_process_fn_grad` on a one-op module's results, as a tuple: what
    PyTorch's own gradient tests differentiate. For factorizations it is gauge-invariant
    (|U|, |eigenvectors|, U @ Vh): a loss of a raw singular vector depends on the sign LAPACK
    picks, which differs between correct backends."""

    def process(outs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        value = outs[0] if len(outs) == 1 else tuple(outs)
        return tuple(pytree.tree_leaves(sample.output_process_fn_grad(value)))

    return process


def _train(info: Any, sample: Any, case: Case, backends: Sequence[str]) -> None:
    tensors: list[torch.Tensor] = []
    _template(((sample.input, *sample.args), dict(sample.kwargs)), tensors)
    params = [i for i, t in enumerate(tensors) if t.dtype == torch.float32 and t.numel()]
    if not params:
        return
    module, batch = _module(info, sample, params)
    process = _processed(sample)
    try:
        out = process(module(*batch))
    except Exception:  # noqa: BLE001 (no autograd for this sample)
        return
    floats = [o.is_floating_point() and o.requires_grad for o in out]
    if not any(floats):
        return
    loss_fn = cotangent_loss(out, floats, process)
    # only the float inputs eager differentiates by are parameters (expand_as's second
    # argument gives a shape alone: capture refuses a parameter that does not reach the loss)
    grads = torch.autograd.grad(loss_fn(module, *batch), list(module.weights), allow_unused=True)
    used = [slot for slot, g in zip(params, grads, strict=True) if g is not None]
    if not used:
        return
    if len(used) < len(params):
        params = used
        module, batch = _module(info, sample, params)
    try:
        with _quiet():
            program = portable.capture(
                module, batch, loss_fn=loss_fn, optimizer=portable.optim.SGD(lr=0.1)
            )
    except Exception as error:  # noqa: BLE001
        case.train, case.why["train"] = _classify(error), _first_line(error)
        return
    on_xla = "xla" in backends
    try:
        with _quiet():
            try:
                report = check_parity(
                    program,
                    batch,
                    backends=["xla"] if on_xla else ["cpu"],
                    eager_model=module,
                    loss_fn=loss_fn,
                )
            except LoweringError:  # xla refuses an op by capability: the step on cpu alone
                if not on_xla:
                    raise
                on_xla = False
                case.train_xla = "refused"
                report = check_parity(
                    program, batch, backends=["cpu"], eager_model=module, loss_fn=loss_fn
                )
    except Exception as error:  # noqa: BLE001
        case.train, case.why["train"] = _classify(error), _first_line(error)
        return
    eager_ok = all(r.ok for r in report.rows if r.backend == "eager")
    xla_ok = all(r.ok for r in report.rows if r.backend != "eager")
    case.train = "pass" if eager_ok else "wrong"
    if on_xla:
        case.train_xla = "pass" if xla_ok else "wrong"
    if not report.ok:
        case.why["train"] = "; ".join(
            f"{r.backend} {r.quantity} max abs {r.max_abs:.3g}" for r in report.mismatches()
        )[:300]


# --------------------------------------------------------------------------- the sweep


def cases(
    info: Any,
    samples: int,
    dtypes: Sequence[torch.dtype] = DTYPES,
    backends: Sequence[str] = BACKENDS,
    train: bool = True,
) -> Iterator[Case]:
    """The first `samples` samples of `info` in each of `dtypes` it supports on CPU."""
    supported = info.supported_dtypes("cpu")
    for dtype in dtypes:
        if dtype not in supported:
            continue
        try:
            found = list(_take(info.sample_inputs("cpu", dtype, requires_grad=False), samples))
        except Exception as error:  # noqa: BLE001 (a sample generator that fails here)
            yield Case(
                full_name(info),
                str(dtype).removeprefix("torch."),
                -1,
                eager="skip",
                why={"eager": _first_line(error)},
            )
            continue
        for index, sample in enumerate(found):
            yield run_case(info, sample, dtype, index, backends, train and index == 0)


def _take(samples: Iterable[Any], n: int) -> Iterator[Any]:
    for i, sample in enumerate(samples):
        if i >= n:
            return
        yield sample


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The sweep's figures: per OpInfo (captured when every core-ATen sample of it captured),
    per case and backend, and the training steps."""
    by_op: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_op[row["op"]].append(row)
    core = {
        op
        for op, rs in by_op.items()
        if any(r["capture"] in ("ok", "refused", "untyped") for r in rs)
    }
    captured = {
        op
        for op in core
        if all(
            r["capture"] == "ok" for r in by_op[op] if r["capture"] in ("ok", "refused", "untyped")
        )
    }
    random_ops = {op for op, rs in by_op.items() if any(r["eager"] == "random" for r in rs)}
    figures: dict[str, Any] = {
        "opinfos": len(by_op),
        "core_aten": len(core),
        "captured": len(captured),
        "random": len(random_ops),
        "cases": len(rows),
        "capture": dict(Counter(r["capture"] for r in rows if r["eager"] == "ok")),
        "cpu": dict(Counter(r["cpu"] for r in rows if r["capture"] == "ok")),
        "train": dict(Counter(r["train"] for r in rows if r["train"])),
        "train_xla": dict(Counter(r["train_xla"] for r in rows if r["train_xla"])),
    }
    for backend in sorted({b for r in rows for b in r["backends"]}):
        figures[backend] = dict(
            Counter(r["backends"][backend] for r in rows if backend in r["backends"])
        )
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=2, help="samples per OpInfo and dtype")
    parser.add_argument("--ops", default="", help="comma-separated OpInfo names (default: all)")
    parser.add_argument("--shard", default="0/1", help="i/n: every n-th OpInfo from the i-th")
    parser.add_argument("--out", default="-", help="JSON lines of the cases (default stdout)")
    parser.add_argument("--summary", default="", help="summarize an existing JSON lines file")
    parser.add_argument(
        "--dtypes",
        default=",".join(str(d).removeprefix("torch.") for d in DTYPES),
        help="comma-separated dtypes (default: float32,bfloat16,int64,bool)",
    )
    args = parser.parse_args(argv)
    dtypes = tuple(getattr(torch, name) for name in args.dtypes.split(",") if name)
    if args.summary:
        rows = [json.loads(line) for line in open(args.summary) if line.strip()]
        print(json.dumps(summarize(rows), indent=1))
        return 0
    wanted = {s for s in args.ops.split(",") if s}
    shard, shards = (int(x) for x in args.shard.split("/"))
    infos = [i for i in op_db() if not wanted or i.name in wanted or full_name(i) in wanted]
    infos = infos[shard::shards]
    out = sys.stdout if args.out == "-" else open(args.out, "a")
    torch.set_num_threads(1)
    for info in infos:
        start = time.perf_counter()
        for case in cases(info, args.samples, dtypes):
            out.write(json.dumps(case.to_json()) + "\n")
            out.flush()
        print(f"{full_name(info)}: {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
