"""Dropout as part of the program: a TorchFunctionMode that draws every mask from the
counter-based generator (`portable.random`) instead of torch's RNG.

While a `CounterDropout(seed, offset)` is active (around a model's forward in train mode: the
export of a training step, or the eager reference of one), each random call the mode sees
becomes `portable.random` arithmetic with the next stream number (`mode.streams` counts them):

    F.dropout, nn.Dropout, torch.dropout                       x * (keep / (1 - p)), as torch
    F.dropout1d / 2d / 3d, torch.feature_dropout               keep per (N, C), torch's shapes
    F.alpha_dropout, F.feature_alpha_dropout, torch.*_alpha_*  torch's affine alpha constants
    F.scaled_dot_product_attention(dropout_p > 0)              torch's math attention with the
                                                               keep mask on the probabilities

Calls that draw nothing (training=False, p == 0, empty input) pass through unchanged and take
no stream. The same mode around an eager forward gives the masks of the captured program, bit
for bit: streams are numbered in call order, which export and eager share.

What the mode cannot see: calls made inside another torch function's Python body (the mode is
suspended while a handler runs), chiefly `F.multi_head_attention_forward` (`nn.MultiheadAttention`),
whose attention dropout is refused here with the fix rather than left to torch's RNG.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import random
from ..errors import CaptureError

__all__ = ["CounterDropout"]

Rule = Callable[["CounterDropout", Any, tuple[Any, ...], dict[str, Any]], Any]


class CounterDropout(TorchFunctionMode):
    """Replaces torch's random dropout by counter-based masks keyed by `(seed, offset)` (int64
    0-d tensors: the program's `rng.seed` / `rng.offset` state) and the call's stream number.

    The key is derived once, at the first random call, from the values `seed` and `offset` hold
    then; `streams` is how many random calls the mode replaced."""

    def __init__(self, seed: torch.Tensor, offset: torch.Tensor) -> None:
        super().__init__()
        self.seed = seed
        self.offset = offset
        self.streams = 0
        self._key: random.Key | None = None

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        rule = _RULES.get(func)
        if rule is None:
            return func(*args, **kwargs)
        return rule(self, func, args, kwargs)

    def draw(self) -> tuple[random.Key, int]:
        """The key and the next stream number."""
        if self._key is None:
            self._key = random.key(self.seed, self.offset)
        stream = self.streams
        self.streams += 1
        return self._key, stream

    def dropout(
        self, x: torch.Tensor, p: float, *, feature: bool = False, alpha: bool = False
    ) -> torch.Tensor:
        key, stream = self.draw()
        return random.apply_dropout(x, p, key, stream, feature=feature, alpha=alpha)


# -------------------------------------------------------------------- the rules
# A rule is rule(mode, func, args, kwargs) -> the call's result.


def _draws(p: float, training: bool, x: torch.Tensor) -> bool:
    """Whether a dropout call draws a mask. Calls that do not (torch returns the input) and
    calls torch refuses (p outside [0, 1]: its own error) go to torch unchanged."""
    return bool(training) and 0.0 < p <= 1.0 and x.numel() != 0


def _result(x: torch.Tensor, out: torch.Tensor, inplace: bool) -> torch.Tensor:
    return x.copy_(out) if inplace else out


def _bound(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A Python torch function's arguments by name, defaults filled."""
    bound = inspect.signature(func).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _vf(*, feature: bool, alpha: bool, inplace: bool) -> Rule:
    """torch.dropout(input, p, train) and its feature / alpha / in-place (`_`) spellings."""

    def rule(mode: CounterDropout, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        names = ("input", "p", "train")
        a = {**dict(zip(names, args, strict=False)), **kwargs}
        x, p = a["input"], a["p"]
        if not _draws(p, a["train"], x):
            return func(*args, **kwargs)
        return _result(x, mode.dropout(x, p, feature=feature, alpha=alpha), inplace)

    return rule


def _functional(
    *, feature: bool = False, alpha: bool = False, batched: int | None = None, strict: bool = False
) -> Rule:
    """F.dropout, F.dropout1d / 2d / 3d, F.alpha_dropout, F.feature_alpha_dropout(input, p,
    training, inplace). Channel (feature) masks are over (N, C), in torch's shapes: `batched` is
    the rank of a batched input, and any other input gets a batch dim of 1 around the draw
    (`strict`: only an input one dim short, others are torch's error: dropout1d); dropout2d
    keeps the input's own leading two dims, as torch does."""

    def rule(mode: CounterDropout, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        a = _bound(func, args, kwargs)
        x, p, inplace = a["input"], a["p"], a["inplace"]
        unbatched = batched is not None and x.dim() != batched
        refused = (feature and x.dim() + unbatched < 2) or (
            strict and unbatched and x.dim() != (batched or 0) - 1
        )
        if not _draws(p, a["training"], x) or refused:
            return func(*args, **kwargs)  # torch's own checks and errors
        out = mode.dropout(x.unsqueeze(0) if unbatched else x, p, feature=feature, alpha=alpha)
        return _result(x, out.squeeze(0) if unbatched else out, inplace)

    return rule


_SDPA = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {
    "attn_mask": None,
    "dropout_p": 0.0,
    "is_causal": False,
    "scale": None,
    "enable_gqa": False,
}


def _sdpa(mode: CounterDropout, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """F.scaled_dot_product_attention with dropout_p > 0: torch's math attention with the keep
    mask of the next stream on the probabilities (`_attention_math`)."""
    a = {**_SDPA_DEFAULTS, **dict(zip(_SDPA, args, strict=False)), **kwargs}
    q, k, p = a["query"], a["key"], a["dropout_p"]
    if not 0.0 < p <= 1.0:
        return func(*args, **kwargs)
    kv_batch = list(k.shape[:-2])
    if a["enable_gqa"] and kv_batch:
        kv_batch[-1] = q.shape[-3]
    batch = torch.broadcast_shapes(tuple(q.shape[:-2]), tuple(kv_batch))
    key, stream = mode.draw()
    keep = random.keep_mask(key, stream, (*batch, q.shape[-2], k.shape[-2]), p)
    return attention_math(
        q, k, a["value"], a["attn_mask"], p, keep, a["is_causal"], a["scale"], a["enable_gqa"]
    )


def attention_math(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    p: float,
    keep: torch.Tensor,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """`aten._scaled_dot_product_attention_math(q, k, v, mask, p, is_causal, dropout_mask=keep,
    scale=scale, enable_gqa=enable_gqa)[0]` op for op (that op warns on stderr that a
    dropout mask is for testing): half types computed in float32, q and k^T each scaled by
    sqrt(|scale|) (q negated for a negative scale), kv heads repeated for GQA, causal = a
    top-left tril, bool masks as 0 / -inf, a fully masked row gives zeros (safe softmax),
    dropped probabilities 0 and v scaled by 1 / (1 - p)."""
    dtype = q.dtype
    if dtype in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    if enable_gqa:
        repeats = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(repeats, -3), v.repeat_interleave(repeats, -3)
    if is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None and mask.dtype == torch.bool:
        zero = torch.zeros((), dtype=q.dtype, device=q.device)
        mask = torch.where(mask, zero, torch.full((), -math.inf, dtype=q.dtype, device=q.device))
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    root = math.sqrt(abs(s))
    scores = (q * (-root if s < 0 else root)) @ (k.transpose(-2, -1) * root)
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, -1)
    masked_row = (scores == -math.inf).all(-1, keepdim=True)
    probs = torch.where(masked_row | ~keep, torch.zeros((), dtype=probs.dtype), probs)
    return (probs @ (v * (1.0 / (1.0 - p)))).to(dtype)


def _multi_head_attention(
    mode: CounterDropout, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """F.multi_head_attention_forward: its dropout runs inside torch's Python body, which the
    mode does not see; refused when it would draw."""
    a = _bound(func, args, kwargs)
    if a["training"] and a["dropout_p"] > 0:
        raise CaptureError(
            f"nn.MultiheadAttention's attention dropout (dropout={a['dropout_p']}) runs inside "
            "torch's F.multi_head_attention_forward, where the counter-based generator cannot "
            "replace torch's random draw",
            op="F.multi_head_attention_forward",
            fix="construct nn.MultiheadAttention with dropout=0.0, or write the attention "
            "with F.scaled_dot_product_attention(..., dropout_p=p), whose dropout is replaced",
        )
    return func(*args, **kwargs)


_VF_SPELLINGS = (
    ("dropout", False, False),
    ("feature_dropout", True, False),
    ("alpha_dropout", False, True),
    ("feature_alpha_dropout", True, True),
)
_RULES: dict[Any, Rule] = {
    F.dropout: _functional(),
    F.dropout1d: _functional(feature=True, batched=3, strict=True),
    F.dropout2d: _functional(feature=True),
    F.dropout3d: _functional(feature=True, batched=5),
    F.alpha_dropout: _functional(alpha=True),
    F.feature_alpha_dropout: _functional(feature=True, alpha=True),
    F.scaled_dot_product_attention: _sdpa,
    F.multi_head_attention_forward: _multi_head_attention,
    **{
        getattr(torch, name + suffix): _vf(feature=feature, alpha=alpha, inplace=bool(suffix))
        for name, feature, alpha in _VF_SPELLINGS
        for suffix in ("", "_")
    },
}
