"""DCP checkpoints read without running their code: `SafeFileSystemReader`.

torch.distributed.checkpoint's `FileSystemReader.read_metadata` reads `.metadata` with
`pickle.load`, so a checkpoint from elsewhere could run anything when it is loaded. This reader
reads it with an unpickler that builds exactly what a DCP `Metadata` pickle holds (found by
`pickletools.dis` on real files):

- classes of `torch.distributed.checkpoint.metadata` (`Metadata`, `TensorStorageMetadata`,
  `ChunkStorageMetadata`, `TensorProperties`, `BytesStorageMetadata`, `MetadataIndex`,
  `StorageMeta`, `_MEM_FORMAT_ENCODING`) and `filesystem._StorageInfo`, built empty and filled
  from a state dict;
- `torch.Size` of ints, `torch.<dtype>`, layouts through `torch.serialization._get_layout`, and
  `pathlib.PosixPath` (kept as a string) for the saved checkpoint id;
- builtin str/bytes/int/float/bool/None/tuple/list/dict, dicts keyed only by str, int or a
  checked `MetadataIndex` (a key is hashed as it is inserted: nothing deep is ever hashed).

Anything else (another global, a set, persistent ids, extension codes, a BUILD on a class or a
builtin, a call of anything not listed) is a `CheckpointError` before it runs. The file is at
most `portable.limits` max_json_bytes, the result is checked field by field with bounded work,
and every storage item must lie inside a regular file named plainly in the checkpoint
directory. Read items must be tensors: DCP would `torch.load(weights_only=False)` a bytes item.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as _fs
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from ..errors import CheckpointError
from ..limits import current

__all__ = ["SafeFileSystemReader", "read_metadata", "unpickle_metadata"]

_MD = "torch.distributed.checkpoint.metadata"
_CLASSES: dict[tuple[str, str], type] = {
    (_MD, "Metadata"): _md.Metadata,
    (_MD, "TensorStorageMetadata"): _md.TensorStorageMetadata,
    (_MD, "ChunkStorageMetadata"): _md.ChunkStorageMetadata,
    (_MD, "TensorProperties"): _md.TensorProperties,
    (_MD, "BytesStorageMetadata"): _md.BytesStorageMetadata,
    (_MD, "MetadataIndex"): _md.MetadataIndex,
    (_MD, "StorageMeta"): _md.StorageMeta,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _fs._StorageInfo,
}
_ENCODING = _md._MEM_FORMAT_ENCODING
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
_MAX_INT = 1 << 62  # no shape, offset or length of a real checkpoint is near this
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}")
_FIX = "this is not a checkpoint DCP wrote; resume from another checkpoint or re-save this one"


def _refuse(what: str) -> CheckpointError:
    return CheckpointError(f"the DCP metadata {what}", fix=_FIX)


def _int(value: object, what: str) -> int:
    if type(value) is not int or not 0 <= value < _MAX_INT:
        raise _refuse(f"holds {what} that is not an int in [0, 2**62)")
    return value


def _size(dims: object) -> torch.Size:
    if type(dims) not in (tuple, list) or len(dims) > 64:  # type: ignore[arg-type]
        raise _refuse("builds a torch.Size from something other than a short list of ints")
    return torch.Size([_int(d, "a size") for d in dims])  # type: ignore[attr-defined]


def _layout(name: object) -> torch.layout:
    if type(name) is not str or name not in _LAYOUTS:
        raise _refuse(f"names an unknown layout {str(name)[:40]!r}")
    return _LAYOUTS[name]


def _encoding(value: object) -> _md._MEM_FORMAT_ENCODING:
    if type(value) is not int or value not in {e.value for e in _ENCODING}:
        raise _refuse(f"holds an unknown memory format code {str(value)[:40]!r}")
    return _ENCODING(value)


def _path(*parts: object) -> str:
    if not all(type(p) is str for p in parts):
        raise _refuse("builds a path from something other than strings")
    return os.path.join(*(str(p) for p in parts)) if parts else ""


_CALLS: dict[tuple[str, str], Callable[..., Any]] = {
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _layout,
    (_MD, "_MEM_FORMAT_ENCODING"): _encoding,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
}
_CALLABLES = {id(f) for f in _CALLS.values()}


def _checked_key(key: object) -> object:
    """A dict key that is safe to hash: str, int, or a MetadataIndex of a str and a Size."""
    if type(key) in (str, int):
        return key
    if type(key) is _md.MetadataIndex:
        offset = getattr(key, "offset", None)
        if type(getattr(key, "fqn", None)) is str and (
            offset is None or type(offset) is torch.Size
        ):
            return key
    raise _refuse(f"keys a dict by a {type(key).__name__}")


class _Unpickler(pickle._Unpickler):
    """The pure-Python unpickler with find_class and every object-building opcode restricted."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _CLASSES:
            return _CLASSES[module, name]
        if (module, name) in _CALLS:
            return _CALLS[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _refuse(f"names {module}.{name}, which a DCP metadata file never holds")

    def _build(self) -> None:
        stack = self.stack  # type: ignore[attr-defined]
        state, inst = stack.pop(), stack[-1]
        cls = type(inst)
        if cls not in _CLASSES.values():
            raise _refuse(f"sets the state of a {cls.__name__}")
        if cls is _md.TensorProperties:
            if type(state) is not tuple or len(state) != 5:
                raise _refuse("holds TensorProperties that are not a 5-tuple")
            inst.__setstate__(state)
            return
        names = {f.name for f in dataclasses.fields(cls)}
        if type(state) is not dict or not set(state) <= names:
            raise _refuse(f"sets fields of a {cls.__name__} it does not have")
        for key, value in state.items():
            object.__setattr__(inst, key, value)

    def _reduce(self) -> None:
        stack = self.stack  # type: ignore[attr-defined]
        args, func = stack.pop(), stack[-1]
        if id(func) not in _CALLABLES or type(args) is not tuple:
            raise _refuse(f"calls {getattr(func, '__name__', type(func).__name__)}")
        stack[-1] = func(*args)

    def _newobj(self) -> None:
        stack = self.stack  # type: ignore[attr-defined]
        args, cls = stack.pop(), stack.pop()
        if cls not in _CLASSES.values() or args != ():
            raise _refuse(f"creates a {getattr(cls, '__name__', type(cls).__name__)}")
        stack.append(cls.__new__(cls))

    def _setitem(self) -> None:
        stack = self.stack  # type: ignore[attr-defined]
        value, key = stack.pop(), stack.pop()
        _into_dict(stack[-1], [key, value])

    def _setitems(self) -> None:
        items = self.pop_mark()  # type: ignore[attr-defined]
        _into_dict(self.stack[-1], items)  # type: ignore[attr-defined]

    def _dict(self) -> None:
        items = self.pop_mark()  # type: ignore[attr-defined]
        target: dict[Any, Any] = {}
        _into_dict(target, items)
        self.append(target)  # type: ignore[attr-defined]

    def _append(self) -> None:
        stack = self.stack  # type: ignore[attr-defined]
        value = stack.pop()
        _list(stack[-1]).append(value)

    def _appends(self) -> None:
        items = self.pop_mark()  # type: ignore[attr-defined]
        _list(self.stack[-1]).extend(items)  # type: ignore[attr-defined]

    def _forbidden(self) -> None:
        raise _refuse("uses a pickle opcode a DCP metadata file never holds")


def _into_dict(target: object, items: list[Any]) -> None:
    if type(target) is not dict or len(items) % 2:
        raise _refuse("sets items of something that is not a dict")
    for i in range(0, len(items), 2):
        target[_checked_key(items[i])] = items[i + 1]


def _list(target: object) -> list[Any]:
    if type(target) is not list:
        raise _refuse("appends to something that is not a list")
    return target


_DISPATCH: dict[int, Callable[[Any], None]] = dict(pickle._Unpickler.dispatch)
_OVERRIDES: dict[bytes, Callable[[Any], None]] = {
    pickle.BUILD: _Unpickler._build,
    pickle.REDUCE: _Unpickler._reduce,
    pickle.NEWOBJ: _Unpickler._newobj,
    pickle.SETITEM: _Unpickler._setitem,
    pickle.SETITEMS: _Unpickler._setitems,
    pickle.DICT: _Unpickler._dict,
    pickle.APPEND: _Unpickler._append,
    pickle.APPENDS: _Unpickler._appends,
}
for _code, _method in _OVERRIDES.items():
    _DISPATCH[_code[0]] = _method
for _code in (pickle.INST, pickle.OBJ, pickle.NEWOBJ_EX, pickle.PERSID, pickle.BINPERSID,
              pickle.EXT1, pickle.EXT2, pickle.EXT4, pickle.EMPTY_SET, pickle.ADDITEMS,
              pickle.FROZENSET):  # fmt: skip
    _DISPATCH[_code[0]] = _Unpickler._forbidden
_Unpickler.dispatch = _DISPATCH


def unpickle_metadata(data: bytes, where: str) -> _md.Metadata:
    """The `Metadata` pickled in `data` (bytes of a `.metadata` file), built by the restricted
    unpickler and checked field by field; CheckpointError naming `where` on anything else."""
    try:
        value = _Unpickler(io.BytesIO(data)).load()
    except CheckpointError as exc:
        raise CheckpointError(f"{where}: {exc.what}", fix=exc.fix) from None
    except (Exception, RecursionError) as exc:  # a malformed pickle fails in many ways
        raise CheckpointError(
            f"{where} is not a DCP metadata file: {type(exc).__name__}: {str(exc)[:200]}",
            fix=_FIX,
        ) from None
    try:
        return _checked(value, budget=len(data) + 16)
    except CheckpointError as exc:
        raise CheckpointError(f"{where}: {exc.what}", fix=exc.fix) from None


def _checked(md: object, *, budget: int) -> _md.Metadata:
    """`md` when it is a Metadata whose every field has its declared type, chunks inside their
    tensors and a storage item for every chunk; work bounded by `budget` items."""
    if type(md) is not _md.Metadata:
        raise _refuse(f"holds a {type(md).__name__}, not a Metadata")
    entries = md.state_dict_metadata
    storage = md.storage_data
    if type(entries) is not dict or type(storage) is not dict:
        raise _refuse("has no state_dict_metadata / storage_data dicts")
    count = 0
    for key, entry in entries.items():
        if type(key) is not str:
            raise _refuse("keys state_dict_metadata by something other than str")
        if type(entry) is _md.BytesStorageMetadata:
            continue
        if type(entry) is not _md.TensorStorageMetadata:
            raise _refuse(f"describes {key!r} as a {type(entry).__name__}")
        chunks = _tensor_chunks(key, entry)
        count += len(chunks) + 1
        if count > budget:
            raise _refuse("holds more entries than its size allows (shared references)")
        for chunk in chunks:
            if _md.MetadataIndex(key, chunk.offsets) not in storage:
                raise _refuse(f"has no storage item for a chunk of {key!r}")
    for index, info in storage.items():
        if type(index) is not _md.MetadataIndex or type(info) is not _fs._StorageInfo:
            raise _refuse("holds storage_data that is not MetadataIndex -> _StorageInfo")
        if type(info.relative_path) is not str or not _PLAIN_NAME.fullmatch(info.relative_path):
            raise _refuse(f"stores {index.fqn!r} in {str(info.relative_path)[:80]!r}, not a file "
                          "name inside the checkpoint directory")  # fmt: skip
        _int(info.offset, "a storage offset")
        _int(info.length, "a storage length")
        if info.transform_descriptors:
            raise _refuse(f"stores {index.fqn!r} through transforms {info.transform_descriptors}")
    _check_extras(md)
    return md


def _tensor_chunks(key: str, entry: _md.TensorStorageMetadata) -> list[_md.ChunkStorageMetadata]:
    props, size, chunks = entry.properties, entry.size, entry.chunks
    if type(props) is not _md.TensorProperties or not isinstance(props.dtype, torch.dtype):
        raise _refuse(f"gives {key!r} no dtype")
    if type(size) is not torch.Size or type(chunks) is not list:
        raise _refuse(f"gives {key!r} no size or chunk list")
    for chunk in chunks:
        if type(chunk) is not _md.ChunkStorageMetadata:
            raise _refuse(f"holds a chunk of {key!r} that is a {type(chunk).__name__}")
        offsets, sizes = chunk.offsets, chunk.sizes
        if type(offsets) is not torch.Size or type(sizes) is not torch.Size:
            raise _refuse(f"holds a chunk of {key!r} without offsets and sizes")
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise _refuse(f"holds a chunk of {key!r} of another rank than {list(size)}")
        if any(o + s > d for o, s, d in zip(offsets, sizes, size, strict=True)):
            raise _refuse(
                f"holds a chunk of {key!r} at {list(offsets)} of {list(sizes)} outside {list(size)}"
            )
    return chunks


def _check_extras(md: _md.Metadata) -> None:
    planner = md.planner_data
    if planner is not None and type(planner) is not dict:
        raise _refuse("holds planner_data that is not a dict")
    for key, path in (planner or {}).items():
        if type(path) not in (tuple, list) or not all(type(p) in (str, int) for p in path):
            raise _refuse(f"holds planner_data for {str(key)[:80]!r} that is not a key path")
    meta = md.storage_meta
    if meta is not None:
        if type(meta) is not _md.StorageMeta:
            raise _refuse("holds storage_meta that is not a StorageMeta")
        for name in ("checkpoint_id", "save_id", "load_id"):
            if type(getattr(meta, name, None)) not in (str, type(None)):
                raise _refuse(f"holds a storage_meta.{name} that is not a string")
        modules = getattr(meta, "modules", [])
        if type(modules) is not list or not all(type(m) is str for m in modules):
            raise _refuse("holds storage_meta.modules that are not strings")
    if type(md.version) not in (str, type(None)):
        raise _refuse("holds a version that is not a string")


def read_metadata(directory: str | os.PathLike[str]) -> _md.Metadata:
    """The checked `Metadata` of the DCP checkpoint in `directory` (see the module doc)."""
    return SafeFileSystemReader(directory).read_metadata()


class SafeFileSystemReader(FileSystemReader):
    """A `FileSystemReader` for checkpoints from elsewhere: `.metadata` read by the restricted
    unpickler, every storage item inside a regular file of the directory, tensors only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> _md.Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        md = unpickle_metadata(_read_bounded(path), str(path))
        _check_files(Path(self.path), md)
        if md.storage_meta is None:
            md.storage_meta = _md.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            if item.type != LoadItemType.TENSOR:
                raise CheckpointError(
                    f"{self.path} holds {item.dest_index.fqn!r} as pickled bytes, not a tensor",
                    fix="load only tensors from a checkpoint from elsewhere (bytes items are "
                    "read with pickle)",
                )
        return super().read_data(plan, planner)


def _read_bounded(path: Path) -> bytes:
    limit = current().max_json_bytes
    try:
        fd = os.open(
            path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        )
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise CheckpointError(f"{path} is not a regular file", fix=_FIX)
            if info.st_size > limit:
                raise CheckpointError(
                    f"{path} is {info.st_size} bytes, over the limit of {limit}",
                    fix="raise portable.limits max_json_bytes if the checkpoint is this large",
                )
            return f.read(limit + 1)
    except OSError as exc:
        raise CheckpointError(
            f"cannot read {path}: {exc.strerror or exc} (a symlink is refused)",
            fix="a DCP checkpoint directory holds its .metadata file; resume from another one",
        ) from exc


def _check_files(directory: Path, md: _md.Metadata) -> None:
    """Every file a storage item names is a regular file in `directory` that holds the item."""
    ends: dict[str, int] = {}
    for info in md.storage_data.values():
        end = info.offset + info.length
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), end)
    for name, end in ends.items():
        path = directory / name
        try:
            info = os.lstat(path)
        except OSError as exc:
            raise CheckpointError(
                f"{path} is missing ({exc.strerror}): the checkpoint is incomplete", fix=_FIX
            ) from exc
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{path} is not a regular file (a symlink?)", fix=_FIX)
        if info.st_size < end:
            raise CheckpointError(
                f"{path} is {info.st_size} bytes but the metadata reads up to byte {end}: "
                "the checkpoint is truncated",
                fix=_FIX,
            )
