"""Step-time, memory and MFU planning of training programs on accelerator fleets.

    from portable import planner
    est = planner.estimate(
        model=planner.Transformer(layers=48, hidden=6144, heads=64, vocab=51200, seq=2048),
        system=planner.system("a100-80gb", devices=8),
        plan=planner.Parallelism(tp=8, global_batch=4, micro_batch=4,
                                 recompute="selective", sequence_parallel=True),
    )
    est.step_time_s, est.mfu, est.memory_per_device_bytes, est.breakdown

docs/planner.md has the model, its formulas and sources, and the validation.
"""

from .counted import Costs
from .estimate import Breakdown, Estimate, Memory
from .models import costs_of, hf_transformer
from .parallelism import Parallelism
from .search import estimate, search
from .systems import System, system, systems
from .transformer import Transformer

__all__ = [
    "Breakdown",
    "Costs",
    "Estimate",
    "Memory",
    "Parallelism",
    "System",
    "Transformer",
    "costs_of",
    "estimate",
    "hf_transformer",
    "search",
    "system",
    "systems",
]
