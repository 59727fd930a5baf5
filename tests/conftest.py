"""Shared fixtures: the example models (tests/support/examples.py) and small Hugging Face models."""

from __future__ import annotations

import os

# The cuda backend's Triton kernels are tested on CPU tensors in Triton's interpreter, which
# Triton selects when it is imported (torch.export imports it), so it is set before anything
# runs. Ahead-of-time compilation then happens in a clean subprocess (backends/cuda/aot.py).
os.environ.setdefault("TRITON_INTERPRET", "1")
# Per-rank programs run on several XLA host devices (shard_map); XLA reads this when JAX first
# initializes its CPU backend. Single-device programs still run on device 0.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import pytest
import torch

from tests.support import load_spec

# Under pytest-xdist every worker shares the cores with the others (CI: 2 workers on 2 cores).
# torch's intra-op pool defaults to one thread per core, so each worker's pool would compete with
# the other workers and spin on cores they hold: give each worker its share of the cores. Only
# this process's torch threads change; job ranks and other subprocesses keep their own settings.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (_CORES or 1) // _WORKERS))


@pytest.fixture
def example_spec():
    """`example_spec("gpt")` -> the ModelSpec of examples/gpt.py:GPT."""
    return load_spec


# Hugging Face models built from small configs (no downloads), shared by the HF, xla and scale
# tests. Overrides replace config fields: hf_model("gpt2", n_layer=12, n_embd=768, ...).
HF_VOCAB = 128
_HF_COMMON = {"vocab_size": HF_VOCAB, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
_LLAMA_SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention
    "max_position_embeddings": 64,
    "use_cache": False,
}
HF_CONFIGS = {
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(
            n_layer=2,
            n_embd=64,
            n_head=4,
            n_positions=64,
            attn_pdrop=0.0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            use_cache=False,
        ),
    ),
    "llama": ("LlamaConfig", "LlamaForCausalLM", _LLAMA_SIZES),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _LLAMA_SIZES),  # + biases on q/k/v
    # a sliding window shorter than the tests' sequences: the mask is more than causal
    "mistral": ("MistralConfig", "MistralForCausalLM", {**_LLAMA_SIZES, "sliding_window": 8}),
    "bert": (
        "BertConfig",
        "BertForMaskedLM",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=64,
            attention_probs_dropout_prob=0.0,
            hidden_dropout_prob=0.0,
        ),
    ),
    # encoder-decoder with a relative position bias (a trained attention mask); one layer each
    "t5": (
        "T5Config",
        "T5ForConditionalGeneration",
        dict(
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=1,
            num_decoder_layers=1,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            use_cache=False,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {
            **_LLAMA_SIZES,
            "num_hidden_layers": 1,  # one MoE block: capture time grows with depth
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "router_jitter_noise": 0.0,
            "attention_dropout": 0.0,
            # static-shape dispatch (gather each token's expert weights); the default grouped
            # form sorts tokens by expert, which has data-dependent sizes
            "experts_implementation": "batched_mm",
        },
    ),
}


@pytest.fixture
def hf_model():
    """`hf_model("llama", **overrides)` -> a small Hugging Face model (skips without transformers)."""
    transformers = pytest.importorskip("transformers")

    def build(name: str, **overrides):
        config, model, sizes = HF_CONFIGS[name]
        cfg = getattr(transformers, config)(**{**_HF_COMMON, **sizes, **overrides})
        return getattr(transformers, model)(cfg)

    return build
