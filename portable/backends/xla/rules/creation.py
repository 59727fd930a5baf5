"""Creation ops: full, *_like, empty, arange, scalar_tensor.

Result dtypes come from the node's recorded result (torch's defaults: float32 for float fills,
int64 for integer fills and integer aranges). `layout`, `device`, `pin_memory` and
`memory_format` are placement requests with no meaning inside an XLA computation, so they are
accepted and ignored. `empty*` tensors are always overwritten before use; they lower to zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import RULES
from ._util import out_dtype, out_shape


@RULES.register("aten.full.default")
def full(ctx, size, fill_value, **_placement):
    return jnp.full(tuple(int(s) for s in size), fill_value, out_dtype(ctx))


@RULES.register("aten.full_like.default")
def full_like(ctx, x, fill_value, **_placement):
    return jnp.full(x.shape, fill_value, out_dtype(ctx))


@RULES.register("aten.zeros_like.default")
def zeros_like(ctx, x, **_placement):
    return jnp.zeros(x.shape, out_dtype(ctx))


@RULES.register("aten.ones_like.default")
def ones_like(ctx, x, **_placement):
    return jnp.ones(x.shape, out_dtype(ctx))


@RULES.register("aten.empty.memory_format")
def empty(ctx, size, **_placement):
    return jnp.zeros(tuple(int(s) for s in size), out_dtype(ctx))


@RULES.register("aten.empty_permuted.default")
def empty_permuted(ctx, size, physical_layout, **_placement):
    return empty(ctx, size)  # the dim order is a memory layout; the logical shape is `size`


@RULES.register("aten.arange.start_step")
def arange(ctx, start, end, step=1, **_placement):
    # torch: start + i * step for i < ceil((end - start) / step) (the recorded length); integers
    # exactly, floats in double rounded to the result dtype (here folded to a constant, as shapes
    # are static)
    dtype = out_dtype(ctx)
    (n,) = out_shape(ctx)
    if jnp.issubdtype(dtype, jnp.integer):
        i = jax.lax.iota(dtype, n)
        return jnp.asarray(start, dtype) + i * jnp.asarray(step, dtype)
    return jnp.asarray(start + step * np.arange(n, dtype=np.float64), dtype)


@RULES.register("aten.scalar_tensor.default")
def scalar_tensor(ctx, s, **_placement):
    return jnp.asarray(s, out_dtype(ctx))
