"""Mixed precision at capture: `torch.autocast`'s cast policy, applied while the forward is traced.

`Autocast(dtype)` is a TorchFunctionMode entered inside the exported forward (capture's loss
step). Each call of a listed function gets its floating-point tensor arguments cast first, as
`torch.autocast` does at the dispatcher, so the captured graph holds the casts explicitly and
AOT autograd differentiates through them (the backward of a bfloat16 matmul is a bfloat16 matmul,
the gradient of a float32 parameter float32, as in eager). The lists are torch.autocast's for
`device_type="cpu"` (torch.amp documentation, "CPU Ops that can autocast to ..."), the policy the
eager reference on this machine runs; functions are matched at the Python level, where
composite ops (`linear`, `cross_entropy`) are still whole, as autocast sees them:

- lower precision: matmuls, convolutions, attention (`LOWER`): float32 arguments -> `dtype`;
- float32 (`FLOAT32`): losses and precision-sensitive reductions: `dtype` arguments -> float32;
- widest (`PROMOTE`): `cat`/`stack`: all floating arguments -> the widest among them;
- everything else runs in the dtype of its inputs.

A region the model opens with `torch.autocast(..., enabled=False)` (Hugging Face rotary
embeddings force float32 that way) turns the policy off inside it, as in eager; an enabled region
of the model's own is refused by capture (regions.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

__all__ = ["FLOAT32", "LOWER", "PROMOTE", "Autocast", "policy_of"]

LOWER = frozenset(
    {
        "conv1d", "conv2d", "conv3d", "bmm", "mm", "vecdot", "linalg_vecdot", "baddbmm",
        "addmm", "addbmm", "linear", "_convolution", "matmul", "__matmul__", "__rmatmul__",
        "conv_tbc", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "prelu",
        "scaled_dot_product_attention", "_native_multi_head_attention",
    }
)  # fmt: skip
FLOAT32 = frozenset(
    {
        "avg_pool3d", "binary_cross_entropy", "grid_sample", "grid_sampler", "polar", "prod",
        "quantile", "nanquantile", "stft", "cdist", "trace", "view_as_complex", "cholesky",
        "cholesky_inverse", "cholesky_solve", "inverse", "lu_solve", "orgqr", "ormqr",
        "pinverse", "max_pool3d", "max_unpool2d", "max_unpool3d", "adaptive_avg_pool3d",
        "reflection_pad1d", "reflection_pad2d", "replication_pad1d", "replication_pad2d",
        "replication_pad3d", "mse_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
        "hinge_embedding_loss", "poisson_nll_loss", "smooth_l1_loss", "cross_entropy",
        "cross_entropy_loss", "l1_loss", "huber_loss", "margin_ranking_loss", "soft_margin_loss",
        "triplet_margin_loss", "multi_margin_loss", "ctc_loss", "kl_div",
        "multilabel_margin_loss", "binary_cross_entropy_with_logits",
    }
)  # fmt: skip
PROMOTE = frozenset({"stack", "cat", "concat", "concatenate", "index_copy"})

# composites that autocast reaches inside (it casts at the dispatcher, below them): their
# matmuls run in the lower precision, so their arguments are cast as a matmul's
_LOWER_COMPOSITES = frozenset({"einsum", "tensordot", "inner", "chain_matmul", "multi_dot"})


def policy_of(func: Callable[..., Any]) -> str | None:
    """ "lower", "float32", "promote" or None (runs in its inputs' dtype) for a torch function."""
    name = getattr(func, "__name__", "")
    if name in LOWER or name in _LOWER_COMPOSITES:
        return "lower"
    if name in FLOAT32:
        return "float32"
    if name in PROMOTE:
        return "promote"
    return None


class Autocast(TorchFunctionMode):
    """torch.autocast(device_type="cpu", dtype=`dtype`)'s casts, recorded into the traced graph."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self._base_nesting = 0

    def __enter__(self) -> Autocast:
        self._base_nesting = _nesting()
        return super().__enter__()

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        policy = policy_of(func) if self._active() else None
        if policy == "lower":
            args, kwargs = _cast(args, kwargs, lambda t: t.dtype == torch.float32, self.dtype)
        elif policy == "float32":
            args, kwargs = _cast(args, kwargs, lambda t: t.dtype == self.dtype, torch.float32)
        elif policy == "promote":
            floats = [t.dtype for t in _tensors((args, kwargs)) if t.is_floating_point()]
            if len(set(floats)) > 1:
                widest = max(floats, key=lambda d: torch.finfo(d).bits)
                args, kwargs = _cast(args, kwargs, lambda t: t.dtype != widest, widest)
        return func(*args, **kwargs)

    def _active(self) -> bool:
        """False inside a `torch.autocast` region the model itself opened: eager autocast then
        follows that region's settings (capture refuses enabled ones, so it is disabled)."""
        return _nesting() == self._base_nesting


def _nesting() -> int:
    """torch.autocast's nesting depth (each region's __enter__ increments it)."""
    depth = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return depth - 1


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _cast(
    args: Any, kwargs: Any, which: Callable[[torch.Tensor], bool], dtype: torch.dtype
) -> tuple[Any, Any]:
    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and which(value):
            return value.to(dtype)
        return value

    return pytree.tree_map(cast, (args, kwargs))
