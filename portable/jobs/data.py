"""Training data: token files, the deterministic sampler, and the background prefetcher.

A token file is a flat stream of token ids, memory-mapped read-only and never read whole:
- `.bin`: raw little-endian ids (the nanoGPT/Megatron convention), uint16 unless dtype="uint32";
- `.npy`: a 1-d C-order array of uint16/uint32/int32/int64 (header parsed by numpy's safe
  reader, never unpickled);
- a directory written by Hugging Face `datasets` `save_to_disk`: its `input_ids` column, every
  row's ids one after another (zero-copy views of Arrow's memory map; needs `datasets`).
Signed ids (int32/int64 files, signed Arrow columns) must not be negative: every window read is
checked, and so is the whole stream by `max_token()`.

The sampler cuts the stream into non-overlapping windows of seq + 1 tokens (inputs and shifted
targets) and deals them out in epochs, each a seeded permutation, so the global batch of step k
depends on (seed, step) only: a job resumed with another data-parallel degree reads exactly the
batches the original would have. Its cursor is what a checkpoint stores.
"""

from __future__ import annotations

import bisect
import hashlib
import importlib
import mmap
import os
import queue
import stat
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

import numpy as np
import torch

from .. import limits
from ..errors import DataError, JobError

__all__ = ["Prefetcher", "Sampler", "TokenFile", "check_vocab", "checked_path"]

T = TypeVar("T")

_BIN_DTYPES = ("uint16", "uint32")
_NPY_DTYPES = ("uint16", "uint32", "int32", "int64")
_FINGERPRINT_BYTES = 1 << 20  # hashed at each end of the stream
_SCAN_TOKENS = 1 << 24  # max_token() reads this many ids at a time
_CURSOR_FORMAT = "portable-data-cursor"
_CURSOR_VERSION = 1
_SAMPLER = "epoch-permutation-v1"
_DATA_FIX = "pass a token file: .bin (uint16, or uint32 with --dtype uint32), .npy, or a "
_DATA_FIX += "`datasets` save_to_disk directory; make one with `portable data tokenize`"


def checked_path(
    path: str | os.PathLike[str], what: str = "data file", fix: str = _DATA_FIX
) -> Path:
    """`path` as a Path, if it exists and is not a symlink pointing out of its directory."""
    p = Path(path)
    if not p.exists():
        broken = " (a broken symlink)" if p.is_symlink() else ""
        raise DataError(f"{what} {p} does not exist{broken}", fix=fix)
    if p.is_symlink():
        target = Path(os.path.realpath(p))
        home = Path(os.path.realpath(p.parent))
        if not target.is_relative_to(home):
            raise DataError(
                f"{what} {p} is a symlink to {target}, outside its directory {home}",
                fix="pass the target path itself, or copy the file in (cp -L); links out of a "
                "directory are never followed",
            )
    return p


class TokenFile:
    """A flat array of token ids, memory-mapped read-only (never read whole)."""

    def __init__(self, path: Path, dtype: np.dtype[Any], segments: list[np.ndarray]) -> None:
        self.path = path
        self.dtype = dtype
        self._segments = [s for s in segments if len(s)]
        self._starts = np.cumsum([0] + [len(s) for s in self._segments]).tolist()
        self._signed = dtype.kind == "i"
        self._max: int | None = None
        if len(self) == 0:
            raise DataError(f"{path} holds no tokens", fix=_DATA_FIX)

    @staticmethod
    def open(path: str | os.PathLike[str], *, dtype: str | None = None) -> TokenFile:
        """Open `path` (.bin, .npy or a `datasets` directory); DataError for anything else, a
        missing or empty file, a size that does not fit the dtype, or a symlink out of its dir."""
        p = checked_path(path)
        if dtype is not None and dtype not in _BIN_DTYPES:
            raise DataError(f"unknown token dtype {dtype!r}", fix="use uint16 or uint32")
        if p.is_dir():
            return _open_dataset(p, dtype)
        if p.suffix == ".npy":
            return _open_npy(p, dtype)
        if p.suffix == ".bin":
            return _open_bin(p, dtype or "uint16")
        raise DataError(f"{p} is neither .bin nor .npy (suffix {p.suffix!r})", fix=_DATA_FIX)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __repr__(self) -> str:
        return f"TokenFile({str(self.path)!r}, dtype={self.dtype.name}, tokens={len(self)})"

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as a new int64 array."""
        out = np.empty(length, dtype=np.int64)
        self._gather(start, out)
        self._check_ids(out, start)
        return out

    def max_token(self) -> int:
        """The largest id in the stream (one chunked scan, then cached); DataError if a signed
        file holds a negative id."""
        if self._max is None:
            high, low = 0, 0
            for seg in self._segments:
                for i in range(0, len(seg), _SCAN_TOKENS):
                    chunk = seg[i : i + _SCAN_TOKENS]
                    high = max(high, int(chunk.max()))
                    low = min(low, int(chunk.min())) if self._signed else 0
            if low < 0:
                raise self._negative(low)
            self._max = high
        return self._max

    def identity(self) -> dict[str, Any]:
        """What a cursor records of this stream; `fingerprint` is the sha256 of the dtype, the
        token count, and the first and last 1 MiB of the ids (cheap; tells another file apart)."""
        n, size = len(self), len(self) * self.dtype.itemsize
        k = min(n, _FINGERPRINT_BYTES // self.dtype.itemsize)
        digest = hashlib.sha256(f"{self.dtype.name}:{n}:".encode())
        for start in (0, n - k):
            part = np.empty(k, dtype=self.dtype)
            self._gather(start, part)
            digest.update(part.tobytes())
        return {
            "path": str(self.path),
            "dtype": self.dtype.name,
            "tokens": n,
            "bytes": size,
            "fingerprint": digest.hexdigest(),
        }

    def _gather(self, start: int, out: np.ndarray) -> None:
        """Copy tokens [start, start + len(out)) into `out` (converting to its dtype)."""
        length = len(out)
        if start < 0 or length < 0 or start + length > len(self):
            raise DataError(
                f"tokens [{start}, {start + length}) are outside {self.path} ({len(self)} tokens)"
            )
        s = bisect.bisect_right(self._starts, start) - 1
        pos = 0
        while pos < length:
            seg = self._segments[s]
            off = start + pos - self._starts[s]
            take = min(length - pos, len(seg) - off)
            out[pos : pos + take] = seg[off : off + take]
            pos += take
            s += 1

    def _check_ids(self, ids: np.ndarray, start: int) -> None:
        if self._signed and ids.size and int(ids.min()) < 0:
            raise self._negative(int(ids.min()), f" near token {start}")

    def _negative(self, value: int, where: str = "") -> DataError:
        return DataError(
            f"{self.path} holds a negative token id ({value}{where}); ids are 0..vocab-1",
            fix="re-tokenize the text (portable data tokenize), or fix the file that wrote it",
        )


def _regular_size(path: Path) -> tuple[int, int]:
    """(fd, size) of a regular, non-empty file opened read-only (never blocks on a FIFO)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise DataError(f"{path} is not a regular file", fix=_DATA_FIX)
    if info.st_size == 0:
        os.close(fd)
        raise DataError(f"{path} is empty (0 bytes)", fix=_DATA_FIX)
    return fd, info.st_size


def _mapped(fd: int, path: Path, dtype: np.dtype[Any], offset: int, count: int) -> np.ndarray:
    try:
        buf = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    return np.frombuffer(buf, dtype=dtype, count=count, offset=offset)


def _open_bin(path: Path, dtype: str) -> TokenFile:
    np_dtype = np.dtype(dtype).newbyteorder("<")
    fd, size = _regular_size(path)
    rest = size % np_dtype.itemsize
    if rest:
        os.close(fd)
        other = "uint16" if dtype == "uint32" else "uint32"
        raise DataError(
            f"{path} is {size} bytes, not a whole number of {dtype} ids "
            f"({size} % {np_dtype.itemsize} = {rest}): wrong --dtype, or a truncated file?",
            fix=f"pass the dtype the file was written with (--dtype {other}?), or re-tokenize",
        )
    return TokenFile(path, np_dtype, [_mapped(fd, path, np_dtype, 0, size // np_dtype.itemsize)])


def _open_npy(path: Path, dtype: str | None) -> TokenFile:
    fd, size = _regular_size(path)
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, np_dtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran, np_dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise ValueError(f"unsupported .npy format version {version}")
            offset = f.tell()
    except (ValueError, EOFError, OSError) as exc:
        os.close(fd)
        raise DataError(f"{path} is not a readable .npy file: {exc}", fix=_DATA_FIX) from exc
    problem = _npy_problem(shape, fortran, np_dtype, dtype)
    count = int(np.prod(shape)) if not problem else 0
    if not problem and offset + count * np_dtype.itemsize != size:
        problem = (
            f"its header declares {count} {np_dtype.name} ids ({count * np_dtype.itemsize} "
            f"bytes after a {offset}-byte header) but the file is {size} bytes (truncated?)"
        )
    if problem:
        os.close(fd)
        raise DataError(f"{path}: {problem}", fix=_DATA_FIX)
    return TokenFile(path, np_dtype, [_mapped(fd, path, np_dtype, offset, count)])


def _npy_problem(shape: Any, fortran: bool, dtype: np.dtype[Any], wanted: str | None) -> str:
    """Why a .npy header is not a token array, or ''."""
    if dtype.hasobject or dtype.fields is not None or dtype.name not in _NPY_DTYPES:
        return f"dtype {dtype} is not one of {', '.join(_NPY_DTYPES)} (object arrays never load)"
    if len(shape) != 1:
        return f"shape {tuple(shape)} is not 1-d; token files are one flat array"
    if fortran:
        return "it is stored in Fortran order; token files are C order"
    if wanted is not None and wanted != dtype.name:
        return f"it holds {dtype.name} ids, but dtype {wanted} was asked for"
    return ""


def _open_dataset(path: Path, dtype: str | None) -> TokenFile:
    """The `input_ids` of a `datasets` save_to_disk directory, as one stream."""
    if (path / "dataset_dict.json").is_file():
        splits = sorted(d.name for d in path.iterdir() if d.is_dir())
        raise DataError(
            f"{path} is a Hugging Face DatasetDict (splits: {', '.join(splits) or 'none'})",
            fix=f"pass one split's directory, e.g. {path / (splits[0] if splits else 'train')}",
        )
    if not (path / "state.json").is_file():
        raise DataError(
            f"{path} is a directory, but not one Hugging Face `datasets` save_to_disk wrote "
            "(no state.json)",
            fix=_DATA_FIX,
        )
    for entry in path.iterdir():
        checked_path(entry, "dataset file")
    try:
        datasets = importlib.import_module("datasets")
        pa = importlib.import_module("pyarrow")
    except ImportError as exc:
        raise DataError(
            f"{path} is a Hugging Face dataset, and reading it needs `datasets` ({exc})",
            fix="pip install datasets, or write the tokens as .bin (portable data tokenize)",
        ) from exc
    try:
        ds = datasets.load_from_disk(str(path), keep_in_memory=False)
        columns = list(ds.column_names)
        chunks = ds.data.column("input_ids").chunks if "input_ids" in columns else None
    except Exception as exc:  # datasets raises many kinds on a damaged directory
        raise DataError(
            f"cannot read the Hugging Face dataset {path}: {type(exc).__name__}: {exc}",
            fix="re-save it with Dataset.save_to_disk",
        ) from exc
    if chunks is None:
        raise DataError(
            f"{path} has no `input_ids` column (columns: {', '.join(columns)})",
            fix="tokenize it first: ds.map(lambda b: tokenizer(b['text']), batched=True)",
        )
    segments = [_arrow_ids(pa, chunk, path) for chunk in chunks]
    kinds = {s.dtype for s in segments if len(s)}
    if len(kinds) > 1:
        raise DataError(f"{path}: `input_ids` mixes Arrow types {sorted(map(str, kinds))}")
    np_dtype = kinds.pop() if kinds else np.dtype("int64")
    if dtype is not None and dtype != np_dtype.name:
        raise DataError(f"{path}: `input_ids` holds {np_dtype.name}, not {dtype}")
    return TokenFile(path, np_dtype, segments)


def _arrow_ids(pa: Any, chunk: Any, path: Path) -> np.ndarray:
    """One Arrow chunk of `input_ids` (lists of ints, or ints) as a zero-copy numpy array."""
    kind = chunk.type
    nested = pa.types.is_list(kind) or pa.types.is_large_list(kind)
    values = chunk.flatten() if nested or pa.types.is_fixed_size_list(kind) else chunk
    if not pa.types.is_integer(values.type) or pa.types.is_uint64(values.type):
        raise DataError(
            f"{path}: `input_ids` is {kind}, not a list of token ids (int32/int64/uint16/...)"
        )
    if values.null_count:
        raise DataError(f"{path}: `input_ids` holds {values.null_count} null id(s)")
    return cast(np.ndarray, values.to_numpy(zero_copy_only=True))


def check_vocab(tokens: TokenFile, vocab: int) -> None:
    """DataError if an id of `tokens` is not below `vocab` (the model's embedding rows)."""
    top = tokens.max_token()
    if top >= vocab:
        raise DataError(
            f"token id {top} in {tokens.path} is outside the model's vocabulary of {vocab} "
            f"(ids 0..{vocab - 1})",
            fix=f"tokenize with a tokenizer of at most {vocab} ids, or use a model with a "
            f"vocabulary of at least {top + 1}",
        )


class Sampler:
    """The global batch of step k: a deterministic function of (seed, step) only.

    Window i is tokens [i*seq, i*seq + seq + 1), i in [0, n), n = (tokens - 1) // seq. Global
    sample g = step*batch + j (row j of the batch) is window perm_e[g % n] of epoch e = g // n,
    where perm_e = numpy Generator(PCG64(SeedSequence([seed, e]))).permutation(n).
    """

    def __init__(self, tokens: TokenFile, *, batch: int, seq: int, seed: int) -> None:
        for name, value, least in (("batch", batch, 1), ("seq", seq, 1), ("seed", seed, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise DataError(f"{name} must be an int >= {least}, got {value!r}")
        self.tokens, self.batch_size, self.seq, self.seed = tokens, batch, seq, seed
        n = (len(tokens) - 1) // seq
        arithmetic = (
            f"{tokens.path} has {len(tokens)} tokens: {n} window(s) of seq + 1 = {seq + 1} "
            f"(({len(tokens)} - 1) // {seq} = {n}), and the global batch is {batch}"
        )
        if n < 1:
            raise DataError(f"too few tokens for one sample: {arithmetic}", fix=_short_fix(seq))
        if n < batch:
            raise DataError(f"fewer windows than one batch: {arithmetic}", fix=_short_fix(seq))
        limits.check_tensor_bytes([batch, seq + 1], torch.int64, "one global batch of tokens")
        self.windows_per_epoch = n
        self._perms: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def windows(self, step: int) -> np.ndarray:
        """The window index of each row of step `step`'s global batch, [batch] int64."""
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 1 << 62:
            raise DataError(f"step must be an int in [0, 2**62), got {step!r}")
        n = self.windows_per_epoch
        g = step * self.batch_size + np.arange(self.batch_size, dtype=np.int64)
        epochs, slots = g // n, g % n
        out = np.empty(self.batch_size, dtype=np.int64)
        for e in np.unique(epochs).tolist():  # one or two (batch <= n)
            rows = epochs == e
            out[rows] = self._permutation(int(e))[slots[rows]]
        return out

    def rows(self, step: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(idx, targets), int64 [stop - start, seq], of rows [start, stop) of step `step`'s
        global batch; reads only those windows (a data-parallel rank reads only its rows)."""
        if not 0 <= start <= stop <= self.batch_size:
            raise DataError(
                f"rows [{start}, {stop}) are not within the global batch of {self.batch_size}"
            )
        chosen = self.windows(step)[start:stop]
        data = np.empty((stop - start, self.seq + 1), dtype=np.int64)
        for r, w in enumerate(chosen.tolist()):
            self.tokens._gather(w * self.seq, data[r])
            self.tokens._check_ids(data[r], w * self.seq)
        idx = torch.from_numpy(np.ascontiguousarray(data[:, :-1]))
        return idx, torch.from_numpy(np.ascontiguousarray(data[:, 1:]))

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(idx, targets) of every row of step `step`'s global batch."""
        return self.rows(step, 0, self.batch_size)

    def cursor(self, step: int) -> dict[str, Any]:
        """The JSON a checkpoint stores to resume at `step` (the next step to run)."""
        return {
            "format": _CURSOR_FORMAT,
            "version": _CURSOR_VERSION,
            "next_step": step,
            "seed": self.seed,
            "batch": self.batch_size,
            "seq": self.seq,
            "sampler": _SAMPLER,
            "tokens": self.tokens.identity(),
        }

    def check_cursor(self, cursor: Mapping[str, Any]) -> int:
        """The next step of a cursor read from a checkpoint (untrusted), after checking it was
        made by this sampler on this data; DataError naming the field that differs."""
        if not isinstance(cursor, Mapping) or cursor.get("format") != _CURSOR_FORMAT:
            raise DataError(
                "the checkpoint's data cursor is not a portable data cursor",
                fix="resume from a checkpoint that portable train wrote",
            )
        if cursor.get("version") != _CURSOR_VERSION:
            raise DataError(
                f"data cursor version {cursor.get('version')!r} is not {_CURSOR_VERSION}",
                fix="resume with the portable version that wrote the checkpoint",
            )
        mine = self.cursor(0)
        for field in ("sampler", "seed", "batch", "seq"):
            _same(field, cursor.get(field), mine[field])
        theirs = cursor.get("tokens")
        theirs = theirs if isinstance(theirs, Mapping) else {}
        for field in ("fingerprint", "tokens", "dtype"):
            _same(f"tokens.{field}", theirs.get(field), mine["tokens"][field], theirs.get("path"))
        step = cursor.get("next_step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise DataError(f"data cursor next_step {step!r} is not a step number")
        return step

    def _permutation(self, epoch: int) -> np.ndarray:
        with self._lock:
            perm = self._perms.get(epoch)
            if perm is None:
                rng = np.random.Generator(
                    np.random.PCG64(np.random.SeedSequence([self.seed, epoch]))
                )
                perm = rng.permutation(self.windows_per_epoch)
                if self.windows_per_epoch <= 1 << 32:  # half the memory of int64
                    perm = perm.astype(np.uint32)
                self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1}
                self._perms[epoch] = perm
            return perm


def _short_fix(seq: int) -> str:
    return (
        f"use more text (portable data tokenize a larger file), a shorter --seq than {seq}, "
        "or a smaller global batch"
    )


def _same(field: str, theirs: Any, mine: Any, path: Any = None) -> None:
    if theirs != mine:
        where = f" (the checkpoint's data was {path})" if path else ""
        raise DataError(
            f"the checkpoint's data cursor has {field} = {theirs!r}, this job has {mine!r}{where}",
            fix="resume with the same --data, --seed, global batch and --seq as the job that "
            "wrote the checkpoint (the data-parallel degree may change), or start a new job",
        )


class Prefetcher(Generic[T]):
    """Runs `load(step)` for steps start, start+1, ..., stop-1 in a background (daemon) thread,
    at most `depth` results ahead of the caller.

    `next()` returns them in order; an exception raised by `load` is raised by `next()` for that
    step (the same object; the thread stops there). `close()` (idempotent; also on leaving a
    `with` block) stops the thread promptly, even while it waits on a full queue.
    """

    _POLL_S = 0.05

    def __init__(self, load: Callable[[int], T], start: int, stop: int, *, depth: int = 2) -> None:
        if depth < 1 or start > stop:
            raise JobError(
                f"prefetching needs depth >= 1 and start <= stop, got {depth}, [{start}, {stop})",
                fix="pass --prefetch 1 or more",
            )
        self._load, self._next, self._stop = load, start, stop
        self._queue: queue.Queue[tuple[int, Any, BaseException | None]] = queue.Queue(depth)
        self._closing = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._work, args=(start,), name="portable-prefetch", daemon=True
        )
        self._thread.start()

    def next(self) -> tuple[int, T, float]:
        """(step, load(step), seconds this call waited for it); StopIteration after `stop`."""
        if self._error is not None:
            raise self._error
        if self._closing.is_set():
            raise RuntimeError("the prefetcher is closed")
        if self._next >= self._stop:
            raise StopIteration
        began = time.perf_counter()
        while True:
            try:
                step, value, error = self._queue.get(timeout=self._POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError(
                        f"the prefetch thread ended before step {self._next}"
                    ) from None
        waited = time.perf_counter() - began
        self._next = step + 1
        if error is not None:
            self._error = error
            raise error
        return step, cast(T, value), waited

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread; waits at most `timeout` s for a `load` call in progress."""
        self._closing.set()
        while True:  # free a producer blocked on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _work(self, start: int) -> None:
        for step in range(start, self._stop):
            if self._closing.is_set():
                return
            try:
                item: tuple[int, Any, BaseException | None] = (step, self._load(step), None)
            except BaseException as exc:  # handed to the caller, with its type
                item = (step, None, exc)
            while not self._closing.is_set():
                try:
                    self._queue.put(item, timeout=self._POLL_S)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return
