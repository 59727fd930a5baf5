"""Per-rank programs on torch.distributed: real processes, gloo on CPU, NCCL on GPUs.

- `TorchCollectives`: the portable collective ops on process groups (one per mesh axis group).
- `launch(...)`: start N workers with torch's launcher on localhost (`portable run` uses it).
- `python -m portable.distributed.worker --program DIR`: one rank (torchrun starts it).
"""

from __future__ import annotations

from .runtime import TorchCollectives

__all__ = ["TorchCollectives"]
