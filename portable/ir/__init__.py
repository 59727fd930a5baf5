"""The portable IR: programs, signatures, plans, source locations, printing and serialization."""

from .plan import Mesh, PartitionSpec, Plan, ShardingRule
from .program import Program, ProgramKind
from .signature import InputKind, InputSpec, OutputKind, OutputSpec, Signature, TensorSpec
from .source import SourceLoc
from .spmd import Collective, SpmdLayout, TensorLayout

__all__ = [
    "Collective",
    "InputKind",
    "InputSpec",
    "Mesh",
    "OutputKind",
    "OutputSpec",
    "PartitionSpec",
    "Plan",
    "Program",
    "ProgramKind",
    "ShardingRule",
    "Signature",
    "SourceLoc",
    "SpmdLayout",
    "TensorLayout",
    "TensorSpec",
]
