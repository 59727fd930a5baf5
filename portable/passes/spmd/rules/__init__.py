"""Sharding rules: for one op, given its inputs' shardings, the shardings its inputs must have
and the sharding of its result(s), plus any size arguments rewritten to local sizes.

A rule returns a `Decision`; the walker (spmd_partition.py) inserts the collectives that bring
each input to the required sharding. An op without a rule gets `replicate_all`: every input is
gathered and reduced to a full copy, the op runs on global shapes and its result is replicated.
That is always correct, only slower, so rules exist for the ops that carry the big tensors:
pointwise ops, reductions, matmuls, views, norms, attention, softmax, embeddings and losses.

Partial values (a sum still to be taken across an axis) pass through ops that are linear in
them (`neg`, `mul` by a replicated value, `add` of two partial sums, `sum`, matmul with one partial
operand), and are reduced before anything else.
"""

from . import layout, linalg, nn, pointwise  # noqa: F401  (register their rules)
from .base import RULES, Decision, RuleContext, replicate_all

__all__ = ["RULES", "Decision", "RuleContext", "replicate_all"]
