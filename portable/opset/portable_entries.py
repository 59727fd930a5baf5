"""The opset entries of the `portable::` ops: attention, the norms and softmax, MX quantize and
dequantize, and the collectives. Their definitions (CPU kernel, fake kernel, autograd) are in
nn_ops.py, mx_ops.py and collectives.py; `table.opset_table()` joins these entries with the
ATen ones."""

from __future__ import annotations

from .entry import ANY, FLOAT, NUMERIC, UINT8, OpDef, entry

PORTABLE: tuple[OpDef, ...] = (
    entry(
        "portable.attention.default",
        FLOAT,
        "same",
        "softmax(q @ k^T * scale + mask) @ v; bool mask keeps True, causal is top-left, kv heads "
        "repeat for GQA; laid out as SDPA lays it out on CPU",
    ),
    entry(
        "portable.attention_backward.default",
        FLOAT,
        "tuple",
        "(dq, dk, dv) of attention, recomputing the probabilities",
    ),
    entry(
        "portable.attention_backward.mask_grad",
        FLOAT,
        "tuple",
        "(dq, dk, dv, dmask) of attention with a trainable float mask; dmask summed to its shape",
    ),
    entry(
        "portable.scale_mask_softmax.default",
        FLOAT,
        "same",
        "softmax(x * scale + mask) along dim in float32; bool mask keeps True",
    ),
    entry(
        "portable.rms_norm.default",
        FLOAT,
        "norm",
        "x * rsqrt(mean(x^2) + eps) * weight over the normalized dims",
    ),
    entry(
        "portable.rms_norm_backward.default",
        FLOAT,
        "tuple",
        "(dx, dweight) of rms_norm (dweight zeros without weight)",
    ),
    entry(
        "portable.layer_norm.default",
        FLOAT,
        "norm",
        "(x - mean) * rsqrt(var + eps) * weight + bias over the normalized dims",
    ),
    entry(
        "portable.mx_quantize.default",
        FLOAT,
        "mx",
        "OCP MX block quantization: (element codes, E8M0 scale bytes)",
    ),
    entry("portable.mx_dequantize.default", UINT8, "mx", "codes * 2^(scale - 127) in dtype"),
    entry(
        "portable.all_reduce.default",
        NUMERIC,
        "collective",
        "reduce across the axis's group; every rank gets the result",
    ),
    entry(
        "portable.all_gather.default",
        ANY,
        "collective",
        "concatenate every rank's tensor along dim",
    ),
    entry(
        "portable.reduce_scatter.default",
        NUMERIC,
        "collective",
        "reduce across the group, each rank keeps its slice along dim",
    ),
    entry(
        "portable.all_to_all.default",
        ANY,
        "collective",
        "split along split_dim, exchange, concatenate along concat_dim",
    ),
    entry(
        "portable.local_shard.default",
        ANY,
        "collective",
        "this rank's chunk along dim of a value replicated over the axis (no communication)",
    ),
    entry(
        "portable.wait.default", ANY, "same", "the completed value of an asynchronous collective"
    ),
)
