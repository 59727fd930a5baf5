"""`onnx`: inference programs exported to ONNX and run by ONNX Runtime on CPU.

See docs/backends/onnx.md. onnx, onnxruntime and onnxscript are imported only when the backend
is used (`pip install 'portable[onnx]'`).
"""

from __future__ import annotations

from .backend import OnnxBackend

__all__ = ["OnnxBackend"]
