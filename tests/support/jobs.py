"""What the training-job tests share: a real token file, job runs through the CLI, and how
their records are read and compared.

The token file is docs/parallelism.md as UTF-8 bytes (ASCII: every id < 128, the GPT example's
vocabulary), tokenized by `portable data tokenize`. GPT jobs train on [8, 32] batches.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from typing import Any

from portable.cli.app import main

REPO = Path(__file__).resolve().parents[2]
GPT = f"{REPO / 'examples' / 'gpt.py'}:GPT"
LLAMA = f"{REPO / 'examples' / 'hf_llama.py'}:TinyLlama"
PLANS = REPO / "examples" / "plans.py"
FULL = os.environ.get("PORTABLE_SLOW") == "full"
GPT_SHAPE = ("--batch", "8", "--seq", "32")


def plan(name: str) -> str:
    return f"{PLANS}:{name}"


def tokenize(text: Path, out: Path) -> Path:
    code = main(["data", "tokenize", str(text), "--tokenizer", "bytes", "--out", str(out)])
    assert code == 0
    return out


def cli(*args: str) -> tuple[int, dict[str, Any] | None, str]:
    """Run `portable ARGS --json`: (exit code, the JSON document, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*args, "--json"])
    text = out.getvalue().strip()
    return code, (json.loads(text) if text else None), err.getvalue()


def train(spec: str, data: Path, out: Path, *args: str) -> dict[str, Any]:
    """`portable train` that must succeed; its JSON summary."""
    code, doc, err = cli("train", spec, "--data", str(data), "--out", str(out), *args)
    assert code == 0, err
    assert doc is not None
    return doc


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(run: Path) -> dict[int, float]:
    """step -> loss of a run's metrics.jsonl."""
    return {r["step"]: r["loss"] for r in records(run / "metrics.jsonl")}


def events(run: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in records(run / "events.jsonl") if e["event"] == name]


def worst_relative(ours: dict[int, float], reference: dict[int, float]) -> float:
    """The largest |a - b| / |b| over the steps of `ours` (all of which `reference` has)."""
    assert ours and set(ours) <= set(reference)
    return max(abs(ours[k] - reference[k]) / abs(reference[k]) for k in ours)
