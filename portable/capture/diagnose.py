"""Turn torch.export failures into `CaptureError`s that name the user's line, module and fix."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import sys
import traceback
from collections.abc import Iterator
from types import TracebackType

import torch

from ..errors import CaptureError
from .known_constructs import FLEX_ATTENTION_FIX, FLEX_ATTENTION_MEANING

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


@dataclasses.dataclass(frozen=True)
class Remedy:
    """A known cause of a torch.export failure: what it means and the fix.

    It applies when `message` matches "Type: message" of the error (or of one it chains), and,
    when `frame` is set, some traceback frame's "file:function" matches `frame` (a remedy for
    one library function, e.g. nn.Transformer's causal-mask detection). Frame remedies are
    tried first: they are more specific than any message."""

    meaning: str
    fix: str
    message: str = ""
    frame: str | None = None


# Remedies for common failures of torch.export, tried in order (frame remedies first).
REMEDIES: tuple[Remedy, ...] = (
    Remedy(
        # on CPU torch.export fails inside flex_attention when an input needs a gradient
        frame=r"torch/nn/attention/flex_attention\.py:",
        meaning=FLEX_ATTENTION_MEANING,
        fix=FLEX_ATTENTION_FIX,
    ),
    Remedy(
        frame=r"torch/nn/modules/transformer\.py:_detect_is_causal_mask",
        meaning="nn.Transformer* compares the mask's values with a causal mask to detect "
        "causality, which torch.export cannot trace",
        fix="say it instead of letting PyTorch detect it: pass tgt_is_causal=True with tgt_mask "
        "to nn.TransformerDecoder / nn.Transformer (is_causal=True with mask for "
        "nn.TransformerEncoder), or pass no mask when attention is not causal",
    ),
    Remedy(
        message=r"data-dependent|GuardOnDataDependentSymNode|Could not guard on data-dependent",
        meaning="data-dependent control flow: a Python branch or shape depends on tensor values",
        fix="compute both branches and select with torch.where, or use torch.cond; avoid "
        ".item(), bool(tensor) and value-dependent shapes in forward",
    ),
    Remedy(
        message=r"DynamicOutputShapeException|dynamic output shape|nonzero|masked_select",
        meaning="an op whose output shape depends on tensor values (e.g. nonzero, boolean "
        "indexing)",
        fix="keep shapes static: use a mask with torch.where, or a fixed-size top-k / scatter",
    ),
    Remedy(
        message=r"Unsupported: .*(cache|Cache)|DynamicCache|StaticCache",
        meaning="a key/value cache object flows through the model",
        fix="capture without caches: call the model with use_cache=False",
    ),
    Remedy(
        message=r"did not receive a gradient",
        meaning="a trainable parameter does not influence the loss",
        fix="freeze it (param.requires_grad_(False)) or remove it from the model",
    ),
    Remedy(
        message=r"not a (registered )?pytree|is not a supported output|Unsupported output type",
        meaning="the model returns a value that is not a tensor (or a nest of tensors)",
        fix="return tensors only (tuples, lists and dicts of tensors are fine)",
    ),
    Remedy(
        message=r"TypeError: .*forward\(\) (takes|got|missing)",
        meaning="the model's forward does not take the example inputs it was called with",
        fix="pass example_inputs (a tuple of positional arguments) and kwargs={...} that match "
        "forward's signature",
    ),
    Remedy(
        message=r"\.numpy\(\)|\.tolist\(\)|from_numpy",
        meaning="forward converts tensors to NumPy or Python values, which a graph cannot hold",
        fix="keep values as torch tensors inside forward (do NumPy work before or after it)",
    ),
)

_UNKNOWN_FIX = (
    "torch.export cannot trace the line shown: rewrite it with plain tensor operations (no "
    "Python-side data, value-dependent branches or unsupported library calls); torch's error "
    "is chained as this error's cause (the CLI prints its traceback with --debug)"
)


def diagnose(exc: BaseException, *, phase: str, module: str | None = None) -> CaptureError:
    """A CaptureError for an exception raised while capturing; keeps the original as __cause__."""
    remedy = known_remedy(exc)
    what = remedy.meaning if remedy else f"capture failed while {phase}"
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return CaptureError(
        what,
        op=_op_in(f"{type(exc).__name__}: {exc}"),
        module=module,
        source=_location(exc),
        fix=remedy.fix if remedy else _UNKNOWN_FIX,
        details=f"torch said: {type(exc).__name__}: {first_line[:300]}",
    )


def known_remedy(exc: BaseException) -> Remedy | None:
    """The first remedy of `REMEDIES` that applies to `exc` or an exception it chains."""
    chain = list(_chain(exc))
    messages = [f"{type(e).__name__}: {e}" for e in chain]
    frames = [
        f"{f.filename}:{f.name}".replace(os.sep, "/")
        for e in chain
        for f in traceback.extract_tb(e.__traceback__)
    ]
    for remedy in sorted(REMEDIES, key=lambda r: r.frame is None):
        if remedy.frame is not None and not any(re.search(remedy.frame, f) for f in frames):
            continue
        if any(re.search(remedy.message, m) for m in messages):
            return remedy
    return None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


@contextlib.contextmanager
def without_partial_graph() -> Iterator[None]:
    """Keep torch.export's dump of the partial graph off stderr when export fails.

    On a data-dependent failure torch.export prints the whole graph traced so far (dozens of
    lines of generated code) to stderr before raising; the CaptureError made from the failure
    says what to do, and `--debug` shows the traceback. What else is written to stderr meanwhile
    (warnings) is passed on unchanged."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stderr(buffer):
            yield
    except BaseException as exc:
        graph = str(getattr(exc, "partial_fx_graph", "") or "")
        sys.stderr.write(
            buffer.getvalue().replace(graph + "\n", "") if graph else buffer.getvalue()
        )
        raise
    sys.stderr.write(buffer.getvalue())


_INSTALLED = re.compile(r"[/\\](site|dist)-packages[/\\]")


def user_code_failed(what: str, exc: BaseException, *, fix: str) -> CaptureError:
    """A CaptureError for an exception raised by the user's own code that capture called (a
    `@portable` factory, an example-input function): names the exception and the user's line."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if is_user_file(f.filename)]
    own = [f for f in frames if not _INSTALLED.search(f.filename)]  # not inside a library
    frame = (own or frames)[-1] if own or frames else None
    source = None
    if frame is not None:
        source = f"{frame.filename}:{frame.lineno}" + (
            f"  `{frame.line.strip()}`" if frame.line else ""
        )
    return CaptureError(f"{what} raised {type(exc).__name__}: {exc}", source=source, fix=fix)


def _op_in(message: str) -> str | None:
    match = re.search(r"\b(aten\.[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)?)", message)
    return match.group(1) if match else None
