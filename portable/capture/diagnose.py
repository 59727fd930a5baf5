"""Turn torch.export failures into `CaptureError`s that name the user's line, module and fix."""

from __future__ import annotations

import os
import re
import traceback
from types import TracebackType

import torch

from ..errors import CaptureError

_TORCH_DIR = os.path.dirname(torch.__file__)
_PORTABLE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARY_MARKERS = (os.sep + "site-packages" + os.sep + "torch" + os.sep, "<frozen", "<string>")


def is_user_file(filename: str) -> bool:
    """True for frames in the user's code: not torch, not portable itself."""
    path = os.path.abspath(filename)
    if path.startswith(_TORCH_DIR) or path.startswith(_PORTABLE_DIR):
        return False
    return not any(marker in filename for marker in _LIBRARY_MARKERS)


def user_frame(tb: TracebackType | None) -> traceback.FrameSummary | None:
    """The innermost traceback frame that belongs to user code."""
    frames = [f for f in traceback.extract_tb(tb) if is_user_file(f.filename)]
    return frames[-1] if frames else None


def _location(exc: BaseException) -> str | None:
    frame = None
    cur: BaseException | None = exc
    while cur is not None and frame is None:  # the deepest chained exception with a user frame
        frame = user_frame(cur.__traceback__) or frame
        cur = cur.__cause__ or cur.__context__
    if frame is None:
        return None
    code = f"  `{frame.line.strip()}`" if frame.line else ""
    return f"{frame.filename}:{frame.lineno}{code}"


# (pattern in the torch message, what it means, the fix)
_KNOWN: tuple[tuple[str, str, str], ...] = (
    (
        r"data-dependent|GuardOnDataDependentSymNode|Could not guard on data-dependent",
        "data-dependent control flow: a Python branch or shape depends on tensor values",
        "compute both branches and select with torch.where, or use torch.cond; avoid .item(), "
        "bool(tensor) and value-dependent shapes in forward",
    ),
    (
        r"DynamicOutputShapeException|dynamic output shape|nonzero|masked_select",
        "an op whose output shape depends on tensor values (e.g. nonzero, boolean indexing)",
        "keep shapes static: use a mask with torch.where, or a fixed-size top-k / scatter",
    ),
    (
        r"Unsupported: .*(cache|Cache)|DynamicCache|StaticCache",
        "a key/value cache object flows through the model",
        "capture without caches: call the model with use_cache=False",
    ),
    (
        r"did not receive a gradient",
        "a trainable parameter does not influence the loss",
        "freeze it (param.requires_grad_(False)) or remove it from the model",
    ),
    (
        r"not a (registered )?pytree|is not a supported output|Unsupported output type",
        "the model returns a value that is not a tensor (or a nest of tensors)",
        "return tensors only (tuples, lists and dicts of tensors are fine)",
    ),
)


def diagnose(exc: BaseException, *, phase: str, module: str | None = None) -> CaptureError:
    """A CaptureError for an exception raised while capturing; keeps the original as __cause__."""
    message = f"{type(exc).__name__}: {exc}"
    what, fix = f"capture failed while {phase}", "see the original error above"
    for pattern, meaning, remedy in _KNOWN:
        if re.search(pattern, message):
            what, fix = meaning, remedy
            break
    op = _op_in(message)
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return CaptureError(
        what,
        op=op,
        module=module,
        source=_location(exc),
        fix=fix,
        details=f"torch said: {type(exc).__name__}: {first_line[:300]}",
    )


def _op_in(message: str) -> str | None:
    match = re.search(r"\b(aten\.[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)?)", message)
    return match.group(1) if match else None
