"""What the tests share: the example models (`examples.py`), the FileCheck-style checker
(`filecheck.py`) and golden-text comparison with its update mode (`golden.py`); the mx-quantize tests' helpers are
in `mx_pass.py` (imported as `tests.support.mx_pass`).

Test modules import it as `tests.support` (pytest runs from the repository root)."""

from __future__ import annotations

from .examples import EXAMPLE_NAMES, EXAMPLES, EXAMPLES_DIR, load_example, load_spec
from .filecheck import filecheck
from .golden import UPDATE_ENV, check_golden, updating

__all__ = [
    "EXAMPLES",
    "EXAMPLES_DIR",
    "EXAMPLE_NAMES",
    "UPDATE_ENV",
    "check_golden",
    "filecheck",
    "load_example",
    "load_spec",
    "updating",
]
