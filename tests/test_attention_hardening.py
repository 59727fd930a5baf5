"""Attention as real models use it (issue 13, items 4 and 5).

- A trainable `attn_mask` (T5's relative position bias, ALiBi, a learned bias) gets its gradient
  through `portable::attention`: `attention_backward.mask_grad` on every backend that runs
  training steps (`cpu`, `xla` plain and blockwise, `neuron` through the same rules, `cuda`'s
  kernel graph); `onnx` refuses training steps. A training step matches eager PyTorch.
- `portable::attention`'s output has the layout SDPA gives on CPU, so the `view`s a traced graph
  takes of it hold: nanoGPT's `sdpa(...).transpose(1, 2).contiguous().view(B, T, C)` and
  `nn.MultiheadAttention`, inference and training step, against eager on `cpu` and `xla`.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import portable
from portable.opset import op_name

ops = torch.ops.portable
MASK_GRAD = "portable.attention_backward.mask_grad"
LR = 0.1
# SGD steps on float32: the fused backward sums in another order than eager autograd
TOL = {"rtol": 1e-5, "atol": 1e-6}


# ---- helpers -----------------------------------------------------------------------------------


def _eager_steps(model, loss_fn, batch, steps):
    """(losses, parameters by name) of `steps` torch.optim.SGD steps on a copy of `model`."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model, *batch)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def _check_training(model, loss_fn, batch, backend="cpu", steps=2, tol=TOL):
    """Capture a training step, run it `steps` times on `backend`, compare with eager."""
    torch.manual_seed(0)
    want_losses, want = _eager_steps(model, loss_fn, batch, steps)
    program = portable.capture(model, batch, loss_fn=loss_fn, optimizer=portable.optim.SGD(lr=LR))
    exe = portable.compile(program, backend=backend)
    for want_loss in want_losses:
        torch.testing.assert_close(exe(*batch).loss, want_loss, **tol)
    tied = program.metadata.get("tied_weights", {})  # dropped name -> the name kept
    for name, value in want.items():
        name = tied.get(name, name)
        torch.testing.assert_close(exe.state[name], value, **tol, msg=name)
    return program


def _check_inference(model, inputs, backend="cpu", tol=TOL):
    model = model.eval()
    program = portable.capture(model, inputs)
    with torch.no_grad():
        want = model(*inputs)
    torch.testing.assert_close(portable.compile(program, backend=backend)(*inputs), want, **tol)
    return program


def _ops(program):
    return [op_name(n.target) for n in program.graph.nodes if n.op == "call_function"]


# ---- item 4: trainable masks -------------------------------------------------------------------


class LearnedBias(nn.Module):
    """Self-attention with a learned additive bias [H, L, L] that the loss also uses directly:
    eager moves the bias by both gradients, a dropped mask gradient moves it by the second only."""

    def __init__(self, dim=16, heads=2, length=6):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.bias = nn.Parameter(torch.randn(heads, length, length) * 0.5)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)
        return y.transpose(1, 2).reshape(b, t, c), self.bias


def _bias_loss(model, x, target):
    y, bias = model(x)
    return F.mse_loss(y, target) + 0.01 * bias.square().sum()


def _bias_batch():
    torch.manual_seed(1)
    return torch.randn(2, 6, 16), torch.randn(2, 6, 16)


def _learned_bias():
    torch.manual_seed(0)
    return LearnedBias()


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_trainable_mask_gets_its_gradient(backend):
    if backend == "xla":
        pytest.importorskip("jax")
    model, batch = _learned_bias(), _bias_batch()
    program = _check_training(model, _bias_loss, batch, backend, steps=3)
    assert MASK_GRAD in _ops(program)


def test_frozen_mask_uses_the_plain_backward():
    model, batch = _learned_bias(), _bias_batch()
    model.bias.requires_grad_(False)
    program = _check_training(model, _bias_loss, batch)
    names = _ops(program)
    assert MASK_GRAD not in names and "portable.attention_backward.default" in names


# mask shape -> what it broadcasts over; each case also with is_causal
MASK_SHAPES = {
    "per-query-key": (6, 7),
    "per-head": (1, 4, 6, 7),
    "per-batch-key": (2, 1, 1, 7),
    "per-query": (2, 4, 6, 1),
    "full": (2, 4, 6, 7),
}


@pytest.mark.parametrize("causal", [False, True], ids=["", "causal"])
@pytest.mark.parametrize("label", list(MASK_SHAPES))
def test_mask_grad_op_is_eager_autograd(label, causal):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 7, 8, dtype=torch.float64) for _ in range(2))  # GQA
    mask = torch.randn(MASK_SHAPES[label], dtype=torch.float64)
    grad = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    got = ops.attention_backward.mask_grad(grad, q, k, v, mask, causal, 0.3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, mask)]
    ops.attention(*leaves, causal, 0.3).backward(grad)
    for g, leaf in zip(got, leaves, strict=True):
        assert g.shape == leaf.shape
        torch.testing.assert_close(g, leaf.grad)
    # the math: dmask is the score gradient summed over the dims the mask broadcasts along
    m = mask.clone().requires_grad_()
    kk, vv = (t.repeat_interleave(2, dim=1) for t in (k, v))
    s = q @ kk.transpose(-2, -1) * 0.3 + m
    if causal:
        s = s.masked_fill(~torch.ones(6, 7, dtype=torch.bool).tril(), float("-inf"))
    (torch.softmax(s, -1) @ vv).backward(grad)
    torch.testing.assert_close(got[3], m.grad)


def test_mask_grad_needs_a_float_mask():
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(RuntimeError, match="float .additive. mask"):
        ops.attention_backward.mask_grad(q, q, q, q, torch.ones(3, 3, dtype=torch.bool))


# a per-query mask is left out: softmax ignores a per-row constant, so its gradient is rounding
# noise around 0
@pytest.mark.parametrize("label", ["per-query-key", "per-head", "per-batch-key", "full"])
def test_xla_blockwise_mask_grad(label):
    """The blockwise backward accumulates dmask tile by tile (small blocks: loops and a shorter
    last block in both directions)."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import numpy as np

    from portable.backends.xla.rules.attention import attention_blockwise_backward

    torch.manual_seed(0)
    q, grad = (torch.randn(2, 4, 37, 8) for _ in range(2))
    k, v = (torch.randn(2, 2, 45, 8) for _ in range(2))
    shape = {**MASK_SHAPES, "per-query-key": (37, 45)}[label]
    mask = torch.randn(tuple(37 if d == 6 else 45 if d == 7 else d for d in shape))
    mask[..., :1, -3:] = float("-inf") if mask.shape[-1] > 1 else 0.0  # masked positions: 0
    want = ops.attention_backward.mask_grad(grad, q, k, v, mask, True, None)
    with jax.enable_x64(True):
        got = attention_blockwise_backward(
            *(jnp.asarray(t.numpy()) for t in (grad, q, k, v, mask)),
            True,
            None,
            block=16,
            mask_grad=True,
        )
    for name, g, w in zip(("dq", "dk", "dv", "dmask"), got, want, strict=True):
        torch.testing.assert_close(torch.from_numpy(np.array(g)), w, **TOL, msg=name)


def test_xla_blockwise_rule_in_a_training_step(monkeypatch):
    """The blockwise rule (keys above BLOCK) in a captured step: its dmask equals cpu's."""
    pytest.importorskip("jax")
    from portable.backends.xla.rules import attention as rules

    monkeypatch.setattr(rules, "BLOCK", 4)  # 6 keys > 4: the blockwise form
    model, batch = _learned_bias(), _bias_batch()
    _check_training(model, _bias_loss, batch, "xla", steps=2)


def _bias_step():
    model, batch = _learned_bias(), _bias_batch()
    program = portable.capture(
        model, batch, loss_fn=_bias_loss, optimizer=portable.optim.SGD(lr=LR)
    )
    assert MASK_GRAD in _ops(program)
    return program, batch


def test_neuron_lowers_a_trainable_mask_step(tmp_path):
    """neuron lowers with the xla rules (checked numerically above); offline validation."""
    pytest.importorskip("jax")
    program, _ = _bias_step()
    portable.lower(program, "neuron:trn3", tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["validation"]["errors"] == 0


def test_cuda_kernel_graph_trainable_mask_matches_cpu():
    pytest.importorskip("triton")
    from portable.backends import Target
    from portable.backends.cuda import CudaBackend, CudaOptions

    program, batch = _bias_step()
    backend = CudaBackend(CudaOptions(device="cpu", torch_compile=False))
    exe = backend.executable(backend.write(backend.lower(program, Target("cuda", "sm_90"))))
    cpu = portable.compile(program)
    for _ in range(2):
        torch.testing.assert_close(exe(*batch).loss, cpu(*batch).loss, **TOL)
    torch.testing.assert_close(exe.state["bias"], cpu.state["bias"], **TOL)


def test_onnx_refuses_the_training_step():
    pytest.importorskip("onnx")
    program, _ = _bias_step()
    with pytest.raises(portable.BackendError, match="training"):
        portable.lower(program, "onnx")


def test_mask_grad_program_survives_save_and_load(tmp_path):
    program, batch = _bias_step()
    program.save(tmp_path / "step.portable")
    loaded = portable.load(tmp_path / "step.portable")
    assert MASK_GRAD in _ops(loaded)
    a, b = portable.compile(program), portable.compile(loaded)
    torch.testing.assert_close(b(*batch).loss, a(*batch).loss, rtol=0, atol=0)
    torch.testing.assert_close(b.state["bias"], a.state["bias"], rtol=0, atol=0)


# ---- item 5: the output layout -----------------------------------------------------------------


def _transposed(b, t, h, d):
    return torch.randn(b, t, h, d).transpose(1, 2)  # [B, H, T, D] viewed from [B, T, H, D]


LAYOUT_CASES = {
    "contiguous": lambda: tuple(torch.randn(2, 3, 5, 8) for _ in range(3)),
    "heads-inner": lambda: tuple(_transposed(2, 5, 3, 8) for _ in range(3)),
    "value-dim-differs": lambda: (
        _transposed(2, 5, 3, 8),
        _transposed(2, 5, 3, 8),
        _transposed(2, 5, 3, 4),
    ),
}


@pytest.mark.parametrize("label", list(LAYOUT_CASES))
def test_attention_layout_is_sdpas(label):
    """CPU kernel, fake kernel and `attention_strides` all give eager SDPA's layout."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from portable.opset.nn_ops import attention_strides

    q, k, v = LAYOUT_CASES[label]()
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True).stride()
    assert ops.attention(q, k, v, None, True, None).stride() == want
    assert attention_strides(q, k, v, None, True) == want
    with FakeTensorMode() as mode:
        fake = ops.attention(*map(mode.from_tensor, (q, k, v)), None, True, None)
    assert fake.stride() == want


def test_cuda_attention_kernel_returns_the_layout():
    """The Triton kernel (mask and causal together) writes a contiguous result and returns it in
    attention's layout, which a graph's later views rely on."""
    pytest.importorskip("triton")
    from portable.backends.cuda.kernels.attention import attention
    from portable.opset.nn_ops import attention_strides

    q, k, v = (_transposed(1, 8, 2, 16) for _ in range(3))
    keep = torch.ones(8, 8, dtype=torch.bool)
    keep[:, 6:] = False
    got = attention(q, k, v, keep, True, None, block_m=16, block_n=16)
    want = ops.attention(q, k, v, keep, True, None)
    assert got.stride() == want.stride() == attention_strides(q, k, v, keep, True)
    torch.testing.assert_close(got, want, **TOL)


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention block, as written there."""

    def __init__(self, n_embd=16, n_head=2):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head

    def forward(self, x):
        B, T, C = x.size()  # noqa: N806 (nanoGPT's names)
        q, k, v = self.c_attn(x).split(C, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MHA(nn.Module):
    def __init__(self, batch_first: bool):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=batch_first)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


def _mse(model, x, target):
    return F.mse_loss(model(x), target)


LAYOUT_MODELS = {
    "nanogpt": lambda: CausalSelfAttention(),
    "mha-batch-first": lambda: MHA(True),
    "mha-seq-first": lambda: MHA(False),
}


@pytest.mark.parametrize("kind", ["inference", "training"])
@pytest.mark.parametrize("backend", ["cpu", "xla"])
@pytest.mark.parametrize("name", list(LAYOUT_MODELS))
def test_attention_then_view(name, backend, kind):
    if backend == "xla":
        pytest.importorskip("jax")
    torch.manual_seed(0)
    model, x = LAYOUT_MODELS[name](), torch.randn(2, 5, 16)
    if kind == "inference":
        _check_inference(model, (x,), backend)
    else:
        _check_training(model, _mse, (x, torch.randn(2, 5, 16)), backend)


def test_mha_training_step_on_the_cuda_kernel_graph():
    """The cuda backend's eager kernel graph (here on CPU, kernels interpreted) also returns
    mse_loss_backward in its fake layout."""
    pytest.importorskip("triton")
    from portable.backends import Target
    from portable.backends.cuda import CudaBackend, CudaOptions

    torch.manual_seed(0)
    batch = (torch.randn(2, 5, 16), torch.randn(2, 5, 16))
    program = portable.capture(MHA(True), batch, loss_fn=_mse, optimizer=portable.optim.SGD(lr=LR))
    backend = CudaBackend(CudaOptions(device="cpu", torch_compile=False))
    exe = backend.executable(backend.write(backend.lower(program, Target("cuda", "sm_90"))))
    torch.testing.assert_close(exe(*batch).loss, portable.compile(program)(*batch).loss, **TOL)


class ViewsRowMajor(nn.Module):
    """A trainable mask makes eager SDPA take its unfused path, whose result is row-major even
    for heads-inner q; this model views that result as [B*H, T, D] directly."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.bias = nn.Parameter(torch.zeros(2, 5, 5))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)
        return y.view(b * 2, t, 8).sum(0)


def test_traced_layout_is_kept_when_sdpa_took_another_path():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    program = _check_training(ViewsRowMajor(), lambda m, x: m(x).square().mean(), (x,))
    assert MASK_GRAD in _ops(program)


def test_fused_attention_keeps_the_matmuls_layout():
    """softmax-fusion of attention whose q is heads-inner: later views of the fused output see
    the row-major layout of the bmm it replaces."""
    from portable.passes import PassManager, get_pass

    class Manual(nn.Module):
        def forward(self, q, k, v):
            s = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8), dim=-1)
            return (s @ v).view(6, 5, 8)

    inputs = tuple(_transposed(2, 5, 3, 8) for _ in range(3))
    program = portable.capture(Manual(), inputs)
    fused, _ = PassManager([get_pass("softmax-fusion")], verify_each=True).run(program)
    assert "portable.attention.default" in _ops(fused)
    torch.testing.assert_close(portable.compile(fused)(*inputs), Manual()(*inputs), **TOL)


# ---- Hugging Face T5: relative position bias through SDPA -----------------------------------


def _t5_loss(model, ids, labels):
    return model(input_ids=ids, labels=labels).loss


def _t5_batch():
    torch.manual_seed(2)
    return torch.randint(2, 128, (2, 8)), torch.randint(2, 128, (2, 6))


@pytest.mark.hf
def test_t5_sdpa_training_step_matches_eager(hf_model):
    """T5's relative position bias (an embedding, trained) reaches SDPA as attn_mask: capture
    used to refuse it as a parameter that does not influence the loss."""
    torch.manual_seed(0)
    model = hf_model("t5", attn_implementation="sdpa")
    assert model.config._attn_implementation == "sdpa"
    program = _check_training(model, _t5_loss, _t5_batch())
    assert _ops(program).count(MASK_GRAD) == 2  # self-attention; cross-attention has no bias
    bias = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert bias in program.parameters()


def test_data_parallel_mask_gradient_sums_over_the_batch():
    """Under data parallelism the bias (broadcast over the batch) gets a partial gradient per
    rank: attention_backward.mask_grad's spmd rule marks it a sum over dp."""
    pytest.importorskip("jax")
    from portable.backends.xla.spmd import run_spmd
    from portable.passes.spmd_partition import partition
    from tests.spmd_cases import assert_matches, reference

    program, batch = _bias_step()
    flat = [*(program.weights[i.target] for i in program.signature.state_inputs), *batch]
    want = reference(program, flat, steps=2)
    plan = portable.Plan(portable.Mesh({"dp": 2}), batch_axes=("dp",))
    per_rank, _ = partition(program.replace(plan=plan))
    result = run_spmd(per_rank, flat, steps=2)
    outputs = {o.name: v for o, v in zip(per_rank.signature.outputs, result.outputs, strict=True)}
    assert_matches("learned-bias", want, result.losses, outputs)
