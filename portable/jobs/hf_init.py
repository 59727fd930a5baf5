"""A run's initial weights from a Hugging Face checkpoint, each rank reading only its slices.

A `save_pretrained` directory holds `model.safetensors`, or shards `model-0000x-of-0000y.safetensors`
with `model.safetensors.index.json` ({"weight_map": {name: file}}). `read_hf_checkpoint` opens
only the files holding the wanted tensors and reads only this rank's slice of each
(safetensors memory-maps the file and copies the slice). The directory is input from elsewhere:
the index is bounded JSON (`portable.safe_json`), every file it names is a plain file name of a
regular file inside the directory (a symlink must stay inside it), global shapes are checked and
each slice's size is checked against `portable.limits` before it is read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..limits import check_tensor_bytes
from ..safe_json import read_json

__all__ = ["HfTensor", "read_hf_checkpoint"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}")
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_FIX = "point the run at a Hugging Face save_pretrained directory (model.safetensors, or shards "
_FIX += "with model.safetensors.index.json); copy hub cache files out of their symlinks first"


@dataclasses.dataclass(frozen=True)
class HfTensor:
    """What the program wants of one tensor: its global shape, its dtype, and this rank's slice
    of the global tensor (one slice per leading dim; missing dims are whole)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    index: tuple[slice, ...]


def read_hf_checkpoint(
    directory: str | os.PathLike[str],
    wanted: Mapping[str, HfTensor],
    *,
    aliases: Mapping[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """{name: this rank's slice of `name`, cast to the wanted dtype} for every wanted name; a
    name absent from the checkpoint is read under `aliases[name]` (tied weights such as
    `lm_head.weight` -> `model.embed_tokens.weight`). Floating dtypes are cast to the wanted
    one; integer/bool dtypes must match. CheckpointError on anything missing or mismatched."""
    from safetensors import safe_open

    root = Path(directory)
    weight_map = _weight_map(root)
    aliases = aliases or {}
    out: dict[str, torch.Tensor] = {}
    handles: dict[str, Any] = {}
    with contextlib.ExitStack() as opened:
        for name, want in wanted.items():
            source = name if name in weight_map else aliases.get(name)
            if source is None or source not in weight_map:
                raise CheckpointError(
                    f"{root} has no tensor {name!r}"
                    + (f" (nor its alias {source!r})" if source else "")
                    + f"; it holds {len(weight_map)} tensors in {sorted(set(weight_map.values()))}",
                    fix="check the model matches the checkpoint, or pass aliases= for tied weights",
                )
            file = weight_map[source]
            if file not in handles:
                path = _member(root, file)
                handles[file] = opened.enter_context(safe_open(str(path), framework="pt"))
            out[name] = _read_slice(handles[file], source, want, root / file)
    return out


def _weight_map(root: Path) -> dict[str, str]:
    """{tensor name: file name} from the index, or from the single model.safetensors."""
    from safetensors import safe_open

    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory", fix=_FIX)
    if os.path.lexists(root / INDEX):
        _member(root, INDEX)
        doc = read_json(root / INDEX, CheckpointError, fix=_FIX)
        mapping = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(mapping, dict):
            raise CheckpointError(f"{root / INDEX} has no weight_map object", fix=_FIX)
        for name, file in mapping.items():
            if not isinstance(file, str) or not _PLAIN.fullmatch(file) or ".." in file:
                raise CheckpointError(
                    f"{root / INDEX} maps {name[:80]!r} to {str(file)[:80]!r}, not a plain file "
                    "name inside the directory",
                    fix=_FIX,
                )
        return dict(mapping)
    path = _member(root, SINGLE)
    with safe_open(str(path), framework="pt") as f:
        return dict.fromkeys(f.keys(), SINGLE)


def _member(root: Path, name: str) -> Path:
    """`root / name` when it is a regular file inside `root` (a symlink must resolve inside)."""
    path = root / name
    try:
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            real = Path(os.path.realpath(path))
            if not real.is_relative_to(Path(os.path.realpath(root))):
                raise CheckpointError(f"{path} is a symlink out of {root} (to {real})", fix=_FIX)
            info = os.stat(real)
    except OSError as exc:
        raise CheckpointError(f"{path} is missing ({exc.strerror})", fix=_FIX) from exc
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{path} is not a regular file", fix=_FIX)
    return path


def _read_slice(handle: Any, name: str, want: HfTensor, path: Path) -> torch.Tensor:
    try:
        view = handle.get_slice(name)
    except Exception as exc:  # safetensors raises its own error types
        raise CheckpointError(
            f"{path} does not hold {name!r}, which its index maps there: {exc}", fix=_FIX
        ) from None
    shape, code = tuple(view.get_shape()), view.get_dtype()
    if shape != tuple(want.shape):
        raise CheckpointError(
            f"{path} holds {name!r} as {list(shape)}, the program wants {list(want.shape)}",
            fix="the checkpoint is of another model size; build the model from its config",
        )
    dtype = _DTYPES.get(code)
    if dtype is None or (
        dtype != want.dtype and not (dtype.is_floating_point and want.dtype.is_floating_point)
    ):
        raise CheckpointError(
            f"{path} holds {name!r} as {code}, the program's {str(want.dtype).removeprefix('torch.')} "
            "cannot take it (only floating dtypes are cast)",
            fix="use a checkpoint of the same model, or change the program's dtype",
        )
    local = _local_shape(name, want)
    wider = max(dtype, want.dtype, key=lambda d: d.itemsize)  # the cast may widen it
    check_tensor_bytes(local, wider, f"the slice of {name!r} in {path}")
    if not shape:
        tensor = handle.get_tensor(name)
    else:
        tensor = view[want.index] if want.index else view[:]
    if tuple(tensor.shape) != local:
        raise CheckpointError(f"{path}: the slice of {name!r} came back as {list(tensor.shape)}")
    return tensor.to(want.dtype).contiguous()


def _local_shape(name: str, want: HfTensor) -> tuple[int, ...]:
    """The shape `want.index` selects of `want.shape` (slices with a positive step, in bounds)."""
    if len(want.index) > len(want.shape) or not all(type(s) is slice for s in want.index):
        raise CheckpointError(f"the slice {want.index} of {name!r} does not fit {list(want.shape)}")
    out = []
    for dim, size in enumerate(want.shape):
        if dim >= len(want.index):
            out.append(size)
            continue
        s = want.index[dim]
        start, stop, step = s.indices(size)
        if step < 1 or (s.stop is not None and s.stop > size):
            raise CheckpointError(f"the slice {s} of dim {dim} of {name!r} is outside {size}")
        out.append(len(range(start, stop, step)))
    return tuple(out)
