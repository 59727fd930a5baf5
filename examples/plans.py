"""Plans for the examples, as `portable train --plan examples/plans.py:NAME` names them.

Each is a zero-argument function returning a `portable.Plan` over two ranks (or four for the
2 x 2 ones): data parallel, tensor parallel (Megatron's column/row split of attention and MLP),
FSDP (parameters, gradients and optimizer state sharded over dp), and both; and a two-stage
pipeline (`pp2`).
"""

from __future__ import annotations

from portable import Mesh, Pipeline, Plan
from portable import parallel as par


def _gpt_tp_rules() -> list:
    return [
        *par.column_parallel(r"blocks\.\d+\.attn\.qkv"),
        *par.row_parallel(r"blocks\.\d+\.attn\.proj"),
        *par.column_parallel(r"blocks\.\d+\.mlp\.fc"),
        *par.row_parallel(r"blocks\.\d+\.mlp\.proj"),
    ]


def _llama_tp_rules() -> list:
    # Hugging Face Llama module paths (examples/hf_llama.py: 4 heads, 2 key/value heads)
    return [
        *par.head_parallel(r"model\.layers\.\d+\.self_attn", heads=4, kv_heads=2, axis_size=2),
        *par.column_parallel(r"model\.layers\.\d+\.mlp\.(gate|up)_proj", bias=False),
        *par.row_parallel(r"model\.layers\.\d+\.mlp\.down_proj"),
    ]


def dp2() -> Plan:
    return Plan(Mesh({"dp": 2}), batch_axes=("dp",))


def fsdp2() -> Plan:
    return Plan(Mesh({"dp": 2}), batch_axes=("dp",), fsdp_axis="dp")


def gpt_tp2() -> Plan:
    return Plan(Mesh({"tp": 2}), rules=_gpt_tp_rules())


def gpt_dp2_tp2() -> Plan:
    return Plan(Mesh({"dp": 2, "tp": 2}), rules=_gpt_tp_rules(), batch_axes=("dp",))


def llama_tp2() -> Plan:
    return Plan(Mesh({"tp": 2}), rules=_llama_tp_rules())


def pp2() -> Plan:
    """Two pipeline stages (the layers balanced by counted FLOPs), 1F1B over two micro-batches:
    the examples' batches have two rows."""
    return Plan(Mesh({"pp": 2}), pipeline=Pipeline(axis="pp", schedule="1f1b", microbatches=2))
