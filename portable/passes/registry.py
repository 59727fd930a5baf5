"""The pass registry: built-in passes by name, imported lazily; third-party passes register
through the `portable.passes` entry-point group (the entry point names a `Pass` subclass)."""

from __future__ import annotations

from portable.registry import Registry

from .base import Pass

registry: Registry[type[Pass]] = Registry(
    "pass",
    "portable.passes",
    {
        "dce": "portable.passes.dce:DeadCodeElimination",
        "canonicalize": "portable.passes.canonicalize:Canonicalize",
        "comm-overlap": "portable.passes.comm_overlap:CommOverlap",
        "mx-quantize": "portable.passes.mx_quantize:MXQuantize",
        "remat": "portable.passes.remat:Remat",
        "softmax-fusion": "portable.passes.softmax_fusion:SoftmaxFusion",
        "spmd-partition": "portable.passes.spmd_partition:SpmdPartition",
    },
)
