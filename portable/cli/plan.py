"""`portable plan SPEC --system S [--devices N] --global-batch B [...]`: the planner's best plans.

SPEC names the model (portable/planner/presets.py: a preset, a Hugging Face config.json or
`transformer:k=v,...`). Its costs are counted once (a capture of one layer on the meta device:
seconds to tens of seconds, shown as a stage line on stderr), then `planner.search` prices every
configuration on the system and the plans that fit in memory are ranked by step time (or cost
per step with `--price-per-hour`, per device-hour). `--compare SYSTEM[:DEVICES]` searches a
second system with the same costs and shows the best of each side by side. `--plot FILE` draws
step time against memory per device for every configuration searched (matplotlib: the `report`
extra), written to a temporary file and renamed. `--json` prints one document instead of
tables. A plan that cannot exist (the global batch splits over no data-parallel degree) or fits
no device is a PlannerError naming the nearest fix (exit 3).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .. import planner
from ..errors import PlannerError
from ..planner.presets import BOUNDS, Resolved, presets, resolve
from .exit_codes import EPILOG, ExitCode
from .progress import Progress
from .table import format_bytes, format_table

__all__ = ["add_parser", "run"]

_GIB = float(1 << 30)
_ALL = 10**9  # "every plan" for planner.search's `top`
MAX_DEVICES = 1 << 20
MAX_GLOBAL_BATCH = 1 << 24


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "plan",
        parents=parents,
        help="predict step time, memory and MFU of a model's training plans on a system",
        description="Search the parallel plans (tp, pp, dp, cp, ep, ZeRO/FSDP, micro-batch, "
        "recomputation) of SPEC's training step on a system and print the best that fit in "
        "memory, with step time, tokens/s, MFU, memory per device and the step's breakdown. "
        f"SPEC: a preset ({', '.join(presets())}), a Hugging Face config.json (or its folder), "
        "or transformer:layers=L,hidden=H,heads=A,vocab=V,seq=S[,ffn=F,kv_heads=K,...].",
        epilog=EPILOG + "\n\nsee docs/cli.md, `portable plan`, and docs/planner.md",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("spec", metavar="SPEC", help="the model: preset, config.json or transformer:")
    p.add_argument("--system", required=True, metavar="NAME", help=", ".join(planner.systems()))
    p.add_argument(
        "--devices",
        type=_count(MAX_DEVICES),
        action=_Devices,
        default=None,
        metavar="N",
        help="devices of --system (default: one scale-up domain); after --compare SYSTEM, the "
        "compared system's",
    )
    p.add_argument(
        "--global-batch",
        required=True,
        type=_count(MAX_GLOBAL_BATCH),
        metavar="B",
        help="samples per optimizer step, over all devices",
    )
    p.add_argument(
        "--seq",
        type=_count(BOUNDS["seq"]),
        default=None,
        metavar="S",
        help="tokens per sample (default: the spec's; a config.json needs it)",
    )
    p.add_argument("--top", type=_count(1000), default=5, metavar="K", help="plans shown (5)")
    p.add_argument(
        "--price-per-hour",
        type=_price,
        default=None,
        metavar="USD",
        help="price of one device of --system per hour: rank by cost per step",
    )
    p.add_argument(
        "--compare",
        type=_system_and_count,
        default=None,
        metavar="SYSTEM[:DEVICES]",
        help="also search SYSTEM (with DEVICES devices) and show the best of each side by side",
    )
    p.add_argument(
        "--compare-devices",
        type=_count(MAX_DEVICES),
        default=None,
        metavar="N",
        help="devices of the --compare system (default: one scale-up domain)",
    )
    p.add_argument(
        "--compare-price-per-hour",
        type=_price,
        default=None,
        metavar="USD",
        help="price of one device of the --compare system per hour",
    )
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE",
        help="write step time vs memory of every plan searched as a PNG",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document to stdout")
    p.add_argument("--quiet", "-q", action="store_true", help="no stage lines on stderr")
    p.set_defaults(run=run)


# --------------------------------------------------------------------------- arguments


def _count(limit: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not re.fullmatch(r"\d{1,9}", text.strip()) or not 1 <= int(text) <= limit:
            raise argparse.ArgumentTypeError(f"must be an integer from 1 to {limit}, got {text!r}")
        return int(text)

    return parse


def _price(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of dollars, got {text!r}")
    return value


def _system_and_count(text: str) -> tuple[str, int | None]:
    match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]{0,63})(?::(\d{1,9}))?", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"write SYSTEM or SYSTEM:DEVICES, got {text!r}")
    devices = _count(MAX_DEVICES)(match.group(2)) if match.group(2) else None
    return match.group(1), devices


class _Devices(argparse.Action):
    """`--devices N` counts the devices of --system; one given after `--compare SYSTEM` (with no
    count of its own) counts the compared system's, as in `--compare h100 --devices 1024`."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        compare = getattr(namespace, "compare", None)
        if compare is not None and compare[1] is None and namespace.compare_devices is None:
            namespace.compare_devices = values
        elif namespace.devices is None:
            namespace.devices = values
        else:
            raise argparse.ArgumentError(self, "given twice for the same system")


# --------------------------------------------------------------------------- the search


@dataclasses.dataclass(frozen=True)
class Fleet:
    """One system searched: its devices, the price per device-hour asked for, a label."""

    system: planner.System
    price: float | None

    @property
    def label(self) -> str:
        return f"{self.system.name} x {self.system.devices}"

    @property
    def limit(self) -> float:
        return float(self.system.hbm_bytes)


@dataclasses.dataclass(frozen=True)
class Searched:
    """A fleet's plans that fit, best first, and (for --plot) every configuration priced."""

    fleet: Fleet
    plans: list[planner.Estimate]
    everything: list[planner.Estimate] | None


def _fleets(args: argparse.Namespace) -> list[Fleet]:
    fleets = [Fleet(planner.system(args.system, devices=args.devices), args.price_per_hour)]
    if args.compare is None:
        for flag in ("compare_devices", "compare_price_per_hour"):
            if getattr(args, flag) is not None:
                raise PlannerError(
                    f"--{flag.replace('_', '-')} without --compare", fix="add --compare SYSTEM"
                )
        return fleets
    name, devices = args.compare
    if devices is not None and args.compare_devices not in (None, devices):
        raise PlannerError(
            f"--compare {name}:{devices} and a second device count {args.compare_devices}",
            fix="give the compared system's devices once",
        )
    system = planner.system(name, devices=devices or args.compare_devices)
    return [*fleets, Fleet(system, args.compare_price_per_hour)]


def _search(
    costs: planner.Costs,
    model: Resolved,
    fleet: Fleet,
    global_batch: int,
    *,
    memory_limit: float | None = None,
) -> list[planner.Estimate]:
    return planner.search(
        costs,
        fleet.system,
        global_batch,
        top=_ALL,
        memory_limit_bytes=memory_limit,
        price_per_device_hour=fleet.price,
        heads=model.heads,
    )


def _searched(
    costs: planner.Costs, model: Resolved, fleet: Fleet, global_batch: int, everything: bool
) -> Searched:
    plans = _search(costs, model, fleet, global_batch)
    if not plans:
        raise _infeasible(costs, model, fleet, global_batch)
    every = (
        _search(costs, model, fleet, global_batch, memory_limit=math.inf) if everything else None
    )
    return Searched(fleet, plans, every)


def _infeasible(
    costs: planner.Costs, model: Resolved, fleet: Fleet, global_batch: int
) -> PlannerError:
    """Why no plan fits: over memory (the smallest plan's need), or no data-parallel split."""
    every = _search(costs, model, fleet, global_batch, memory_limit=math.inf)
    if every:
        least = min(every, key=lambda e: e.memory.total)
        return PlannerError(
            f"no plan of {model.name} on {fleet.label} fits in {format_bytes(int(fleet.limit))} "
            f"per device: the smallest of {len(every)} needs "
            f"{format_bytes(int(least.memory.total))} ({least.plan.describe()})",
            fix="more devices (--devices), a shorter --seq, or a system with more memory",
        )
    devices = fleet.system.devices
    probe = _search(costs, model, fleet, devices, memory_limit=math.inf)
    degrees = sorted({e.plan.dp for e in probe if e.plan.dp})
    if not degrees:
        return PlannerError(
            f"no configuration of {model.name} splits over {fleet.label}",
            fix="pick another device count (--devices)",
        )
    nearest = _nearest_multiples(global_batch, degrees)
    every_degree = _nearest_multiples(global_batch, [devices])
    return PlannerError(
        f"global batch {global_batch} is not a multiple of any data-parallel degree of "
        f"{fleet.label} (dp = {devices} / (tp*pp*cp) = {', '.join(map(str, degrees))})",
        fix=f"pick a global batch one of them divides: {nearest} are the nearest, "
        f"{every_degree} suit every degree",
    )


def _nearest_multiples(n: int, divisors: Sequence[int]) -> str:
    """`a or b`: the nearest numbers below and above `n` that one of `divisors` divides."""
    below = max((n // d * d for d in divisors if n >= d), default=0)
    above = min(-(-n // d) * d for d in divisors)
    return " or ".join(str(b) for b in (below, above) if b)


# --------------------------------------------------------------------------- the command


def run(args: argparse.Namespace) -> int:
    figure = _figure_class() if args.plot is not None else None  # before the long count
    fleets = _fleets(args)
    model = resolve(args.spec, seq=args.seq)
    stages = 1 + len(fleets) + (figure is not None)
    progress = Progress(stages, enabled=not (args.quiet or args.json))
    with progress.stage("costs", f"counting the costs of {model.name} (seq {model.seq})"):
        costs = planner.costs_of(model.model, seq=model.seq)
    found = []
    for fleet in fleets:
        with progress.stage(f"search:{fleet.label}", f"searching the plans on {fleet.label}"):
            found.append(_searched(costs, model, fleet, args.global_batch, figure is not None))
    if figure is not None:
        with progress.stage("plot", f"plotting {args.plot}"):
            _plot(figure, model, found, args.top, args.plot)
    if args.json:
        print(json.dumps(_document(model, found, args), indent=2))
        return ExitCode.OK
    print(_header(model, args.global_batch))
    for s in found:
        print()
        print(_ranking(s, model, args.global_batch, args.top))
    if len(found) == 2:
        print()
        print(_side_by_side(found[0].plans[0], found[1].plans[0], model, args.global_batch))
    if args.plot is not None:
        print(f"\nwrote {args.plot}")
    return ExitCode.OK


def _document(model: Resolved, found: list[Searched], args: argparse.Namespace) -> dict[str, Any]:
    def one(s: Searched) -> dict[str, Any]:
        system = s.fleet.system
        head = {"name": system.name, "chip": system.chip, "devices": system.devices}
        return {
            "system": head
            | {"memory_limit_bytes": s.fleet.limit, "price_per_device_hour": s.fleet.price},
            "fitting_plans": len(s.plans),
            "searched": None if s.everything is None else len(s.everything),
            "plans": [e.as_dict() for e in s.plans[: args.top]],
        }

    first = one(found[0])
    return {
        "status": "ok",
        "exit_code": 0,
        "model": {
            "spec": model.spec,
            "kind": model.kind,
            "name": model.name,
            "seq": model.seq,
            "heads": model.heads,
            "parameters": model.parameters,
        },
        "global_batch": args.global_batch,
        **first,
        "compare": one(found[1]) if len(found) > 1 else None,
        "plot": None if args.plot is None else str(args.plot),
    }


# --------------------------------------------------------------------------- text output


def _header(model: Resolved, global_batch: int) -> str:
    tokens = global_batch * model.seq
    n = model.parameters
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    return (
        f"{model.name}: {size} parameters, seq {model.seq}, global batch {global_batch} "
        f"({tokens:,} tokens per step)"
    )


def _ranking(s: Searched, model: Resolved, global_batch: int, top: int) -> str:
    shown = s.plans[:top]
    priced = any(e.cost_per_step is not None for e in shown)
    order = "cheapest per step" if s.fleet.price else "fastest"
    headers = ["rank", "plan", "micro-batch", "step", "tokens/s", "MFU", "memory/device"]
    headers += ["compute", "comm", "bubble", "optimizer"]
    if priced:
        headers += ["cost/step", "cost/1M tokens"]
    rows = []
    for rank, e in enumerate(shown, 1):
        b = e.breakdown
        row = [rank, e.plan.describe(), e.plan.micro_batch, _seconds(e.step_time_s)]
        row += [f"{e.tokens_per_s:,.0f}", f"{e.mfu:.1%}", _memory(e)]
        row += [_seconds(x) for x in (b.compute, b.comm, b.bubble, b.optimizer)]
        if priced:
            row += _costs(e, global_batch * model.seq)
        rows.append(row)
    title = (
        f"{s.fleet.label}: {len(s.plans)} plans fit in {s.fleet.limit / _GIB:.1f} GiB per "
        f"device; the {len(shown)} {order}:"
    )
    return title + "\n" + format_table(headers, rows)


def _side_by_side(a: planner.Estimate, b: planner.Estimate, model: Resolved, batch: int) -> str:
    tokens = batch * model.seq
    rows: list[list[object]] = [
        ["plan", a.plan.describe(), b.plan.describe(), ""],
        [
            "step",
            _seconds(a.step_time_s),
            _seconds(b.step_time_s),
            _ratio(b.step_time_s, a.step_time_s),
        ],
        [
            "tokens/s",
            f"{a.tokens_per_s:,.0f}",
            f"{b.tokens_per_s:,.0f}",
            _ratio(b.tokens_per_s, a.tokens_per_s),
        ],
        ["MFU", f"{a.mfu:.1%}", f"{b.mfu:.1%}", ""],
        ["memory/device", _memory(a), _memory(b), ""],
    ]
    if a.cost_per_step is not None and b.cost_per_step is not None:
        ratio = _ratio(b.cost_per_step, a.cost_per_step)
        rows.append(["cost/step", _dollars(a.cost_per_step), _dollars(b.cost_per_step), ratio])
        rows.append(["cost/1M tokens", _costs(a, tokens)[1], _costs(b, tokens)[1], ratio])
    names = [f"{e.system} x {e.devices}" for e in (a, b)]
    headers = ["best plan", *names, f"{names[1]} / {names[0]}"]
    return format_table(headers, rows)


def _seconds(s: float) -> str:
    if s >= 100:
        return f"{s:.0f} s"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


def _memory(e: planner.Estimate) -> str:
    return f"{e.memory.total / _GIB:.1f} / {e.memory_limit_bytes / _GIB:.1f} GiB"


def _costs(e: planner.Estimate, tokens: int) -> list[str]:
    cost = e.cost_per_step or 0.0
    return [_dollars(cost), _dollars(cost / tokens * 1e6)]


def _dollars(x: float) -> str:
    if x >= 1:
        return f"${x:,.2f}"
    return f"${x:.4f}" if x >= 0.01 else f"${x:.2e}"


def _ratio(x: float, y: float) -> str:
    return f"{x / y:.2f}x" if y else ""


# --------------------------------------------------------------------------- the plot


def _figure_class() -> Any:
    """matplotlib's Figure (the Agg canvas, no display); PlannerError naming the extra."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlannerError(
            "--plot needs matplotlib, which is not installed here",
            fix="pip install 'portable[report]' (or leave out --plot)",
        ) from exc
    return Figure


def _plot(figure: Any, model: Resolved, found: Sequence[Searched], top: int, path: Path) -> None:
    """Per fleet: step time against memory per device of every configuration searched, those
    over the memory limit greyed, the top ones starred and numbered, the limit dashed."""
    fig = figure(figsize=(6.5 * len(found), 4.8), dpi=110)
    for i, s in enumerate(found):
        ax = fig.add_subplot(1, len(found), i + 1)
        every = s.everything or s.plans
        over = [e for e in every if e.memory.total > s.fleet.limit]
        fits = [e for e in every if e.memory.total <= s.fleet.limit]
        for group, style in ((fits, {"color": "tab:blue"}), (over, {"color": "0.7"})):
            xs = [e.memory.total / _GIB for e in group]
            ax.scatter(xs, [e.step_time_s for e in group], s=6, alpha=0.5, linewidths=0, **style)
        best = s.plans[:top]
        xs, ys = [e.memory.total / _GIB for e in best], [e.step_time_s for e in best]
        ax.scatter(xs, ys, marker="*", s=90, color="tab:red", label=f"top {len(best)}")
        for rank, (x, y) in enumerate(zip(xs, ys, strict=True), 1):
            ax.annotate(str(rank), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        limit = s.fleet.limit / _GIB
        ax.axvline(limit, color="k", linestyle="--", label=f"memory limit {limit:.0f} GiB")
        ax.scatter([], [], s=6, color="tab:blue", label=f"fit ({len(fits)})")
        ax.scatter([], [], s=6, color="0.7", label=f"over the limit ({len(over)})")
        ax.set(xlabel="memory per device (GiB)", ylabel="step time (s)", xscale="log", yscale="log")
        ax.set_title(f"{model.name} on {s.fleet.label}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    _write_atomically(path, lambda tmp: fig.savefig(tmp, format="png"))


def _write_atomically(path: Path, write: Callable[[str], object]) -> None:
    """`write(temporary path)` beside `path`, then rename it to `path`: `path` is the whole new
    file or what it was before; the temporary file never outlives a failure or Ctrl-C."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
