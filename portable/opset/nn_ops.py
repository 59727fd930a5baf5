"""`portable::` neural-network ops that must not be decomposed: attention and the norms.

Each op has a real CPU kernel (the reference semantics), a fake kernel (shape/dtype only) and an
autograd formula, so training-step capture records their backward. Attention and rms_norm have
backward ops of their own (`attention_backward` recomputes the probabilities, so backends need
not keep what the forward did not; `attention_backward.mask_grad` also returns the gradient of a
float mask that requires grad: T5's relative position bias, ALiBi, learned biases); their CPU
kernels are eager PyTorch autograd, so the `cpu` backend matches an eager training loop.
layer_norm's backward is ATen's own `native_layer_norm_backward`.

The CPU kernels call the same PyTorch functions eager code calls (`scaled_dot_product_attention`,
`layer_norm`, `rms_norm`), so a captured program is bit-identical to eager on the `cpu` backend.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from .library import define

__all__ = [
    "attention_reference",
    "attention_scores_mask",
    "attention_strides",
    "scale_mask_softmax_reference",
    "with_attention_layout",
]

define(
    "attention(Tensor q, Tensor k, Tensor v, Tensor? mask=None, bool is_causal=False, "
    "float? scale=None) -> Tensor"
)
define(
    "attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor? mask=None, "
    "bool is_causal=False, float? scale=None) -> (Tensor, Tensor, Tensor)"
)
define(
    "attention_backward.mask_grad(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor mask, "
    "bool is_causal=False, float? scale=None) -> (Tensor, Tensor, Tensor, Tensor)"
)
define("scale_mask_softmax(Tensor x, Tensor? mask=None, float scale=1.0, int dim=-1) -> Tensor")
define(
    "rms_norm(Tensor x, SymInt[] normalized_shape, Tensor? weight=None, float? eps=None) -> Tensor"
)
define(
    "rms_norm_backward(Tensor grad, Tensor x, SymInt[] normalized_shape, Tensor? weight=None, "
    "float? eps=None) -> (Tensor, Tensor)"
)
define(
    "layer_norm(Tensor x, SymInt[] normalized_shape, Tensor? weight=None, Tensor? bias=None, "
    "float eps=1e-05) -> Tensor"
)


# --------------------------------------------------------------------------- attention


def attention_scores_mask(
    mask: torch.Tensor | None,
    is_causal: bool,
    lq: int,
    lk: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | None:
    """The additive mask (0 / -inf, or the user's float mask) applied to the scores.

    Boolean masks keep `True` positions (SDPA's convention); causal is top-left aligned."""
    additive = None
    if mask is not None:
        if mask.dtype == torch.bool:
            additive = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(
                ~mask, float("-inf")
            )
        else:
            additive = mask.to(dtype)
    if is_causal:
        keep = torch.ones(lq, lk, dtype=torch.bool, device=device).tril()
        causal = torch.zeros(lq, lk, dtype=dtype, device=device).masked_fill(~keep, float("-inf"))
        additive = causal if additive is None else additive + causal
    return additive


def _expand_kv(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Repeat k/v heads for grouped-query attention (q heads = group * kv heads)."""
    hq, hk = q.shape[-3], t.shape[-3]
    return t if hq == hk else t.repeat_interleave(hq // hk, dim=-3)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """softmax(q @ k^T * scale + mask) @ v in the inputs' dtype, GQA by head repetition."""
    if mask is not None and is_causal:
        combined = attention_scores_mask(mask, True, q.shape[-2], k.shape[-2], q.dtype, q.device)
        return F.scaled_dot_product_attention(
            q, _expand_kv(q, k), _expand_kv(q, v), attn_mask=combined, scale=scale
        )
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=q.shape[-3] != k.shape[-3],
    )


# The output layout. A graph torch.export traced through SDPA may `view` its output in the layout
# SDPA gave there (a `.contiguous()` that was a no-op is not recorded), so attention's output is
# laid out as PyTorch's SDPA lays it out on CPU for inputs with these shapes, strides and dtypes
# (dense; q's dim order when SDPA takes its fused CPU kernel, [..., H, Lq, Dv] row-major
# otherwise). The CPU kernel is that SDPA call; the fake kernel runs it on fake CPU tensors; other
# kernels (cuda) restride their result to `attention_strides`.


# a tensor's shape, strides and dtype
_Layout = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]


def _layout(t: torch.Tensor) -> _Layout:
    return (tuple(t.shape), tuple(t.stride()), t.dtype)


def _on_cpu(layout: _Layout) -> torch.Tensor:
    """A tensor of `layout` on the CPU: a fake one under a fake mode."""
    shape, strides, dtype = layout
    return torch.empty_strided(shape, strides, dtype=dtype, device="cpu")


def _cpu_layout(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
) -> torch.Tensor:
    cpu_q, cpu_k, cpu_v = (_on_cpu(_layout(t)) for t in (q, k, v))
    cpu_mask = None if mask is None else _on_cpu(_layout(mask))
    return attention_reference(cpu_q, cpu_k, cpu_v, cpu_mask, is_causal, scale)


@functools.lru_cache(maxsize=256)
def _strides_of(
    q: _Layout,
    k: _Layout,
    v: _Layout,
    mask: _Layout | None,
    is_causal: bool,
    scale: float | None,
) -> tuple[int, ...]:
    with FakeTensorMode():
        fake_q, fake_k, fake_v = _on_cpu(q), _on_cpu(k), _on_cpu(v)
        fake_mask = None if mask is None else _on_cpu(mask)
        return tuple(_cpu_layout(fake_q, fake_k, fake_v, fake_mask, is_causal, scale).stride())


def attention_strides(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> tuple[int, ...]:
    """The strides of `portable::attention`'s output for these (real or fake) inputs: those of
    PyTorch's SDPA on CPU (see above), computed on fake tensors (nothing is allocated)."""
    if isinstance(q, FakeTensor):  # symbolic sizes stay symbolic in q's own fake mode
        with q.fake_mode:
            return tuple(_cpu_layout(q, k, v, mask, is_causal, scale).stride())
    mask_layout = None if mask is None else _layout(mask)
    return _strides_of(_layout(q), _layout(k), _layout(v), mask_layout, bool(is_causal), scale)


def with_attention_layout(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """`out` (attention's result computed elsewhere) in attention's output layout."""
    strides = attention_strides(q, k, v, mask, is_causal, scale)
    if tuple(out.stride()) == strides:
        return out
    return torch.empty_strided(out.shape, strides, dtype=out.dtype, device=out.device).copy_(out)


@torch.library.register_kernel("portable::attention", "cpu")
def _attention_cpu(q, k, v, mask=None, is_causal=False, scale=None):
    return attention_reference(q, k, v, mask, is_causal, scale)  # SDPA's own layout


@torch.library.register_fake("portable::attention")
def _attention_fake(q, k, v, mask=None, is_causal=False, scale=None):
    shape = (*q.shape[:-1], v.shape[-1])
    return q.new_empty_strided(shape, attention_strides(q, k, v, mask, is_causal, scale))


def _eager_grads(fn, inputs, grad):
    """Gradients of fn(*inputs) by eager autograd: the reference backward is PyTorch's own."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in inputs]
        out = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    return [
        torch.zeros_like(t) if g is None else g.contiguous()
        for t, g in zip(inputs, grads, strict=True)
    ]


@torch.library.register_kernel("portable::attention_backward", ("cpu", "cuda"))
def _attention_backward_cpu(grad, q, k, v, mask=None, is_causal=False, scale=None):
    """(dq, dk, dv) of attention_reference, by eager autograd (grouped kv heads sum back)."""
    return tuple(
        _eager_grads(
            lambda q, k, v: attention_reference(q, k, v, mask, is_causal, scale), (q, k, v), grad
        )
    )


@torch.library.register_fake("portable::attention_backward")
def _attention_backward_fake(grad, q, k, v, mask=None, is_causal=False, scale=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _check_trainable_mask(mask: torch.Tensor) -> None:
    torch._check(
        mask.is_floating_point(),
        lambda: f"attention_backward.mask_grad needs a float (additive) mask, got {mask.dtype}",
    )


@torch.library.register_kernel("portable::attention_backward.mask_grad", ("cpu", "cuda"))
def _attention_backward_mask_grad_cpu(grad, q, k, v, mask, is_causal=False, scale=None):
    """(dq, dk, dv, dmask) of attention_reference by eager autograd; dmask is summed over the
    dims the mask broadcasts along, so it has the mask's shape (and dtype)."""
    _check_trainable_mask(mask)
    return tuple(
        _eager_grads(
            lambda q, k, v, m: attention_reference(q, k, v, m, is_causal, scale),
            (q, k, v, mask),
            grad,
        )
    )


@torch.library.register_fake("portable::attention_backward.mask_grad")
def _attention_backward_mask_grad_fake(grad, q, k, v, mask, is_causal=False, scale=None):
    _check_trainable_mask(mask)
    return (*_attention_backward_fake(grad, q, k, v), mask.new_empty(mask.shape))


def _attention_setup(ctx, inputs, output):
    q, k, v, mask, is_causal, scale = inputs
    ctx.save_for_backward(q, k, v, mask)
    ctx.is_causal, ctx.scale = is_causal, scale


def _attention_grad(ctx, grad):
    # A mask that requires grad (T5's relative position bias, ALiBi, a learned bias) gets
    # d(scores): the mask is added to the scaled scores, so dmask = ds summed to its shape.
    q, k, v, mask = ctx.saved_tensors
    if mask is not None and ctx.needs_input_grad[3:4] == (True,):  # trailing defaults: absent
        dq, dk, dv, dmask = torch.ops.portable.attention_backward.mask_grad(
            grad, q, k, v, mask, ctx.is_causal, ctx.scale
        )
        return dq, dk, dv, dmask, None, None
    dq, dk, dv = torch.ops.portable.attention_backward(
        grad, q, k, v, mask, ctx.is_causal, ctx.scale
    )
    return dq, dk, dv, None, None, None


torch.library.register_autograd(
    "portable::attention", _attention_grad, setup_context=_attention_setup
)


# --------------------------------------------------------------------------- scale-mask-softmax


def scale_mask_softmax_reference(x, mask=None, scale=1.0, dim=-1):
    """softmax(x * scale + mask) along `dim`, computed in float32 (x's dtype when wider), result
    in x's dtype. A bool mask keeps True positions (False -> -inf); a float mask is added after
    scaling. A row with every position masked is NaN, as torch.softmax gives."""
    compute = torch.promote_types(x.dtype, torch.float32)
    s = x.to(compute) * scale
    if mask is not None:
        if mask.dtype == torch.bool:
            s = s.masked_fill(~mask, float("-inf"))
        else:
            s = s + mask.to(compute)
    return torch.softmax(s, dim).to(x.dtype)


@torch.library.register_kernel("portable::scale_mask_softmax", "cpu")
def _scale_mask_softmax_cpu(x, mask=None, scale=1.0, dim=-1):
    return scale_mask_softmax_reference(x, mask, scale, dim).contiguous()


@torch.library.register_fake("portable::scale_mask_softmax")
def _scale_mask_softmax_fake(x, mask=None, scale=1.0, dim=-1):
    if mask is not None:
        torch.broadcast_shapes(x.shape, mask.shape)  # the mask broadcasts to x, never x to it
    return x.new_empty(x.shape)


def _scale_mask_softmax_setup(ctx, inputs, output):
    x, mask, scale, dim = inputs
    ctx.save_for_backward(output)
    ctx.scale, ctx.dim, ctx.x_dtype = scale, dim, x.dtype
    ctx.mask_shape = None if mask is None or mask.dtype == torch.bool else mask.shape


def _scale_mask_softmax_grad(ctx, grad):
    # d softmax(s) = y * (g - sum(g * y)); s = x * scale + mask, so dx = scale * ds, dmask = ds
    (y,) = ctx.saved_tensors
    ds = torch.ops.aten._softmax_backward_data(grad, y, ctx.dim, ctx.x_dtype)
    dmask = None
    if ctx.mask_shape is not None and ctx.needs_input_grad[1]:
        dmask = ds.sum_to_size(ctx.mask_shape)
    return ds * ctx.scale, dmask, None, None


torch.library.register_autograd(
    "portable::scale_mask_softmax",
    _scale_mask_softmax_grad,
    setup_context=_scale_mask_softmax_setup,
)


# --------------------------------------------------------------------------- norms


@torch.library.register_kernel("portable::rms_norm", ("cpu", "cuda"))
def _rms_norm_cpu(x, normalized_shape, weight=None, eps=None):
    return torch.rms_norm(x, normalized_shape, weight, eps).contiguous()


@torch.library.register_kernel("portable::layer_norm", ("cpu", "cuda"))
def _layer_norm_cpu(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    return torch.layer_norm(x, normalized_shape, weight, bias, eps).contiguous()


@torch.library.register_fake("portable::rms_norm")
def _rms_norm_fake(x, normalized_shape, weight=None, eps=None):
    return x.new_empty(x.shape)


@torch.library.register_fake("portable::layer_norm")
def _layer_norm_fake(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    return x.new_empty(x.shape)


def _rms_norm_setup(ctx, inputs, output):
    x, normalized_shape, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.normalized_shape = normalized_shape
    ctx.eps = eps


def _rms_norm_grad(ctx, grad):
    x, weight = ctx.saved_tensors
    dx, dw = torch.ops.portable.rms_norm_backward(grad, x, ctx.normalized_shape, weight, ctx.eps)
    return dx, None, (dw if weight is not None else None), None


@torch.library.register_kernel("portable::rms_norm_backward", ("cpu", "cuda"))
def _rms_norm_backward_cpu(grad, x, normalized_shape, weight=None, eps=None):
    """(dx, dweight) of rms_norm by eager autograd; dweight is zeros when there is no weight."""
    if weight is None:
        (dx,) = _eager_grads(lambda x: torch.rms_norm(x, normalized_shape, None, eps), (x,), grad)
        return dx, x.new_zeros(normalized_shape)
    dx, dw = _eager_grads(
        lambda x, w: torch.rms_norm(x, normalized_shape, w, eps), (x, weight), grad
    )
    return dx, dw


@torch.library.register_fake("portable::rms_norm_backward")
def _rms_norm_backward_fake(grad, x, normalized_shape, weight=None, eps=None):
    return x.new_empty(x.shape), x.new_empty(list(normalized_shape))


torch.library.register_autograd("portable::rms_norm", _rms_norm_grad, setup_context=_rms_norm_setup)


def _layer_norm_setup(ctx, inputs, output):
    x, normalized_shape, weight, bias, eps = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.normalized_shape, ctx.eps = normalized_shape, eps


def _layer_norm_grad(ctx, grad):
    # Recompute mean/rstd with the core op and use ATen's own backward: the same numbers eager
    # autograd produces for layer_norm.
    x, weight, bias = ctx.saved_tensors
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, ctx.normalized_shape, weight, bias, ctx.eps)
    mask = [True, weight is not None, bias is not None]
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(
        grad, x, ctx.normalized_shape, mean, rstd, weight, bias, mask
    )
    return dx, None, dw, db, None


torch.library.register_autograd(
    "portable::layer_norm", _layer_norm_grad, setup_context=_layer_norm_setup
)
