"""Cross-backend parity testing for users' own models.

    from portable.testing import assert_parity
    assert_parity(model, (x,), backends=["cpu", "xla"], rtol=1e-5)

With pytest, request the `portable_backend` fixture and choose backends on the command line:
`pytest --portable-backends=cpu,xla` (the plugin is registered through the `pytest11` entry point).
"""

from .parity import ParityReport, ParityRow, assert_parity, check_parity, compare

__all__ = ["ParityReport", "ParityRow", "assert_parity", "check_parity", "compare"]
