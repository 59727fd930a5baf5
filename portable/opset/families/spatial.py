"""Spatial and pairwise ops: grid sampling, antialiased and 3-d resampling, pairwise distances,
bilinear forms, bags of embeddings and the matrix-vector products torch keeps whole."""

from __future__ import annotations

from ..entry import FLOAT, NUMERIC, OpDef, entry

ENTRIES: tuple[OpDef, ...] = (
    # matrix products torch keeps whole (their decompositions round differently from BLAS)
    entry("aten.addmv.default", NUMERIC, "matmul", "beta * self + alpha * (mat @ vec)"),
    entry(
        "aten.addbmm.default",
        NUMERIC,
        "matmul",
        "beta * self + alpha * sum over the batch of batch1[b] @ batch2[b]",
    ),
    entry(
        "aten._trilinear.default",
        NUMERIC,
        "broadcast",
        "i1, i2, i3 unsqueezed at expand1..3, multiplied, summed over sumdim (F.bilinear)",
    ),
    # pairwise distances
    entry("aten.dist.default", FLOAT, "reduce", "p-norm of (self - other) over all elements"),
    entry(
        "aten._cdist_forward.default",
        FLOAT,
        "matmul",
        "[..., r1, m], [..., r2, m] -> [..., r1, r2] p-norm distances of row pairs",
    ),
    entry(
        "aten._cdist_backward.default",
        FLOAT,
        "same",
        "gradient of _cdist_forward with respect to x1, given the distances",
    ),
    entry(
        "aten._pdist_forward.default",
        FLOAT,
        "reduce",
        "[n, m] -> [n * (n - 1) / 2] p-norm distances of rows i < j, row-major",
    ),
    entry(
        "aten._pdist_backward.default",
        FLOAT,
        "same",
        "gradient of _pdist_forward with respect to its input, given the distances",
    ),
    # grid sampling: modes 0 bilinear, 1 nearest, 2 bicubic (2-d only); padding 0 zeros,
    # 1 border, 2 reflection
    entry(
        "aten.grid_sampler_2d.default",
        FLOAT,
        "pool",
        "[N, C, H, W] read at grid [N, Ho, Wo, (x, y)] in [-1, 1]: bilinear, nearest or bicubic",
    ),
    entry(
        "aten.grid_sampler_2d_backward.default",
        FLOAT,
        "tuple",
        "(grad_input, grad_grid) of grid_sampler_2d; grad_grid is 0 for nearest",
    ),
    entry(
        "aten.grid_sampler_3d.default",
        FLOAT,
        "pool",
        "[N, C, D, H, W] read at grid [N, Do, Ho, Wo, (x, y, z)]: trilinear or nearest",
    ),
    entry(
        "aten.grid_sampler_3d_backward.default",
        FLOAT,
        "tuple",
        "(grad_input, grad_grid) of grid_sampler_3d; grad_grid is 0 for nearest",
    ),
    # 3-d adaptive max pooling
    entry(
        "aten.adaptive_max_pool3d.default",
        FLOAT,
        "tuple",
        "(max, argmax d * H * W + h * W + w) over adaptive 3-d windows",
    ),
    entry(
        "aten.adaptive_max_pool3d_backward.default",
        FLOAT,
        "same",
        "route grad to each adaptive 3-d window's argmax",
    ),
    # torch's kernels alone (cpu, cuda): xla, neuron and onnx refuse by capability
    entry(
        "aten._upsample_bilinear2d_aa.default",
        FLOAT,
        "pool",
        "antialiased bilinear resampling of the last two dims (a triangle filter widened by the "
        "downscale factor)",
    ),
    entry(
        "aten._upsample_bilinear2d_aa_backward.default",
        FLOAT,
        "pool",
        "gradient of _upsample_bilinear2d_aa with respect to its input",
    ),
)
TRAITS: dict[str, tuple[str, ...]] = {}
