"""The bad-input catalogue: archives, captures, runtime inputs, CLI misuse, signals, a killed
and a stopped rank, and numbers that must be right. Each scenario runs under a timeout in a
scratch directory holding a canary a payload would create; the summary is

    typed errors X / Y, crashes C, hangs H, code executions E, silent wrong W, data lost L

where Y is the number of scenarios and X those that ended as they must: a typed error for bad
input (or, for input that must work, the right result). The goal is X = Y and C = H = E = W =
L = 0.

    python benchmarks/reliability.py [--quick] [--sweep] [--only CATEGORY] [--write docs/testing.md]

`--quick` runs the scenarios CI runs (tests/test_reliability.py); `--sweep` adds every attack of
the field-by-field archive suite (tests/adversarial.py) as its own scenario.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bad_inputs.base import CANARY, Scenario  # noqa: E402

MODULES = (
    "archives",
    "runtime_inputs",
    "cli_misuse",
    "captures",
    "plans",
    "numerics",
    "backends",
    "processes",
)
MARK = "<!-- reliability -->"


@dataclasses.dataclass(frozen=True)
class Result:
    scenario: Scenario
    outcome: str  # typed:... | ok | wrong:... | lost:... | crash:... | hang | code
    seconds: float

    @property
    def kind(self) -> str:
        return self.outcome.split(":", 1)[0]

    @property
    def as_expected(self) -> bool:
        expect = self.scenario.expect
        return (self.kind == "typed" and expect in ("typed", "either")) or (
            self.kind == "ok" and expect in ("works", "either")
        )

    @property
    def bucket(self) -> str:
        """typed (as it must end) | crash | hang | code | wrong | lost | refused."""
        if self.as_expected:
            return "typed"
        if self.kind == "ok":  # bad input accepted without a word
            return "wrong"
        if self.kind == "typed":  # must work, and was refused
            return "refused"
        return self.kind


def scenarios(*, quick: bool, sweep: bool, only: str | None, workdir: Path) -> list[Scenario]:
    out: list[Scenario] = []
    for name in MODULES:
        module = importlib.import_module(f"bad_inputs.{name}")
        out += [s for s in module.SCENARIOS if s.quick or not quick]
        if sweep and name == "archives":
            out += module.sweep(workdir)
    return [s for s in out if only is None or s.category == only]


def run_one(scenario: Scenario, workdir: Path) -> Result:
    scratch = Path(tempfile.mkdtemp(prefix="scenario-", dir=workdir))
    outcome: list[str] = []

    def target() -> None:
        try:
            outcome.append(scenario.fn(scratch))
        except BaseException as exc:  # noqa: BLE001 - a scenario that raises is a crash
            outcome.append(f"crash:{type(exc).__name__}: {str(exc)[:160]}")

    start = time.perf_counter()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(scenario.timeout)
    seconds = time.perf_counter() - start
    if thread.is_alive():
        return Result(scenario, "hang", seconds)
    if (scratch / CANARY).exists():
        return Result(scenario, "code", seconds)
    return Result(scenario, outcome[0], seconds)


def summary(results: list[Result]) -> str:
    counts = collections.Counter(r.bucket for r in results)
    return (
        f"typed errors {counts['typed']} / {len(results)}, crashes {counts['crash']}, "
        f"hangs {counts['hang']}, code executions {counts['code']}, "
        f"silent wrong {counts['wrong']}, data lost {counts['lost']}"
        + (f", refused though it must work {counts['refused']}" if counts["refused"] else "")
    )


def table(results: list[Result]) -> str:
    by_category: dict[str, list[Result]] = collections.defaultdict(list)
    for r in results:
        by_category[r.scenario.category].append(r)
    lines = ["| inputs | scenarios | as they must end | crash | hang | code | wrong | lost |"]
    lines.append("|---|---|---|---|---|---|---|---|")
    for category, rows in by_category.items():
        c = collections.Counter(r.bucket for r in rows)
        lines.append(
            f"| {category} | {len(rows)} | {c['typed']} | {c['crash']} | {c['hang']} | "
            f"{c['code']} | {c['wrong']} | {c['lost']} |"
        )
    return "\n".join(lines)


def write(doc: Path, block: str) -> None:
    """Replace the text between the two MARK lines of `doc` with `block`."""
    text = doc.read_text()
    head, _, rest = text.partition(MARK)
    _, _, tail = rest.partition(MARK)
    doc.write_text(f"{head}{MARK}\n{block}\n{MARK}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="only what CI runs")
    parser.add_argument("--sweep", action="store_true", help="every field-by-field archive attack")
    parser.add_argument("--only", help="one category: archive, capture, runtime, cli, ...")
    parser.add_argument("--write", type=Path, help="update the catalogue block of this doc")
    parser.add_argument("--verbose", "-v", action="store_true", help="one line per scenario")
    args = parser.parse_args(argv)
    # as tests/conftest.py: Triton's interpreter for the cuda kernels, 8 XLA host devices for
    # per-rank programs (both read when first imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
        os.environ["XLA_FLAGS"] = flags.strip()
    with tempfile.TemporaryDirectory(prefix="reliability-") as tmp:
        work = Path(tmp)
        results = []
        for scenario in scenarios(quick=args.quick, sweep=args.sweep, only=args.only, workdir=work):
            result = run_one(scenario, work)
            results.append(result)
            if args.verbose or not result.as_expected:
                mark = "ok " if result.as_expected else "BAD"
                print(
                    f"{mark} {result.seconds:6.1f}s  [{scenario.category}] {scenario.name}: "
                    f"{result.outcome}",
                    flush=True,
                )
    line = summary(results)
    print(table(results))
    print(line)
    if args.write:
        write(args.write, f"{table(results)}\n\n`{line}`")
    return 0 if all(r.as_expected for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
