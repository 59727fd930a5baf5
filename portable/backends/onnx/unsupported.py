"""The opset ops `onnx` does not export, and why: ONNX has no operator for them, or ONNX Runtime
none that computes what torch does. `OnnxBackend.capabilities()` leaves them out, so
`check_program` refuses them before lowering, naming the backends that take them. One dict per
opset family (portable/opset/families/)."""

from __future__ import annotations

__all__ = ["UNSUPPORTED"]

SPECIAL: dict[str, str] = {}
SELECTION: dict[str, str] = {}
SPATIAL: dict[str, str] = {}
LINALG: dict[str, str] = {}

UNSUPPORTED: dict[str, str] = {**SPECIAL, **SELECTION, **SPATIAL, **LINALG}
