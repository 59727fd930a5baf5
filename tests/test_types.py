"""mypy over the installed package at the strictness of pyproject.toml's [tool.mypy], held to a
ratchet: each module may have at most, and must have exactly, the error count recorded for it in
tests/mypy_baseline.json (a module not listed must have none). A change that adds an error fails;
one that removes errors fails until the baseline is lowered, so the baseline only shrinks. Goal:
an empty baseline (docs/testing.md, "Type checking").

Regenerate the baseline after fixing errors (never to admit new ones):

    .venv/bin/python tests/test_types.py --write-baseline
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BASELINE = Path(__file__).with_name("mypy_baseline.json")
# mypy's cache lives outside the checkout; it is keyed by file contents, so a warm cache only
# makes the run faster (about 35 s cold, 3 s warm, on 2 cores)
CACHE = Path(tempfile.gettempdir()) / "portable-mypy-cache"
_ERROR = re.compile(r"^(?P<path>[^:\s]+\.py):\d+(?::\d+)?: error: ")


def package_root() -> Path:
    """The folder holding the `portable` that `import portable` imports (the installed one)."""
    spec = importlib.util.find_spec("portable")
    assert spec is not None and spec.origin is not None, "portable is not installed"
    return Path(spec.origin).parents[1]


def run_mypy() -> tuple[Counter[str], str]:
    """Run mypy over the package; return the error count per module and mypy's output."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(REPO / "pyproject.toml"),
            "--cache-dir",
            str(CACHE),
            "--no-error-summary",
            "-p",
            "portable",
        ],
        cwd=package_root(),
        capture_output=True,
        text=True,
    )
    if proc.returncode not in (0, 1):  # 2: mypy itself failed (bad config, crash)
        raise RuntimeError(f"mypy exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")
    counts: Counter[str] = Counter()
    for line in proc.stdout.splitlines():
        if match := _ERROR.match(line):
            counts[_module(match["path"])] += 1
    return counts, proc.stdout


def _module(path: str) -> str:
    parts = Path(path).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def load_baseline() -> dict[str, int]:
    return json.loads(BASELINE.read_text())


def ratchet_failures(counts: Counter[str], baseline: dict[str, int]) -> list[str]:
    """One line per module whose error count differs from its baseline (0 when unlisted)."""
    failures = []
    for module in sorted(set(counts) | set(baseline)):
        got, allowed = counts.get(module, 0), baseline.get(module, 0)
        if got > allowed:
            failures.append(f"{module}: {got} mypy errors, baseline allows {allowed} (new errors)")
        elif got < allowed:
            failures.append(
                f"{module}: {got} mypy errors, baseline says {allowed}: lower the baseline "
                "(python tests/test_types.py --write-baseline)"
            )
    return failures


def write_baseline(counts: Counter[str]) -> None:
    BASELINE.write_text(json.dumps(dict(sorted(counts.items())), indent=1) + "\n")


def test_ratchet_flags_a_rise_and_a_fall():
    baseline = {"portable.a": 2, "portable.b": 1}
    assert ratchet_failures(Counter({"portable.a": 2, "portable.b": 1}), baseline) == []
    rise = ratchet_failures(Counter({"portable.a": 2, "portable.b": 1, "portable.c": 1}), baseline)
    assert rise == ["portable.c: 1 mypy errors, baseline allows 0 (new errors)"]
    (fall,) = ratchet_failures(Counter({"portable.a": 1, "portable.b": 1}), baseline)
    assert fall.startswith("portable.a: 1 mypy errors, baseline says 2: lower the baseline")


def test_baseline_only_lists_modules_with_errors():
    baseline = load_baseline()
    assert all(isinstance(n, int) and n > 0 for n in baseline.values()), baseline
    assert list(baseline) == sorted(baseline)


def test_mypy_errors_match_the_baseline():
    pytest.importorskip("mypy")
    counts, output = run_mypy()
    failures = ratchet_failures(counts, load_baseline())
    rising = {line.split(":")[0] for line in failures if "(new errors)" in line}
    detail = "\n".join(
        line
        for line in output.splitlines()
        if (m := _ERROR.match(line)) and _module(m["path"]) in rising
    )
    assert not failures, "\n".join(failures) + ("\n\n" + detail if detail else "")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-baseline"]:
        sys.exit("usage: python tests/test_types.py --write-baseline")
    found, _ = run_mypy()
    write_baseline(found)
    print(f"{sum(found.values())} errors in {len(found)} modules -> {BASELINE}")
