"""An opset entry (`OpDef`) and the vocabulary entries are written in: dtype classes, shape
rules and trait names. The entries themselves are in `table.py` (the core families) and
`families/` (one module per later family); `table.opset_table()` joins them."""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Mapping

import torch

# dtype classes
FLOAT = "float"
NUMERIC = "numeric"  # int or float, not bool
ANY = "any"
UINT8 = "uint8"
INTEGER = "integer"  # int, not bool

_FLOAT_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64}

# shape rules, by name (documentation; the verifier evaluates them with the fake kernels)
SHAPE_RULES = {
    "same": "output has the input's shape",
    "broadcast": "output shape is the broadcast of the tensor inputs' shapes",
    "reduce": "reduced dims removed (or kept as 1 with keepdim)",
    "matmul": "[..., m, k] x [..., k, n] -> [..., m, n] with batch broadcast",
    "view": "output shape given by the size/dims argument (element count preserved)",
    "index": "output shape from the index tensor / slice bounds",
    "concat": "inputs joined along dim",
    "creation": "output shape given by the size argument",
    "conv": "spatial dims (in + 2*pad - dilation*(k-1) - 1) // stride + 1",
    "pool": "spatial dims as conv with the pooling window",
    "norm": "output has the input's shape; statistics reduced over normalized dims",
    "tuple": "a tuple of tensors, each by its own rule",
    "collective": (
        "all_gather multiplies dim by group size, reduce_scatter and local_shard divide it, "
        "others keep shape"
    ),
    "mx": "codes: input shape (FP4 halves axis); scales: axis divided by block size, rounded up",
    "scalar": "a symbolic integer (size arithmetic of declared dynamic dims), no tensor",
}

# Size arithmetic on symbolic dims (dynamic shapes) is Python operators on SymInts in torch.fx.
_SYMBOLIC_TARGETS = {
    "sym.add": operator.add,
    "sym.sub": operator.sub,
    "sym.mul": operator.mul,
    "sym.floordiv": operator.floordiv,
    "sym.mod": operator.mod,
}
_SYMBOLIC_NAMES = {target: name for name, target in _SYMBOLIC_TARGETS.items()}


# op traits: groups of ops that passes treat alike, declared once here (see TRAITS below)
RESHAPE = "reshape"  # new shape, same elements in row-major order (view, reshape)
PERMUTE = "permute"  # reorder dims (permute, transpose, t)
UNIT_DIM = "unit-dim"  # insert or remove size-1 dims
VIEW = "view"  # the result aliases its input's storage (CPU kernel, contiguous input)
IDENTITY = "identity"  # the result holds the input's values unchanged (clone, alias)
CAST = "cast"  # the input's values in another dtype
ELEMENTWISE = "elementwise"  # each output element from the same-index input elements
REDUCTION = "reduction"  # combines elements over dims
COLLECTIVE = "collective"  # a value across the ranks of a mesh axis
SHAPE_PRODUCING = "shape-producing"  # a size (SymInt), not a tensor
MATMUL = "matmul"  # a matrix product


@dataclasses.dataclass(frozen=True)
class OpDef:
    name: str
    dtypes: str
    shape: str
    semantics: str
    traits: frozenset[str] = frozenset()

    def has(self, trait: str) -> bool:
        """Whether this op carries `trait` (one of the trait names of this module)."""
        return trait in self.traits

    @property
    def namespace(self) -> str:
        return self.name.split(".", 1)[0]

    @functools.cached_property
    def overload(self):
        """The torch op overload (or, for `sym.*`, the Python operator) this entry names."""
        if self.name in _SYMBOLIC_TARGETS:
            return _SYMBOLIC_TARGETS[self.name]
        ns, op, overload = (self.name.split(".") + ["default"])[:3]
        return getattr(getattr(getattr(torch.ops, ns), op), overload)

    @property
    def signature(self) -> str:
        if self.name in _SYMBOLIC_TARGETS:
            return f"{self.name.split('.')[1]}(SymInt a, SymInt b) -> SymInt"
        return str(self.overload._schema)

    def bad_call(self, n_args: int, kwargs: Mapping[str, object]) -> str | None:
        """Why `n_args` positional arguments and `kwargs` do not fit this op's schema (None
        when they do): every required argument given once, kwargs keys are argument names."""
        if self.name in _SYMBOLIC_TARGETS:
            return None if n_args == 2 and not kwargs else "takes exactly two positional sizes"
        arguments = self.overload._schema.arguments
        positional = [a for a in arguments if not a.kwarg_only]
        if n_args > len(positional):
            return f"has {n_args} positional arguments, its schema at most {len(positional)}"
        names = {a.name for a in arguments}
        for key in kwargs:
            if key not in names:
                return f"has keyword argument {key[:80]!r}, which its schema does not name"
        for i, arg in enumerate(arguments):
            given = (i < n_args and not arg.kwarg_only) + (arg.name in kwargs)
            if given > 1:
                return f"gives argument {arg.name} twice"
            if not given and not arg.has_default_value():
                return f"lacks its required argument {arg.name}"
        return None

    def accepts(self, dtype: torch.dtype) -> bool:
        if self.dtypes == ANY:
            return True
        if self.dtypes == FLOAT:
            return dtype in _FLOAT_DTYPES
        if self.dtypes == UINT8:
            return dtype == torch.uint8
        if self.dtypes == INTEGER:
            return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
        return dtype != torch.bool  # NUMERIC


def entry(name: str, dtypes: str, shape: str, semantics: str) -> OpDef:
    """An opset entry without traits (`table.TRAITS` assigns those)."""
    return OpDef(name, dtypes, shape, semantics)
