"""Parallelism plans that do not fit the model, and the stock Hugging Face model that data
parallelism used to break (issue 13, item 15)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

import portable
from portable import Mesh, Plan
from portable import parallel as par

from .base import OK, Scenario, refused, wrong


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 6)

    def forward(self, x):
        return self.fc(x)


def _mlp(batch: int) -> portable.Program:
    return portable.capture(_Mlp(), (torch.randn(batch, 8),))


def _partition(program: portable.Program, plan: Plan):
    from portable.passes.spmd_partition import partition

    return partition(program.replace(plan=plan))


def _partition_twice() -> None:
    from portable.passes.spmd_partition import partition

    per_rank, _ = _partition(_mlp(4), Plan(Mesh({"dp": 2}), batch_axes=("dp",)))
    partition(per_rank)


def hf_llama_data_parallel(tmp: Path) -> str:
    """HF Llama (default SDPA attention) training step, dp=2 on XLA host devices, against the
    single-device program (the causal mask used to keep the global batch)."""
    import transformers

    from portable.backends.xla.spmd import run_spmd

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    batch = (torch.randint(0, 128, (4, 16)), torch.randint(0, 128, (4, 16)))

    def loss(m, idx, targets):
        return F.cross_entropy(m(idx).logits.flatten(0, 1), targets.flatten())

    program = portable.capture(
        model, batch, loss_fn=loss, optimizer=portable.optim.SGD(lr=0.3, momentum=0.9)
    )
    flat = [*(program.weights[i.target] for i in program.signature.state_inputs), *batch]
    want = program.graph_module(*flat)[0]
    per_rank, _ = _partition(program, Plan(Mesh({"dp": 2}), batch_axes=("dp",)))
    got = run_spmd(per_rank, flat, steps=1).losses[0]
    ok = torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    return OK if ok else wrong(f"loss {float(got)} vs {float(want)}")


SCENARIOS = [
    Scenario(
        "HF Llama, dp=2 on XLA devices",
        "plan",
        hf_llama_data_parallel,
        expect="works",
        quick=False,  # tests/test_spmd_hf.py runs it in CI
    ),
    Scenario(
        "head_parallel on a fused qkv",
        "plan",
        lambda tmp: refused(
            lambda: par.head_parallel("h", heads=4, axis_size=2, q="c_attn", k="c_attn", v="c_attn")
        ),
    ),
    Scenario(
        "heads not divisible by tp",
        "plan",
        lambda tmp: refused(lambda: par.head_parallel("attn", heads=8, axis_size=3), "8 % 3 = 2"),
    ),
    Scenario(
        "batch not divisible by dp",
        "plan",
        lambda tmp: refused(
            lambda: _partition(_mlp(3), Plan(Mesh({"dp": 2}), batch_axes=("dp",))), "3 % 2 = 1"
        ),
    ),
    Scenario(
        "tensor dim not divisible by tp",
        "plan",
        lambda tmp: refused(
            lambda: _partition(_mlp(4), Plan(Mesh({"tp": 4}), rules=par.column_parallel("fc"))),
            "6 % 4 = 2",
        ),
    ),
    Scenario(
        "rules naming modules the model lacks",
        "plan",
        lambda tmp: refused(
            lambda: Plan(
                Mesh({"tp": 2}), rules=par.head_parallel("fc", heads=4, axis_size=2)
            ).validate(_mlp(4).tensor_shapes()),
            "matches no tensor",
        ),
    ),
    Scenario(
        "unknown mesh axis",
        "plan",
        lambda tmp: refused(lambda: Plan(Mesh({"dp": 2}), batch_axes=("mp",)), "dp"),
    ),
    Scenario("partitioning twice", "plan", lambda tmp: refused(_partition_twice)),
]
