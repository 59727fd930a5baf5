"""Models and capture arguments as people write them: what capture refuses (typed, with the
fix) and what it must take with eager's numbers (issue 13, items 11-13 and 17)."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import portable

from .base import OK, Scenario, cli_outcome, refused, wrong

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))


class _TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _train(model, optimizer, loss_fn=None, batch=None) -> portable.Program:
    batch = batch or (torch.randn(2, 4), torch.randn(2, 3))
    loss_fn = loss_fn or (lambda m, a, b: F.mse_loss(m(a), b))
    return portable.capture(model, batch, loss_fn=loss_fn, optimizer=optimizer)


def _capture(model_fn: Callable[[], nn.Module], *inputs, must_say: str = ""):
    return lambda tmp: refused(lambda: portable.capture(model_fn(), inputs), must_say)


def _equal_to_eager(model: nn.Module, inputs: tuple) -> str:
    program = portable.capture(model, inputs)
    got = portable.compile(program)(*inputs)
    with torch.no_grad():
        want = model(*inputs)
    want = want.logits if hasattr(want, "logits") else want
    return OK if torch.equal(got, want) else wrong(f"max abs {(got - want).abs().max():.3g}")


def factory_raises(tmp: Path) -> str:
    @portable(example_inputs=lambda: (torch.randn(2, 4),))
    def bad():
        raise ValueError("boom")

    return refused(lambda: portable.capture_spec(bad), "boom")


def cli_factory_raises(tmp: Path) -> str:
    path = tmp / "m.py"
    path.write_text(
        textwrap.dedent(
            """
            import torch, portable
            @portable(example_inputs=lambda: (torch.randn(2, 4),))
            def model():
                return torch.nn.Linear(4, 2, nonsense=1)
            """
        )
    )
    return cli_outcome(["lower", f"{path}:model", "-t", "cpu", "--out", str(tmp / "o"), "-q"])


def _sparse_buffer() -> nn.Module:
    model = _TwoLayer()
    model.register_buffer("table", torch.eye(4).to_sparse())
    return model


def _meta() -> nn.Module:
    with torch.device("meta"):
        return _TwoLayer()


def meta_model_is_abstract(tmp: Path) -> str:
    """A `meta`-device model captures as an abstract program (shapes, no weight values, for
    the planner); running it must be refused, typed, naming the fix."""
    program = portable.capture(_meta(), (_x,))
    if not program.abstract:
        return wrong("a meta-device model captured as a concrete program")
    return refused(lambda: portable.compile(program)(_x), "abstract")


def criterion_as_loss_fn(tmp: Path) -> str:
    """`loss_fn=nn.CrossEntropyLoss()` is called as criterion(model(x), y): equal to eager."""
    torch.manual_seed(0)
    model = _TwoLayer()
    batch = (torch.randn(2, 4), torch.randint(0, 3, (2,)))
    step = _train(model, portable.optim.SGD(lr=0.1), loss_fn=nn.CrossEntropyLoss(), batch=batch)
    got = portable.compile(step)(*batch).loss
    want = nn.CrossEntropyLoss()(model(batch[0]), batch[1])
    return OK if torch.allclose(got, want, rtol=1e-6, atol=0) else wrong(f"{got} vs {want}")


def _transformer_decoder() -> nn.Module:
    class Dec(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layer = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            self.dec = nn.TransformerDecoder(layer, 1)

        def forward(self, tgt, memory):
            mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
            return self.dec(tgt, memory, tgt_mask=mask)

    return Dec()


def _optimizer_case(make: Callable[[nn.Module], object], must_say: str = ""):
    def run(tmp: Path) -> str:
        model = _TwoLayer()
        return refused(lambda: _train(model, make(model)), must_say)

    return run


def _lambda_lr(model: nn.Module):
    opt = torch.optim.AdamW(model.parameters())
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    return opt


def _stepped_sgd(model: nn.Module):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    F.mse_loss(model(torch.randn(2, 4)), torch.randn(2, 3)).backward()
    opt.step()
    return opt


def _autocast() -> nn.Module:
    class M(_TwoLayer):
        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return super().forward(x).float()

    return M()


def module_as_decorator(tmp: Path) -> str:
    @portable(example_inputs=lambda: (torch.randn(2, 4),))
    class M(_TwoLayer):
        pass

    program = portable.capture_spec(M)
    return OK if program.kind is portable.ProgramKind.INFERENCE else wrong(str(program))


def hf_moe_default(tmp: Path) -> str:
    from test_real_models import _hf_moe, _ids

    model = _hf_moe("qwen3_moe").eval()
    return refused(lambda: portable.capture(model, (_ids(),)), "batched_mm")


def hf_moe_batched(tmp: Path) -> str:
    from test_real_models import _hf_moe, _ids

    return _equal_to_eager(
        _hf_moe("mixtral", experts_implementation="batched_mm").eval(), (_ids(),)
    )


def deepseek_v3(tmp: Path) -> str:
    from test_real_models import _hf_moe, _ids

    model = _hf_moe("deepseek_v3", experts_implementation="batched_mm").eval()
    return _equal_to_eager(model, (_ids(),))


def titan_llama3(tmp: Path) -> str:
    from test_real_models import TitanLlama3, _ids

    torch.manual_seed(0)
    return _equal_to_eager(TitanLlama3().eval(), (_ids(),))


def _flex(frozen: bool):
    def run(tmp: Path) -> str:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        class Flex(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.wq = nn.Linear(16, 16)

            def forward(self, x):
                mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, 128, 128, "cpu")
                return flex_attention(self.wq(x), x, x, block_mask=mask)

        model = Flex().eval().requires_grad_(not frozen)
        x = torch.randn(1, 2, 128, 16)
        return refused(lambda: portable.capture(model, (x,)), "scaled_dot_product_attention")

    return run


def _complex_exp() -> nn.Module:
    class M(nn.Module):
        def forward(self, x):
            return torch.view_as_real(torch.exp(torch.view_as_complex(x.reshape(4, 2))))

    return M()


def _data_dependent() -> nn.Module:
    class M(nn.Module):
        def forward(self, x):
            return x[x > 0].sum()

    return M()


_x = torch.randn(2, 4)
SCENARIOS = [
    Scenario("@portable factory raises", "capture", factory_raises),
    Scenario("@portable factory raises (CLI)", "capture", cli_factory_raises),
    Scenario("sparse COO input", "capture", _capture(_TwoLayer, _x.to_sparse(), must_say="dense")),
    Scenario("sparse buffer", "capture", _capture(_sparse_buffer, _x, must_say="dense")),
    Scenario("meta-device model, then run", "capture", meta_model_is_abstract),
    Scenario(
        "float16 input into a float32 Linear",
        "capture",
        _capture(_TwoLayer, _x.half(), must_say="fc1"),
    ),
    Scenario("criterion as loss_fn", "capture", criterion_as_loss_fn, expect="works"),
    Scenario(
        "loss_fn that takes (output, target)",
        "capture",
        lambda tmp: refused(
            lambda: _train(_TwoLayer(), portable.optim.SGD(), loss_fn=lambda o, y: F.mse_loss(o, y))
        ),
    ),
    Scenario(
        "nn.TransformerDecoder with a causal tgt_mask",
        "capture",
        lambda tmp: refused(
            lambda: portable.capture(
                _transformer_decoder(), (torch.randn(2, 5, 16), torch.randn(2, 7, 16))
            ),
            "tgt_is_causal=True",
        ),
    ),
    Scenario("torch optimizer with LambdaLR", "capture", _optimizer_case(_lambda_lr, "scheduler")),
    Scenario(
        "LambdaLR passed as the optimizer",
        "capture",
        _optimizer_case(lambda m: torch.optim.lr_scheduler.LambdaLR(_lambda_lr(m), lambda s: 1.0)),
    ),
    Scenario("torch optimizer that already stepped", "capture", _optimizer_case(_stepped_sgd)),
    Scenario(
        "AdamW(maximize=True)",
        "capture",
        _optimizer_case(lambda m: torch.optim.AdamW(m.parameters(), maximize=True), "maximize"),
    ),
    Scenario(
        "optimizer over other parameters",
        "capture",
        _optimizer_case(lambda m: torch.optim.SGD(m.fc2.parameters(), lr=0.1)),
    ),
    Scenario("torch.autocast region", "capture", _capture(_autocast, _x, must_say="autocast")),
    Scenario("import portable; @portable(...)", "capture", module_as_decorator, expect="works"),
    Scenario(
        "capture_spec of an undecorated class",
        "capture",
        lambda tmp: refused(lambda: portable.capture_spec(nn.Linear)),
    ),
    Scenario("data-dependent shape (x[x > 0])", "capture", _capture(_data_dependent, _x)),
    Scenario("complex exp", "capture", _capture(_complex_exp, torch.randn(8), must_say="exp")),
    Scenario("flex attention, trainable", "capture", _flex(frozen=False)),
    Scenario("flex attention, frozen", "capture", _flex(frozen=True)),
    Scenario("HF Qwen3-MoE, default experts", "capture", hf_moe_default, quick=False),
    Scenario("HF Mixtral, batched_mm experts", "capture", hf_moe_batched, "works", quick=False),
    Scenario("HF DeepSeek-V3 (copy_ into slices)", "capture", deepseek_v3, "works", quick=False),
    Scenario("torchtitan Llama 3 complex rotary", "capture", titan_llama3, expect="works"),
]
