"""The model benchmarks/train_job.py trains: the GPT example (examples/gpt.py) scaled so a step
takes tens of milliseconds on one CPU thread and its state (parameters and AdamW's two moments)
is tens of MB, over the byte vocabulary of `portable data tokenize --tokenizer bytes`.

    portable train benchmarks/train_job_model.py:GPTBench --data tokens.bin --steps 40 --out RUN

`GPTBench` is 4 layers x 256 wide (3.3 M parameters, 37 MiB of float32 state with
AdamW), batch 4 x 32 by default (`--batch`/`--seq` change it, up to 128 tokens);
`GPTBenchSmall` is the smoke test's size.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from portable.capture.decorator import portable
from portable.optim import AdamW

VOCAB = 256  # bytes
BATCH, SEQ = 4, 32
BLOCK = 128  # longest sequence: --seq up to this


def _gpt() -> ModuleType:
    """examples/gpt.py, loaded by path (the repository root need not be on sys.path)."""
    name = "_train_job_gpt"
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parents[1] / "examples" / "gpt.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _loss(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())


def _batch(batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, VOCAB, (batch, seq)), torch.randint(0, VOCAB, (batch, seq))


def _model(layers: int, width: int, block: int) -> torch.nn.Module:
    gpt = _gpt()
    config = gpt.GPTConfig(
        vocab_size=VOCAB, block_size=block, n_layer=layers, n_head=4, n_embd=width
    )
    torch.manual_seed(0)
    return gpt.GPT(config)


@portable(
    example_inputs=lambda: (_batch(BATCH, SEQ)[0],),
    loss_fn=_loss,
    example_batch=lambda: _batch(BATCH, SEQ),
    optimizer=AdamW(lr=1e-3),
)
def GPTBench() -> torch.nn.Module:  # noqa: N802 - a model name, as the CLI spells it
    return _model(4, 256, BLOCK)


@portable(
    example_inputs=lambda: (_batch(2, 16)[0],),
    loss_fn=_loss,
    example_batch=lambda: _batch(2, 16),
    optimizer=AdamW(lr=1e-3),
)
def GPTBenchSmall() -> torch.nn.Module:  # noqa: N802
    return _model(1, 32, 16)
