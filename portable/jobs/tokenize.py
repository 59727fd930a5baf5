"""`tokenize`: a text file -> a token file (`.bin` or `.npy`) that `portable train --data` reads.

Tokenizers, both offline (nothing is ever downloaded):
- `"bytes"`: the UTF-8 bytes of the text are the ids 0..255 (vocabulary 256). The end-of-text
  id is 0 (the NUL byte, which text does not contain), so the vocabulary stays 256 and ASCII text
  stays within ids 0..127;
- a local directory holding a Hugging Face `tokenizer.json` (read by the `tokenizers` library,
  which parses it without running code). Its end-of-text id is the `eos_token` of
  `tokenizer_config.json` / `special_tokens_map.json`, else the first of `<|endoftext|>`, `</s>`,
  `<eos>`, `<|end_of_text|>` it knows, else none is appended. Special tokens of the tokenizer's
  post-processor (BOS/CLS templates) are not added.
(A directory literally named `bytes` is passed as `./bytes`.)

The text is read in chunks of about `chunk_bytes`, cut after the last line end of each (or, in
a line longer than a chunk, between UTF-8 characters), so memory stays bounded; a Hugging Face
tokenizer sees each chunk separately, which can tokenize a run of blank lines across a cut
differently from the whole text at once. Ids are written as uint16 when the vocabulary fits
(at most 65536 ids), else uint32; `.npy` gets numpy's header. The output appears complete or not
at all: it is written to a temporary file beside it and renamed into place.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

from .. import limits
from ..errors import DataError
from ..safe_json import read_json
from .data import checked_path

__all__ = ["BYTES", "tokenize"]

BYTES = "bytes"
_CHUNK_BYTES = 4 << 20
_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
_TOKENIZER_FIX = (
    "pass --tokenizer bytes, or a local directory with a Hugging Face tokenizer.json (a fast "
    "tokenizer's save_pretrained(DIR) writes one)"
)


@dataclasses.dataclass(frozen=True)
class _Encoder:
    name: str
    vocab: int
    eos: int | None
    encode: Callable[[bytes, int], np.ndarray]  # (piece, its byte offset) -> ids
    at_lines: bool  # cut the text at line ends (text tokenizers) or anywhere (bytes)


def tokenize(
    text: str | os.PathLike[str],
    tokenizer: str,
    out: str | os.PathLike[str],
    *,
    dtype: str | None = None,
    append_eos: bool = True,
    chunk_bytes: int = _CHUNK_BYTES,
) -> dict[str, Any]:
    """Tokenize the file `text` with `tokenizer` ("bytes" or a tokenizer directory) into `out`
    (`.bin` raw little-endian, or `.npy`), replacing a file there; one end-of-text id is
    appended when `append_eos` and the tokenizer has one. Returns {"tokens", "dtype", "vocab",
    "out", "tokenizer", "eos", "text", "text_bytes"}. DataError for a missing or empty text,
    an unreadable tokenizer, a dtype the vocabulary does not fit, or text that is not UTF-8."""
    src, size = _text_file(text)
    dest = _destination(Path(out), src)
    enc = _bytes_encoder() if tokenizer == BYTES else _hf_encoder(tokenizer)
    np_dtype = _out_dtype(dtype, enc.vocab)
    eos = enc.eos if append_eos else None
    dest.parent.mkdir(parents=True, exist_ok=True)
    staged: list[str] = []
    try:
        raw = _temp(dest, staged)
        with open(raw, "wb") as f:
            count = _write_ids(src, enc, eos, np_dtype, f, max(chunk_bytes, 16))
        if count == 0:
            raise DataError(
                f"{src} gives no tokens with tokenizer {enc.name}", fix="check the text"
            )
        final = (
            raw if dest.suffix == ".bin" else _with_npy_header(raw, dest, count, np_dtype, staged)
        )
        os.replace(final, dest)
    except BaseException:  # Ctrl-C included: nothing half-written is left
        for path in staged:
            Path(path).unlink(missing_ok=True)
        raise
    for path in staged:
        Path(path).unlink(missing_ok=True)
    return {
        "tokens": count,
        "dtype": np_dtype.name,
        "vocab": enc.vocab,
        "out": str(dest),
        "tokenizer": enc.name,
        "eos": eos,
        "text": str(src),
        "text_bytes": size,
    }


def _text_file(text: str | os.PathLike[str]) -> tuple[Path, int]:
    src = checked_path(text, "text file", "pass the path of an existing text file")
    info = os.stat(src)
    if not stat.S_ISREG(info.st_mode):
        raise DataError(f"text file {src} is not a regular file", fix="pass a text file")
    if info.st_size == 0:
        raise DataError(f"text file {src} is empty (0 bytes)", fix="pass a file with some text")
    return src, info.st_size


def _destination(out: Path, src: Path) -> Path:
    if out.suffix not in (".bin", ".npy"):
        raise DataError(
            f"--out {out} must end in .bin (raw ids) or .npy", fix="name it e.g. tokens.bin"
        )
    if out.is_symlink() or out.is_dir():
        raise DataError(f"--out {out} is a directory or a symlink", fix="choose another --out")
    if out.exists() and os.path.samefile(out, src):
        raise DataError(f"--out {out} is the text file itself", fix="choose another --out")
    return out


def _out_dtype(dtype: str | None, vocab: int) -> np.dtype[Any]:
    name = dtype or ("uint16" if vocab <= 1 << 16 else "uint32")
    if name not in ("uint16", "uint32"):
        raise DataError(f"unknown token dtype {name!r}", fix="use uint16 or uint32")
    if name == "uint16" and vocab > 1 << 16:
        raise DataError(
            f"a vocabulary of {vocab} ids does not fit uint16 (ids 0..65535)",
            fix="use --dtype uint32 (or leave --dtype out: it is chosen from the vocabulary)",
        )
    return np.dtype(name).newbyteorder("<")


def _bytes_encoder() -> _Encoder:
    def encode(piece: bytes, offset: int) -> np.ndarray:
        return np.frombuffer(piece, dtype=np.uint8)

    return _Encoder(BYTES, 256, 0, encode, at_lines=False)


def _hf_encoder(spec: str) -> _Encoder:
    """A `tokenizers` Tokenizer from DIR/tokenizer.json (bounded in size, no symlink out)."""
    folder = checked_path(spec, "tokenizer directory", _TOKENIZER_FIX)
    if not folder.is_dir():
        raise DataError(
            f"--tokenizer {spec} is neither `bytes` nor a directory", fix=_TOKENIZER_FIX
        )
    file = folder / "tokenizer.json"
    if not file.exists():
        raise DataError(f"tokenizer directory {folder} has no tokenizer.json", fix=_TOKENIZER_FIX)
    checked_path(file, "tokenizer file", _TOKENIZER_FIX)
    size, cap = os.stat(file).st_size, limits.current().max_json_bytes
    if not file.is_file() or size > cap:
        raise DataError(f"{file} is not a regular file of at most {cap} bytes", fix=_TOKENIZER_FIX)
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise DataError(
            f"reading {file} needs the `tokenizers` package ({exc})",
            fix="pip install tokenizers, or pass --tokenizer bytes",
        ) from exc
    try:
        tk = Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust parser raises Exception on a malformed file
        raise DataError(f"cannot read tokenizer {file}: {exc}", fix=_TOKENIZER_FIX) from exc
    vocab = max(tk.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    if vocab < 1:
        raise DataError(f"tokenizer {file} has an empty vocabulary", fix=_TOKENIZER_FIX)

    def encode(piece: bytes, offset: int) -> np.ndarray:
        try:
            text = piece.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(
                f"the text is not UTF-8 (byte {offset + exc.start}: {exc.reason})",
                fix="convert it to UTF-8 (iconv -t UTF-8), or use --tokenizer bytes",
            ) from exc
        return np.asarray(tk.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    return _Encoder(str(folder), vocab, _eos_id(tk, folder), encode, at_lines=True)


def _eos_id(tk: Any, folder: Path) -> int | None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name
        if not path.exists():
            continue
        doc = read_json(
            checked_path(path, "tokenizer file", _TOKENIZER_FIX), DataError, fix=_TOKENIZER_FIX
        )
        token = doc.get("eos_token") if isinstance(doc, dict) else None
        token = token.get("content") if isinstance(token, dict) else token
        found = tk.token_to_id(token) if isinstance(token, str) else None
        if found is not None:
            return int(found)
    for token in _EOS_NAMES:
        found = tk.token_to_id(token)
        if found is not None:
            return int(found)
    return None


def _write_ids(
    src: Path, enc: _Encoder, eos: int | None, dtype: np.dtype[Any], f: IO[bytes], chunk: int
) -> int:
    count = 0
    with open(src, "rb") as text:
        for offset, piece in _pieces(text, chunk, enc.at_lines):
            ids = enc.encode(piece, offset)
            if ids.size and not 0 <= int(ids.min()) <= int(ids.max()) < enc.vocab:
                raise DataError(f"tokenizer {enc.name} gave ids outside 0..{enc.vocab - 1}")
            f.write(ids.astype(dtype).tobytes())
            count += int(ids.size)
    if eos is not None and count:
        f.write(np.array([eos], dtype=dtype).tobytes())
        count += 1
    return count


def _pieces(f: IO[bytes], chunk: int, at_lines: bool) -> Iterator[tuple[int, bytes]]:
    """(byte offset, piece) of the file, pieces ending after a line end (at_lines) or anywhere;
    at most about 2 * chunk bytes are held."""
    carry, offset = b"", 0
    while block := f.read(chunk):
        data = carry + block
        cut = len(data)
        if at_lines:
            cut = data.rfind(b"\n") + 1 or _last_char_start(data)
        if cut:
            yield offset, data[:cut]
            offset += cut
        carry = data[cut:]
    if carry:
        yield offset, carry


def _last_char_start(data: bytes) -> int:
    """Where the last UTF-8 character of `data` starts (it may be incomplete)."""
    i = len(data) - 1
    while i > 0 and data[i] & 0xC0 == 0x80:
        i -= 1
    return i


def _temp(dest: Path, staged: list[str]) -> str:
    fd, path = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    os.close(fd)
    staged.append(path)
    return path


def _with_npy_header(
    raw: str, dest: Path, count: int, dtype: np.dtype[Any], staged: list[str]
) -> str:
    """A second staged file: numpy's header for `count` ids, then the ids of `raw`."""
    path = _temp(dest, staged)
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False}
    with open(path, "wb") as out, open(raw, "rb") as ids:
        np.lib.format.write_array_header_1_0(out, {**header, "shape": (count,)})
        shutil.copyfileobj(ids, out, 1 << 20)
    return path
