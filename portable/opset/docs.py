"""Render the opset table's part of the opset reference (docs/opset.md); the backends' coverage
table follows it (`portable.backends.coverage`, whose `python -m` writes the whole file:

    python -m portable.backends.coverage > docs/opset.md

A test checks the committed file, so the reference cannot drift."""

from __future__ import annotations

from .table import OPSET_VERSION, SHAPE_RULES, opset_table


def render() -> str:
    table = opset_table()
    lines = [
        f"# Portable opset {OPSET_VERSION}",
        "",
        "Generated from `portable/opset/table.py` and the backends' capabilities by "
        "`python -m portable.backends.coverage`; do not edit.",
        "",
        "Every node of a portable program calls one of these ops. `dtypes` is the input dtype class",
        "the op accepts (`float`: float16/bfloat16/float32/float64; `numeric`: any but bool;",
        "`integer`: integers, not bool; `any`; `uint8`). The shape rule is evaluated by the verifier",
        "with the op's fake kernel.",
        "",
        "## Shape rules",
        "",
        "| rule | meaning |",
        "|---|---|",
    ]
    lines += [f"| `{name}` | {text} |" for name, text in SHAPE_RULES.items()]
    for namespace, title in (
        ("portable", "portable ops"),
        ("aten", "core ATen ops"),
        ("sym", "size arithmetic"),
    ):
        entries = [e for e in table.values() if e.namespace == namespace]
        lines += [
            "",
            f"## {title} ({len(entries)})",
            "",
            "| op | dtypes | shape | semantics | signature |",
            "|---|---|---|---|---|",
        ]
        for e in sorted(entries, key=lambda e: e.name):
            signature = e.signature.replace("|", "\\|")
            lines.append(f"| `{e.name}` | {e.dtypes} | {e.shape} | {e.semantics} | `{signature}` |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
