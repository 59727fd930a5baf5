"""FileCheck-style expectations on printed text (LLVM FileCheck's CHECK, CHECK-NEXT, CHECK-NOT)."""

from __future__ import annotations

import re


def filecheck(text: str, checks: str) -> None:
    """A small FileCheck: `CHECK: s` lines must appear in order (each on a later line than the
    previous match); `CHECK-NOT: s` must not appear between the surrounding CHECK matches;
    `CHECK-NEXT: s` must be on the line right after the previous match. `{{re}}` is a regex,
    the rest of a pattern is literal."""
    lines = text.splitlines()
    pos, pending_not, last = 0, [], -1

    def regex(pattern: str) -> re.Pattern:
        parts = re.split(r"\{\{(.*?)\}\}", pattern)
        return re.compile("".join(p if i % 2 else re.escape(p) for i, p in enumerate(parts)))

    def forbid(pats: list[str], start: int, end: int) -> None:
        for p in pats:
            for line in lines[start:end]:
                assert not regex(p).search(line), f"CHECK-NOT: {p!r} matched {line!r} in:\n{text}"

    for raw in checks.strip().splitlines():
        kind, _, pattern = raw.strip().partition(":")
        pattern = pattern.strip()
        if kind == "CHECK-NOT":
            pending_not.append(pattern)
            continue
        if kind == "CHECK-NEXT":
            assert last >= 0 and last + 1 < len(lines) and regex(pattern).search(lines[last + 1]), (
                f"CHECK-NEXT: {pattern!r} is not on the line after {lines[last]!r} in:\n{text}"
            )
            forbid(pending_not, pos, last + 1)
            pending_not, last, pos = [], last + 1, last + 2
            continue
        assert kind == "CHECK", f"bad check line {raw!r}"
        found = next((i for i in range(pos, len(lines)) if regex(pattern).search(lines[i])), None)
        assert found is not None, f"CHECK: {pattern!r} not found after line {pos} in:\n{text}"
        forbid(pending_not, pos, found)
        pending_not, last, pos = [], found, found + 1
    forbid(pending_not, pos, len(lines))
