"""CUDA kernels of the portable ops that run as Triton kernels on `cuda`.

The norms, backward ops and collectives have device-generic eager kernels registered in
`portable.opset` for CPU and CUDA. The ops here get Triton kernels on CUDA: this is what a
`.pt2` written by the cuda backend runs on a GPU (importing this module registers them;
`load_pt2` does). `attention` uses SDPA where it covers the call and the Triton online-softmax
kernel where it does not (mask and is_causal together).
"""

from __future__ import annotations

import torch

from portable.opset.nn_ops import attention_reference, with_attention_layout

from . import dispatch
from .lowering import sdpa_covers

__all__: list[str] = []


@torch.library.register_kernel("portable::attention", "cuda")
def _attention_cuda(q, k, v, mask=None, is_causal=False, scale=None):
    covered, _ = sdpa_covers({"mask": mask, "is_causal": is_causal})
    if covered:  # SDPA on CUDA picks its own layout; the graph was traced with attention's
        out = attention_reference(q, k, v, mask, is_causal, scale)
        return with_attention_layout(out, q, k, v, mask, is_causal, scale)
    return dispatch.attention(q, k, v, mask, is_causal, scale)


torch.library.register_kernel("portable::scale_mask_softmax", "cuda", dispatch.scale_mask_softmax)
torch.library.register_kernel("portable::mx_quantize", "cuda", dispatch.mx_quantize)
torch.library.register_kernel("portable::mx_dequantize", "cuda", dispatch.mx_dequantize)
