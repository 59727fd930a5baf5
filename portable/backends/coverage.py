"""The coverage table of docs/opset.md: every opset op x every built-in backend x the dtypes the
op declares, from the backends' own claims (`Capabilities.ops`, `dtype_gaps`), with the reason
for every cell a backend does not take.

    python -m portable.backends.coverage > docs/opset.md

writes the whole reference (the opset table's part, `portable.opset.docs.render`, then this);
tests/test_opset.py checks the committed file against `reference()`.
"""

from __future__ import annotations

from portable.opset import opset_table
from portable.opset.docs import render as render_opset
from portable.opset.table import OpDef

from .builtins import get_backend

__all__ = ["BACKENDS", "DTYPES", "reference", "render"]

BACKENDS = ("cpu", "xla", "neuron", "cuda", "onnx")
DTYPES = ("float32", "bfloat16", "int64", "bool")
_SHORT = {"float32": "f32", "bfloat16": "bf16", "int64": "i64", "bool": "bool"}


def _declared(entry: OpDef) -> list[str]:
    import torch

    return [d for d in DTYPES if entry.accepts(getattr(torch, d))]


def render() -> str:
    """The coverage section: a row per op, a cell per backend listing the dtypes it takes."""
    caps = {name: get_backend(name).capabilities() for name in BACKENDS}
    lines = [
        "",
        "## Coverage by backend and dtype",
        "",
        "Generated from each backend's `Capabilities` (`ops`, `dtype_gaps`). A cell lists the",
        "dtypes (of those the op declares, among float32, bfloat16, int64, bool) the backend takes",
        "the op on; `no rule` means the backend refuses the op, with a typed error naming the",
        "backends that take it; a mark refers to the reasons below the table. `onnx` takes",
        "inference programs only, so it has no backward ops. How each cell is tested, and the",
        "OpInfo sweep's figures (capture, each backend against `cpu`, training steps): docs/testing.md,",
        '"The OpInfo conformance sweep".',
        "",
        "| op | " + " | ".join(BACKENDS) + " |",
        "|---|" + "---|" * len(BACKENDS),
    ]
    reasons: list[str] = []
    for name, entry in sorted(opset_table().items()):
        if entry.shape == "scalar":  # a size, not a tensor
            lines.append(f"| `{name}` | " + " | ".join(["sizes"] * len(BACKENDS)) + " |")
            continue
        declared = _declared(entry)
        cells = []
        for backend in BACKENDS:
            cap = caps[backend]
            if not cap.supports_op(name):
                cells.append("no rule")
                continue
            taken, gaps = [], []
            for dtype in declared:
                gap = cap.dtype_gap(name, [dtype])
                if gap is None:
                    taken.append(_SHORT[dtype])
                else:
                    reasons.append(f"{backend}, `{name}`, {dtype}: {gap[1]}")
                    gaps.append(f"{_SHORT[dtype]}[{len(reasons)}]")
            cells.append(" ".join(taken + [f"~~{g}~~" for g in gaps]) or "—")
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    if reasons:
        lines += ["", "Reasons:", ""] + [f"{i}. {r}" for i, r in enumerate(reasons, 1)]
    return "\n".join(lines) + "\n"


def reference() -> str:
    """docs/opset.md: the opset table, then the coverage table."""
    return render_opset() + render()


if __name__ == "__main__":
    print(reference(), end="")
