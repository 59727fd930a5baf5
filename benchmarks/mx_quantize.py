"""How fast MX quantization runs on the CPU, as ratios against a copy of the same tensor.

    python benchmarks/mx_quantize.py [--small] [--repeat 10] [--write docs/performance.md]

- **portable / copy**: `portable.mx.quantize(x, format, axis=-1, scale_rule=rule)` (the CPU kernel
  of `portable::mx_quantize`) against `x.clone()`, on a 128 MiB float32 tensor (32 Mi elements,
  shape [8192, 4096], blocks of 32 along the last dim), for every format and the rceil and floor
  rules. Goals: e4m3 (MXFP8) at most torchao's compiled ratio (1.0x without torchao), e2m1
  (MXFP4) at most 1.0x.
- **torchao / copy**: `torchao.prototype.mx_formats.mx_tensor.to_mx` on the same tensor, eager and
  under `torch.compile` (e4m3 and e2m1 only); skipped with a note when torchao is not installed,
  and a failure is recorded as such.
- **dequantize / copy**: `portable.mx.dequantize` back to float32, per format. Goal: at most
  1.5x.

Each repeat times a copy and then the operation back to back, after warm-up; a result is the
median over the repeats of these paired ratios (the machines are noisy, and pairing cancels most
of the drift). Ratios, not seconds, are the result. `--small` uses a 1 MiB tensor (tests).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import portable.mx

HERE = Path(__file__).resolve().parent
MARK = "<!-- mx_quantize -->"
FORMATS = ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "int8")
RULES = ("rceil", "floor")
GOALS = {"e4m3": 1.0, "e2m1": 1.0}  # at most this many copy times (e4m3: or torchao compiled)
DEQUANTIZE_GOAL = 1.5
COMPILED = ("e4m3", "e2m1")  # formats timed under torch.compile in torchao
COLS = 4096
FULL = 32 * 2**20  # elements: 128 MiB of float32
SMALL = 2**18  # elements: 1 MiB of float32
AO_REPEAT = 5  # at most this many repeats for torchao's cells: it is 3-80x slower

Value = float | str


def _sibling(stem: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{stem}", HERE / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_input(numel: int, seed: int = 0) -> torch.Tensor:
    """[numel / 4096, 4096] normal values, each row scaled by 2^k (k in [-20, 20)), so the
    blocks' scales spread over 40 binades."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel // COLS, COLS, generator=g)
    return x.mul_(torch.exp2(torch.randint(-20, 20, (x.shape[0], 1), generator=g).float()))


class Cell:
    """One table cell: `fn` timed against the baseline `repeat` times (or why it cannot be).

    A plain class, not a dataclass: the module is also loaded by file path, outside sys.modules."""

    def __init__(
        self, row: str, col: str, fn: Callable[[], object], repeat: int, warmup: int = 2,
        error: str | None = None,
    ) -> None:  # fmt: skip
        self.row, self.col, self.fn = row, col, fn
        self.repeat, self.warmup, self.error = repeat, warmup, error
        self.ratios: list[float] = []
        self.seconds: list[float] = []

    def value(self) -> Value:
        return self.error if self.error is not None else statistics.median(self.ratios)


def run_cells(cells: list[Cell], base: Callable[[], object]) -> None:
    """Warm every cell up (a failure is recorded in the cell), then time in rounds: each round
    times `base` and then `fn` back to back once for every cell still short of its repeats, so
    a burst of load from other processes costs each cell one sample, not all of its samples."""
    for cell in cells:
        try:
            for _ in range(cell.warmup):
                base()
                cell.fn()
        except Exception as exc:  # a failing implementation is a result (torchao's compile)
            cell.error = _failure(exc)
    for round_ in range(max((c.repeat for c in cells), default=0)):
        for cell in cells:
            if cell.error is None and round_ < cell.repeat:
                start = time.perf_counter()
                base()
                mid = time.perf_counter()
                cell.fn()
                end = time.perf_counter()
                cell.ratios.append((end - mid) / (mid - start))
                cell.seconds.append(end - mid)


def torchao_to_mx() -> tuple[Callable | None, str]:
    """(to_mx(x, format, rule) or None, a note naming the torchao version or why it is absent)."""
    try:
        import torchao
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except Exception as exc:  # ImportError, or an install that does not match this torch
        return None, f"torchao not available ({type(exc).__name__}: {exc}); its columns are skipped"
    dtypes = {
        "e4m3": torch.float8_e4m3fn,
        "e5m2": torch.float8_e5m2,
        "e3m2": "fp6_e3m2",
        "e2m3": "fp6_e2m3",
        "e2m1": torch.float4_e2m1fn_x2,
    }

    def quantize(x: torch.Tensor, fmt: str, rule: str, fn: Callable = to_mx):
        return fn(x, dtypes[fmt], 32, ScaleCalculationMode(rule))

    quantize.formats = tuple(dtypes)  # type: ignore[attr-defined]
    return quantize, f"torchao {torchao.__version__}"


def _failure(exc: Exception) -> str:
    first = (str(exc).strip().splitlines() or [""])[0].replace("|", "/")
    first = first.removeprefix("AssertionError: ")[:60]
    return f"fails: {type(exc).__name__}: {first}"


def measure(
    numel: int = FULL, repeat: int = 10, torchao: bool = True, compiled: bool = True
) -> tuple[dict[str, dict[str, Value]], dict[str, dict[str, Value]], dict[str, Value]]:
    """(quantize rows keyed "format rule", dequantize rows keyed by format, run info)."""
    x = make_input(numel)
    copy = x.clone
    ao, ao_note = torchao_to_mx() if torchao else (None, "torchao not measured (--no-torchao)")
    ao_repeat = max(1, min(repeat, AO_REPEAT))
    if ao is not None and compiled:
        # a failing inductor compile logs the whole kernel IR at CRITICAL level
        logging.getLogger("torch._inductor").setLevel(logging.CRITICAL + 1)
    cells = [Cell("copy", "copy / copy", copy, repeat)]  # the baseline against itself: noise
    for fmt in FORMATS:
        for rule in RULES:
            key = f"{fmt} {rule}"
            q = functools.partial(portable.mx.quantize, x, fmt, scale_rule=rule)
            cells.append(Cell(key, "portable / copy", q, repeat))
            if ao is None:
                continue
            if fmt not in ao.formats:
                cells.append(_note(key, "torchao eager / copy", "unsupported"))
                if compiled:
                    cells.append(_note(key, "torchao compiled / copy", "unsupported"))
                continue
            eager = functools.partial(ao, x, fmt, rule)
            cells.append(Cell(key, "torchao eager / copy", eager, ao_repeat, warmup=1))
            if compiled and fmt in COMPILED:
                fn = torch.compile(functools.partial(ao, fmt=fmt, rule=rule))
                cell = Cell(key, "torchao compiled / copy", functools.partial(fn, x), ao_repeat)
                cells.append(cell)
            elif compiled:
                cells.append(_note(key, "torchao compiled / copy", "not timed"))
    for fmt in FORMATS:
        codes, scales = portable.mx.quantize(x, fmt, scale_rule="rceil")
        dq = functools.partial(portable.mx.dequantize, codes, scales, fmt)
        cells.append(Cell(fmt, "dequantize / copy", dq, repeat))
    run_cells(cells, copy)

    quant: dict[str, dict[str, Value]] = {}
    dequant: dict[str, dict[str, Value]] = {}
    for cell in cells[1:]:
        rows = dequant if cell.col.startswith("dequantize") else quant
        row = rows.setdefault(cell.row, {})
        row[cell.col] = cell.value()
        if cell.col in ("portable / copy", "dequantize / copy"):
            row["portable ms"] = statistics.median(cell.seconds) * 1e3
    for key, row in quant.items():
        goal = GOALS.get(key.split()[0])
        ao = row.get("torchao compiled / copy")
        if goal is not None and key.startswith("e4m3") and isinstance(ao, float):
            goal = ao  # as fast as torchao's fused, compiled kernel
        elif key.startswith("e4m3") and isinstance(ao, str) and ao.startswith("fails"):
            goal = None  # torchao's compile fails for this rule: nothing to be as fast as
        row["goal"] = "" if goal is None else _goal(row["portable / copy"], goal)
        row["portable ms"] = row.pop("portable ms")  # the last columns: ms, goal
        row["goal"] = row.pop("goal")
    for row in dequant.values():
        row["goal"] = _goal(row["dequantize / copy"], DEQUANTIZE_GOAL)
    copy_s = statistics.median(cells[0].seconds)
    info: dict[str, Value] = {
        "numel": numel,
        "copy ms": copy_s * 1e3,
        "copy GB/s": 2 * x.nbytes / copy_s / 1e9,  # read + write
        "copy / copy": cells[0].value(),
        "torchao": ao_note,
    }
    return quant, dequant, info


def _note(row: str, col: str, text: str) -> Cell:
    return Cell(row, col, lambda: None, 0, warmup=0, error=text)


def _goal(ratio: Value, goal: float) -> str:
    if not isinstance(ratio, float):
        return ""
    return f"<= {goal:.2f}x: {'met' if ratio <= goal else 'not met'}"


def table(rows: dict[str, dict[str, Value]], first: str) -> str:
    cols = list(dict.fromkeys(c for row in rows.values() for c in row))
    lines = [f"| {first} | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for key, row in rows.items():
        cells = [row.get(c, "") for c in cols]
        text = [f"{v:.2f}" if isinstance(v, float) else str(v) for v in cells]
        lines.append(f"| {key} | " + " | ".join(text) + " |")
    return "\n".join(lines)


def report(quant, dequant, info, repeat: int) -> str:
    mib = info["numel"] * 4 / 2**20
    head = (
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {mib:g} MiB float32 "
        f"tensor ({info['numel']} elements, [{info['numel'] // COLS}, {COLS}], blocks of 32 "
        f"along the last dim), median of {repeat} paired runs (torchao: "
        f"{min(repeat, AO_REPEAT)}); copy (`x.clone()`) {info['copy ms']:.1f} ms "
        f"({info['copy GB/s']:.1f} GB/s read + write), copy / copy "
        f"{info['copy / copy']:.2f}; {info['torchao']}"
    )
    return (
        head
        + "\n\n"
        + table(quant, "quantize")
        + "\n\n"
        + table(dequant, "dequantize (from rceil codes)")
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10, help="paired runs per cell (median)")
    parser.add_argument("--small", action="store_true", help="a 1 MiB tensor (tests)")
    parser.add_argument("--no-torchao", action="store_true", help="skip torchao's columns")
    parser.add_argument("--no-compile", action="store_true", help="skip torchao under compile")
    parser.add_argument("--write", type=Path, help="update this markdown file's block")
    args = parser.parse_args(argv)
    quant, dequant, info = measure(
        SMALL if args.small else FULL,
        args.repeat,
        torchao=not args.no_torchao,
        compiled=not args.no_compile,
    )
    text = report(quant, dequant, info, args.repeat)
    print(text)
    if args.write:
        _sibling("cpu_overhead").write(args.write, text, mark=MARK)


if __name__ == "__main__":
    main()
