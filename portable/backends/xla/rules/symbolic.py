"""Size arithmetic: `aten.sym_size.int` and the `sym.*` operators.

XLA compiles static shapes, so these fold to Python ints at trace time (a program with declared
dynamic dims is refused before tracing, with the fix: one program per shape bucket).
"""

from __future__ import annotations

import operator

from . import RULES
from ._util import norm_dim


@RULES.register("aten.sym_size.int")
def sym_size(ctx, x, dim):
    return int(x.shape[norm_dim(dim, x.ndim)])


def _sym(fn):
    def rule(ctx, a, b):
        return fn(int(a), int(b))

    return rule


for _name, _fn in {
    "sym.add": operator.add,
    "sym.sub": operator.sub,
    "sym.mul": operator.mul,
    "sym.floordiv": operator.floordiv,
    "sym.mod": operator.mod,
}.items():
    RULES.register(_name)(_sym(_fn))
