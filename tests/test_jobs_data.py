"""Training data (portable/jobs/data.py, tokenize.py, `portable data`): real token files in
tmp_path (.bin uint16/uint32, .npy, a Hugging Face `datasets` directory), the sampler's
determinism for any split of rows, epochs, the cursor on resume, the prefetcher, tokenization
of README.md with the byte tokenizer and a small local Hugging Face tokenizer, every bad input
as a typed error, and the CLI through `main([...])`.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from portable.cli import ExitCode, main
from portable.errors import DataError, JobError
from portable.jobs.data import Prefetcher, Sampler, TokenFile, check_vocab
from portable.jobs.tokenize import tokenize

README = Path(__file__).resolve().parents[1] / "README.md"


def write_bin(path: Path, ids, dtype: str = "uint16") -> Path:
    np.asarray(ids, dtype=dtype).tofile(path)
    return path


def stream(n: int = 1000, vocab: int = 300) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * 7919) % vocab


# token files ------------------------------------------------------------------------------------


def test_bin_uint16_is_mapped_and_read_as_int64(tmp_path):
    ids = stream()
    t = TokenFile.open(write_bin(tmp_path / "t.bin", ids))
    assert len(t) == 1000 and t.dtype == np.dtype("uint16")
    window = t.window(10, 20)
    assert window.dtype == np.int64 and window.tolist() == ids[10:30].tolist()
    assert t.max_token() == int(ids.max())
    ident = t.identity()
    assert ident["tokens"] == 1000 and ident["bytes"] == 2000 and ident["dtype"] == "uint16"
    assert ident["path"] == str(tmp_path / "t.bin") and len(ident["fingerprint"]) == 64


def test_bin_uint32_holds_large_ids(tmp_path):
    ids = [0, 70_000, 4_000_000_000, 5]
    t = TokenFile.open(write_bin(tmp_path / "t.bin", ids, "uint32"), dtype="uint32")
    assert t.window(0, 4).tolist() == ids and t.max_token() == 4_000_000_000


def test_fingerprint_tells_files_apart(tmp_path):
    ids = stream(2000)
    a = TokenFile.open(write_bin(tmp_path / "a.bin", ids)).identity()["fingerprint"]
    assert TokenFile.open(write_bin(tmp_path / "b.bin", ids)).identity()["fingerprint"] == a
    changed = ids.copy()
    changed[-1] += 1
    assert TokenFile.open(write_bin(tmp_path / "c.bin", changed)).identity()["fingerprint"] != a
    # the same bytes read as another dtype are another stream
    as32 = TokenFile.open(tmp_path / "a.bin", dtype="uint32").identity()
    assert as32["fingerprint"] != a and as32["tokens"] == 1000


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "int32", "int64"])
def test_npy_of_each_dtype(tmp_path, dtype):
    ids = stream(500).astype(dtype)
    np.save(tmp_path / "t.npy", ids)
    t = TokenFile.open(tmp_path / "t.npy")
    assert t.dtype == np.dtype(dtype) and len(t) == 500
    assert t.window(490, 10).tolist() == ids[490:].tolist()


def test_datasets_directory_is_one_stream_across_rows_and_shards(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the `datasets` extra is not installed")
    rows = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12]]
    ds = datasets.Dataset.from_dict({"input_ids": rows, "text": ["x"] * 5})
    ds.save_to_disk(str(tmp_path / "ds"), num_shards=2)
    t = TokenFile.open(tmp_path / "ds")
    assert len(t) == 12 and t.window(0, 12).tolist() == list(range(1, 13))
    assert t.window(3, 5).tolist() == [4, 5, 6, 7, 8]  # crosses rows and the shard boundary
    assert t.max_token() == 12 and t.identity()["tokens"] == 12
    s = Sampler(t, batch=2, seq=2, seed=0)
    x, y = s.batch(0)
    assert (x[:, 1:] == y[:, :-1]).all()


def test_datasets_dict_and_missing_column_are_refused(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the `datasets` extra is not installed")
    split = datasets.Dataset.from_dict({"input_ids": [[1, 2]]})
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"DatasetDict \(splits: test, train\)") as info:
        TokenFile.open(tmp_path / "dd")
    assert "dd/test" in info.value.fix or "dd/train" in info.value.fix
    datasets.Dataset.from_dict({"text": ["a"]}).save_to_disk(str(tmp_path / "text"))
    with pytest.raises(DataError, match=r"no `input_ids` column \(columns: text\)"):
        TokenFile.open(tmp_path / "text")


def test_datasets_directory_with_a_symlink_out_is_refused(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the `datasets` extra is not installed")
    datasets.Dataset.from_dict({"input_ids": [[1, 2]]}).save_to_disk(str(tmp_path / "ds"))
    (tmp_path / "elsewhere").write_text("{}")
    (tmp_path / "ds" / "extra.json").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(DataError, match="outside its directory"):
        TokenFile.open(tmp_path / "ds")


# bad token files --------------------------------------------------------------------------------


def test_missing_empty_fifo_and_unknown_files(tmp_path):
    with pytest.raises(DataError, match="does not exist") as info:
        TokenFile.open(tmp_path / "nope.bin")
    assert "portable data tokenize" in info.value.fix
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(DataError, match=r"empty \(0 bytes\)"):
        TokenFile.open(tmp_path / "empty.bin")
    os.mkfifo(tmp_path / "fifo.bin")
    with pytest.raises(DataError, match="not a regular file"):
        TokenFile.open(tmp_path / "fifo.bin")  # and does not block
    (tmp_path / "t.txt").write_text("hello")
    with pytest.raises(DataError, match=r"neither \.bin nor \.npy"):
        TokenFile.open(tmp_path / "t.txt")
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match="no state.json"):
        TokenFile.open(tmp_path / "folder")
    with pytest.raises(DataError, match="unknown token dtype 'int8'"):
        TokenFile.open(write_bin(tmp_path / "t.bin", [1, 2]), dtype="int8")


def test_a_size_that_does_not_fit_the_dtype_is_refused(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match=r"3 bytes.*\(3 % 2 = 1\): wrong --dtype"):
        TokenFile.open(tmp_path / "odd.bin")
    write_bin(tmp_path / "six.bin", [1, 2, 3])
    with pytest.raises(DataError, match=r"\(6 % 4 = 2\)") as info:
        TokenFile.open(tmp_path / "six.bin", dtype="uint32")
    assert "--dtype uint16" in info.value.fix


def test_symlinks_out_of_their_directory_are_refused(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_bin(tmp_path / "b" / "real.bin", [1, 2, 3])
    (tmp_path / "a" / "link.bin").symlink_to(tmp_path / "b" / "real.bin")
    with pytest.raises(DataError, match="is a symlink to .* outside its directory"):
        TokenFile.open(tmp_path / "a" / "link.bin")
    (tmp_path / "b" / "near.bin").symlink_to("real.bin")  # within its directory: fine
    assert len(TokenFile.open(tmp_path / "b" / "near.bin")) == 3
    (tmp_path / "a" / "dangling.bin").symlink_to(tmp_path / "a" / "gone.bin")
    with pytest.raises(DataError, match="a broken symlink"):
        TokenFile.open(tmp_path / "a" / "dangling.bin")


class _Touch:
    """Unpickling this creates `marker` (it must never be unpickled)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def test_npy_object_arrays_and_pickles_never_load(tmp_path):
    marker = tmp_path / "unpickled"
    np.save(tmp_path / "obj.npy", np.array([_Touch(marker)], dtype=object), allow_pickle=True)
    with pytest.raises(DataError, match="dtype object is not one of"):
        TokenFile.open(tmp_path / "obj.npy")
    (tmp_path / "pickle.npy").write_bytes(pickle.dumps(_Touch(marker)))
    with pytest.raises(DataError, match="is not a readable .npy file"):
        TokenFile.open(tmp_path / "pickle.npy")
    assert not marker.exists()


def _npy_with_header(path: Path, header: dict, data: bytes) -> Path:
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, header)
        f.write(data)
    return path


def test_npy_shapes_orders_dtypes_and_sizes_are_checked(tmp_path):
    np.save(tmp_path / "two.npy", np.zeros((4, 4), dtype=np.uint16))
    with pytest.raises(DataError, match=r"shape \(4, 4\) is not 1-d"):
        TokenFile.open(tmp_path / "two.npy")
    data = np.arange(10, dtype="<u2").tobytes()
    header = {"descr": "<u2", "fortran_order": True, "shape": (10,)}
    with pytest.raises(DataError, match="Fortran order"):
        TokenFile.open(_npy_with_header(tmp_path / "f.npy", header, data))
    np.save(tmp_path / "float.npy", np.zeros(4, dtype=np.float32))
    with pytest.raises(DataError, match="dtype float32 is not one of"):
        TokenFile.open(tmp_path / "float.npy")
    np.save(tmp_path / "rec.npy", np.zeros(4, dtype=[("a", "<u2")]))
    with pytest.raises(DataError, match="is not one of"):
        TokenFile.open(tmp_path / "rec.npy")
    header = {"descr": "<u2", "fortran_order": False, "shape": (10,)}
    with pytest.raises(DataError, match=r"declares 10 uint16 ids \(20 bytes.*truncated"):
        TokenFile.open(_npy_with_header(tmp_path / "short.npy", header, data[:-2]))
    np.save(tmp_path / "u16.npy", np.arange(4, dtype=np.uint16))
    with pytest.raises(DataError, match="holds uint16 ids, but dtype uint32 was asked for"):
        TokenFile.open(tmp_path / "u16.npy", dtype="uint32")
    (tmp_path / "junk.npy").write_bytes(b"\x93NUMPY\x01\x00\xff\xff" + b"{" * 64)
    with pytest.raises(DataError, match="is not a readable .npy file"):
        TokenFile.open(tmp_path / "junk.npy")


def test_negative_ids_in_signed_files_are_refused(tmp_path):
    ids = np.arange(100, dtype=np.int32)
    ids[50] = -3
    np.save(tmp_path / "neg.npy", ids)
    t = TokenFile.open(tmp_path / "neg.npy")
    assert t.window(0, 50).tolist() == list(range(50))  # the ids before it read fine
    with pytest.raises(DataError, match=r"negative token id \(-3 near token 40\)"):
        t.window(40, 20)
    with pytest.raises(DataError, match=r"negative token id \(-3\)"):
        t.max_token()
    with pytest.raises(DataError, match="negative token id"):
        for step in range(20):
            Sampler(t, batch=2, seq=9, seed=0).batch(step)


def test_check_vocab(tmp_path):
    t = TokenFile.open(write_bin(tmp_path / "t.bin", [1, 300, 7]))
    check_vocab(t, 301)
    with pytest.raises(DataError) as info:
        check_vocab(t, 128)
    assert info.value.what == (
        f"token id 300 in {tmp_path / 't.bin'} is outside the model's vocabulary of 128 "
        "(ids 0..127)"
    )
    assert "at most 128 ids" in info.value.fix and "at least 301" in info.value.fix


# sampler ----------------------------------------------------------------------------------------


@pytest.fixture
def tokens(tmp_path) -> TokenFile:
    return TokenFile.open(write_bin(tmp_path / "t.bin", stream(1001)))  # 100 windows of 10 + 1


def test_a_row_is_seq_plus_one_consecutive_tokens(tokens):
    s = Sampler(tokens, batch=8, seq=10, seed=3)
    assert s.windows_per_epoch == 100
    ids = stream(1001)
    x, y = s.batch(5)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8, 10)
    for r, w in enumerate(s.windows(5).tolist()):
        assert x[r].tolist() == ids[w * 10 : w * 10 + 10].tolist()
        assert y[r].tolist() == ids[w * 10 + 1 : w * 10 + 11].tolist()


def test_the_permutation_is_the_documented_one(tokens):
    s = Sampler(tokens, batch=8, seq=10, seed=3)
    perm = np.random.Generator(np.random.PCG64(np.random.SeedSequence([3, 0]))).permutation(100)
    assert s.windows(0).tolist() == perm[:8].tolist()
    assert s.windows(2).tolist() == perm[16:24].tolist()


def test_any_split_of_rows_is_the_same_global_batch(tokens):
    s = Sampler(tokens, batch=8, seq=10, seed=1)
    for step in (0, 7, 12, 30):
        x, y = s.batch(step)
        for cuts in ([0, 4, 8], [0, 1, 2, 8], [0, 3, 5, 6, 8]):
            parts = [s.rows(step, a, b) for a, b in zip(cuts, cuts[1:], strict=False)]
            assert torch.equal(torch.cat([p[0] for p in parts]), x)
            assert torch.equal(torch.cat([p[1] for p in parts]), y)
    fresh = Sampler(tokens, batch=8, seq=10, seed=1)  # a function of (seed, step) only
    assert torch.equal(fresh.batch(12)[0], s.batch(12)[0])
    assert not torch.equal(s.batch(0)[0], s.batch(1)[0])
    assert not torch.equal(Sampler(tokens, batch=8, seq=10, seed=2).batch(0)[0], s.batch(0)[0])


def test_epochs_deal_every_window_once_and_wrap(tokens):
    s = Sampler(tokens, batch=8, seq=10, seed=5)  # 100 windows: step 12 straddles epochs 0/1
    dealt = np.concatenate([s.windows(k) for k in range(25)])  # 200 samples = 2 epochs
    first, second = dealt[:100], dealt[100:]
    assert sorted(first.tolist()) == list(range(100)) == sorted(second.tolist())
    assert first.tolist() != second.tolist()
    perm1 = np.random.Generator(np.random.PCG64(np.random.SeedSequence([5, 1]))).permutation(100)
    assert s.windows(12).tolist() == first[96:].tolist() + perm1[:4].tolist()
    late = s.windows(10**9)  # far epochs are computed directly, not walked to
    assert late.shape == (8,) and 0 <= late.min() and late.max() < 100


def test_resume_from_a_cursor_sees_the_same_batches(tmp_path, tokens):
    s = Sampler(tokens, batch=8, seq=10, seed=9)
    cursor = json.loads(json.dumps(s.cursor(17)))  # as a checkpoint stores it
    assert cursor["format"] == "portable-data-cursor" and cursor["version"] == 1
    assert cursor["sampler"] == "epoch-permutation-v1" and cursor["next_step"] == 17
    assert cursor["tokens"] == tokens.identity()
    moved = write_bin(tmp_path / "moved.bin", stream(1001))  # the same data, elsewhere
    resumed = Sampler(TokenFile.open(moved), batch=8, seq=10, seed=9)
    step = resumed.check_cursor(cursor)
    assert step == 17
    # another data-parallel degree: 4 ranks of 2 rows read the original's global batch
    for k in range(step, step + 3):
        rows = [resumed.rows(k, r * 2, r * 2 + 2)[0] for r in range(4)]
        assert torch.equal(torch.cat(rows), s.batch(k)[0])


def test_a_cursor_from_another_job_is_refused(tmp_path, tokens):
    cursor = Sampler(tokens, batch=8, seq=10, seed=9).cursor(3)
    for field, kwargs in (
        ("seed", dict(batch=8, seq=10, seed=1)),
        ("batch", dict(batch=4, seq=10, seed=9)),
        ("seq", dict(batch=8, seq=5, seed=9)),
    ):
        with pytest.raises(DataError, match=f"has {field} = ") as info:
            Sampler(tokens, **kwargs).check_cursor(cursor)
        assert "same --data, --seed" in info.value.fix
    other = TokenFile.open(write_bin(tmp_path / "other.bin", stream(1001, vocab=299)))
    with pytest.raises(DataError, match=r"tokens.fingerprint = '[0-9a-f]{64}', this job has"):
        Sampler(other, batch=8, seq=10, seed=9).check_cursor(cursor)
    mine = Sampler(tokens, batch=8, seq=10, seed=9)
    for bad, match in (
        ([1, 2], "not a portable data cursor"),
        ({**cursor, "format": "x"}, "not a portable data cursor"),
        ({**cursor, "version": 2}, "version 2 is not 1"),
        ({**cursor, "sampler": "other"}, "has sampler = 'other'"),
        ({**cursor, "tokens": "abc"}, "tokens.fingerprint = None"),
        ({**cursor, "next_step": -1}, "next_step -1 is not a step number"),
        ({**cursor, "next_step": True}, "next_step True"),
        ({**cursor, "next_step": "3"}, "next_step '3'"),
    ):
        with pytest.raises(DataError, match=match):
            mine.check_cursor(bad)


def test_too_little_data_and_bad_arguments_say_the_arithmetic(tmp_path):
    short = TokenFile.open(write_bin(tmp_path / "s.bin", range(10)))
    with pytest.raises(DataError, match=r"too few tokens.*10 tokens: 0 window.*\(10 - 1\) // 10"):
        Sampler(short, batch=1, seq=10, seed=0)
    with pytest.raises(DataError, match=r"fewer windows than one batch.*3 window.*batch is 4"):
        Sampler(short, batch=4, seq=3, seed=0)
    for kwargs, match in (
        (dict(batch=0, seq=3, seed=0), "batch must be an int >= 1, got 0"),
        (dict(batch=1, seq=3, seed=-1), "seed must be an int >= 0, got -1"),
        (dict(batch=1, seq=True, seed=0), "seq must be an int >= 1, got True"),
    ):
        with pytest.raises(DataError, match=match):
            Sampler(short, **kwargs)
    s = Sampler(short, batch=2, seq=3, seed=0)
    with pytest.raises(DataError, match=r"rows \[1, 3\) are not within the global batch of 2"):
        s.rows(0, 1, 3)
    with pytest.raises(DataError, match="step must be an int"):
        s.windows(-1)


# prefetcher -------------------------------------------------------------------------------------


def test_prefetcher_returns_steps_in_order_and_runs_ahead():
    calls: list[int] = []

    def load(step: int) -> int:
        calls.append(step)
        time.sleep(0.01 * (step % 3))  # uneven load times
        return step * step

    with Prefetcher(load, 3, 10, depth=2) as pf:
        deadline = time.monotonic() + 5
        while len(calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert calls == [3, 4, 5]  # two queued, one waiting to be queued: bounded by depth
        got = [pf.next() for _ in range(7)]
        assert [(s, v) for s, v, _ in got] == [(s, s * s) for s in range(3, 10)]
        assert all(w >= 0 for _, _, w in got)
        with pytest.raises(StopIteration):
            pf.next()


def test_prefetcher_measures_the_wait():
    with Prefetcher(lambda s: time.sleep(0.2) or s, 0, 1) as pf:
        step, value, waited = pf.next()
    assert (step, value) == (0, 0) and waited >= 0.1


def test_an_error_in_load_is_raised_for_its_step():
    calls: list[int] = []

    def load(step: int) -> int:
        calls.append(step)
        if step == 2:
            raise DataError(f"bad window at step {step}")
        return step

    pf = Prefetcher(load, 0, 10)
    assert pf.next()[:2] == (0, 0) and pf.next()[:2] == (1, 1)
    with pytest.raises(DataError, match="bad window at step 2"):
        pf.next()
    with pytest.raises(DataError, match="bad window at step 2"):  # and stays raised
        pf.next()
    time.sleep(0.1)
    assert calls == [0, 1, 2]  # nothing loaded after the failing step
    pf.close()


def test_close_stops_a_thread_blocked_on_a_full_queue():
    pf = Prefetcher(lambda s: s, 0, 1_000_000, depth=1)
    time.sleep(0.1)  # the queue is full; the thread waits to put the next item
    began = time.monotonic()
    pf.close()
    assert time.monotonic() - began < 2 and not pf._thread.is_alive()
    pf.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pf.next()
    assert pf._thread.daemon
    with pytest.raises(JobError, match="depth >= 1"):
        Prefetcher(lambda s: s, 0, 1, depth=0)


def test_prefetched_sampler_batches_equal_direct_ones(tokens):
    s = Sampler(tokens, batch=4, seq=10, seed=0)
    with Prefetcher(s.batch, 0, 5) as pf:
        for k in range(5):
            step, (x, y), _ = pf.next()
            assert step == k and torch.equal(x, s.batch(k)[0]) and torch.equal(y, s.batch(k)[1])


# tokenize ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".bin", ".npy"])
def test_bytes_tokenizer_on_readme(tmp_path, suffix):
    out = tmp_path / f"t{suffix}"
    result = tokenize(README, "bytes", out)
    text = README.read_bytes()
    ids = np.load(out) if suffix == ".npy" else np.fromfile(out, dtype="<u2")
    assert ids.tolist() == list(text) + [0]
    assert result == {
        "tokens": len(text) + 1,
        "dtype": "uint16",
        "vocab": 256,
        "out": str(out),
        "tokenizer": "bytes",
        "eos": 0,
        "text": str(README),
        "text_bytes": len(text),
    }
    assert TokenFile.open(out).window(0, len(text)).tolist() == list(text)
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # no temporary left


def test_bytes_tokenizer_streams_in_small_chunks(tmp_path):
    tokenize(README, "bytes", tmp_path / "a.bin", append_eos=False, chunk_bytes=100)
    assert np.fromfile(tmp_path / "a.bin", dtype="<u2").tolist() == list(README.read_bytes())


def _bpe_dir(tmp_path: Path, text: str, config: dict | None = None) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator([text], trainer=trainer)
    folder = tmp_path / "tok"
    folder.mkdir()
    tk.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_a_local_hugging_face_tokenizer(tmp_path):
    pytest.importorskip("tokenizers", reason="the `tokenizers` package is not installed")
    from tokenizers import Tokenizer

    text = README.read_text()
    folder = _bpe_dir(tmp_path, text)
    tk = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = tk.token_to_id("<|endoftext|>")
    whole = tokenize(README, str(folder), tmp_path / "whole.npy")
    ids = np.load(tmp_path / "whole.npy").tolist()
    assert ids == tk.encode(text, add_special_tokens=False).ids + [eos]
    assert whole["vocab"] == tk.get_vocab_size() and whole["eos"] == eos
    assert whole["dtype"] == "uint16" and whole["tokens"] == len(ids)
    tokenize(README, str(folder), tmp_path / "small.bin", chunk_bytes=256)  # cut at line ends
    small = np.fromfile(tmp_path / "small.bin", dtype="<u2").tolist()
    assert small[-1] == eos and tk.decode(small[:-1], skip_special_tokens=False) == text
    assert len(small) < 0.7 * len(text)  # merges: a real BPE, not bytes


def test_the_eos_comes_from_tokenizer_config(tmp_path):
    pytest.importorskip("tokenizers", reason="the `tokenizers` package is not installed")
    folder = _bpe_dir(tmp_path, "hello world\n" * 20, {"eos_token": {"content": "<pad>"}})
    (tmp_path / "t.txt").write_text("hello world\n")
    result = tokenize(tmp_path / "t.txt", str(folder), tmp_path / "t.bin")
    assert result["eos"] == 0 and np.fromfile(tmp_path / "t.bin", "<u2")[-1] == 0


def test_long_lines_are_cut_between_utf8_characters(tmp_path):
    pytest.importorskip("tokenizers", reason="the `tokenizers` package is not installed")
    from tokenizers import Tokenizer

    text = "ünïcødé → 東京 " * 40 + "\nend\n"  # one line far longer than a chunk
    (tmp_path / "u.txt").write_text(text)
    folder = _bpe_dir(tmp_path, text)
    tokenize(tmp_path / "u.txt", str(folder), tmp_path / "u.bin", chunk_bytes=16, append_eos=False)
    ids = np.fromfile(tmp_path / "u.bin", dtype="<u2").tolist()
    assert Tokenizer.from_file(str(folder / "tokenizer.json")).decode(ids) == text


def test_a_vocabulary_over_65536_is_written_as_uint32(tmp_path):
    pytest.importorskip("tokenizers", reason="the `tokenizers` package is not installed")
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"hello": 0, "world": 70_000, "[UNK]": 1}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "big").mkdir()
    tk.save(str(tmp_path / "big" / "tokenizer.json"))
    (tmp_path / "t.txt").write_text("hello world\nworld other\n")
    result = tokenize(tmp_path / "t.txt", str(tmp_path / "big"), tmp_path / "t.bin")
    assert result["dtype"] == "uint32" and result["vocab"] == 70_001 and result["eos"] is None
    assert TokenFile.open(tmp_path / "t.bin", dtype="uint32").window(0, 4).tolist() == [
        0,
        70_000,
        70_000,
        1,
    ]
    with pytest.raises(DataError, match="70001 ids does not fit uint16") as info:
        tokenize(tmp_path / "t.txt", str(tmp_path / "big"), tmp_path / "u.bin", dtype="uint16")
    assert "--dtype uint32" in info.value.fix
    assert not (tmp_path / "u.bin").exists()


def test_tokenize_refuses_bad_inputs(tmp_path):
    out = tmp_path / "t.bin"
    with pytest.raises(DataError, match="text file .*missing.txt does not exist"):
        tokenize(tmp_path / "missing.txt", "bytes", out)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match=r"is empty \(0 bytes\)"):
        tokenize(tmp_path / "empty.txt", "bytes", out)
    with pytest.raises(DataError, match=r"must end in \.bin .* or \.npy"):
        tokenize(README, "bytes", tmp_path / "t.txt")
    with pytest.raises(DataError, match="tokenizer directory .*nowhere does not exist"):
        tokenize(README, str(tmp_path / "nowhere"), out)
    with pytest.raises(DataError, match="is neither `bytes` nor a directory"):
        tokenize(README, str(README), out)
    (tmp_path / "tok").mkdir()
    with pytest.raises(DataError, match="has no tokenizer.json") as info:
        tokenize(README, str(tmp_path / "tok"), out)
    assert "save_pretrained" in info.value.fix
    (tmp_path / "tok" / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="cannot read tokenizer"):
        tokenize(README, str(tmp_path / "tok"), out)
    (tmp_path / "self.bin").write_bytes(b"text")
    with pytest.raises(DataError, match="is the text file itself"):
        tokenize(tmp_path / "self.bin", "bytes", tmp_path / "self.bin")
    with pytest.raises(DataError, match="unknown token dtype 'int8'"):
        tokenize(README, "bytes", out, dtype="int8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt", "self.bin", "tok"]


def test_a_failure_midway_leaves_the_previous_output(tmp_path):
    pytest.importorskip("tokenizers", reason="the `tokenizers` package is not installed")
    folder = _bpe_dir(tmp_path, "plain text\n" * 50)
    (tmp_path / "bad.txt").write_bytes(b"plain text\n" * 50 + b"bad \xff byte\n")
    (tmp_path / "t.bin").write_bytes(b"old!")
    with pytest.raises(DataError, match=r"not UTF-8 \(byte 554: invalid start byte\)"):
        tokenize(tmp_path / "bad.txt", str(folder), tmp_path / "t.bin", chunk_bytes=64)
    assert (tmp_path / "t.bin").read_bytes() == b"old!"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.txt", "t.bin", "tok"]


# CLI --------------------------------------------------------------------------------------------


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_tokenize_and_inspect(tmp_path, capsys):
    out = tmp_path / "t.bin"
    code, text, err = cli(
        capsys, "data", "tokenize", str(README), "--tokenizer", "bytes", "--out", str(out)
    )
    n = README.stat().st_size + 1
    assert code == ExitCode.OK, err
    assert text.startswith(f"wrote {out}: {n} tokens (uint16, vocabulary 256, end-of-text id 0)")
    code, text, err = cli(
        capsys, "data", "tokenize", str(README), "--tokenizer", "bytes", "-o", str(out)
    )
    assert code == ExitCode.OUTPUT_CONFLICT and "exists" in err and "--force" in err
    code, text, _ = cli(
        capsys, "data", "tokenize", str(README), "--tokenizer", "bytes", "-o", str(out),
        "--force", "--no-eos", "--json",
    )  # fmt: skip
    doc = json.loads(text)
    assert code == 0 and doc["status"] == "ok" and doc["tokens"] == n - 1 and doc["eos"] is None
    code, text, _ = cli(capsys, "data", "inspect", str(out), "--seq", "64", "--batch", "8")
    assert code == 0 and f"{n - 1} tokens, uint16" in text
    assert f"{(n - 2) // 64} windows of seq + 1 = 65 tokens" in text
    code, text, _ = cli(capsys, "data", "inspect", str(out), "--json")
    doc = json.loads(text)
    assert doc["tokens"] == n - 1 and doc["max_token"] == max(README.read_bytes())
    assert doc["fingerprint"] == TokenFile.open(out).identity()["fingerprint"]


def test_cli_errors_are_typed_exit_codes(tmp_path, capsys):
    code, _, err = cli(
        capsys, "data", "tokenize", str(tmp_path / "none.txt"), "--tokenizer", "bytes", "-o",
        str(tmp_path / "t.bin"),
    )  # fmt: skip
    assert code == ExitCode.USER_ERROR and err.startswith("error: text file")
    assert "fix: pass the path of an existing text file" in err
    (tmp_path / "odd.bin").write_bytes(b"123")
    code, text, err = cli(capsys, "data", "inspect", str(tmp_path / "odd.bin"), "--json")
    assert code == ExitCode.USER_ERROR and "wrong --dtype" in err
    assert json.loads(text)["error"]["type"] == "DataError"
    write_bin(tmp_path / "t.bin", range(100))
    code, _, err = cli(
        capsys, "data", "inspect", str(tmp_path / "t.bin"), "--seq", "50", "--batch", "8"
    )
    assert code == ExitCode.USER_ERROR and "fewer windows than one batch" in err
    assert (
        cli(capsys, "data", "inspect", str(tmp_path / "t.bin"), "--seq", "0")[0] == ExitCode.USAGE
    )
    assert cli(capsys, "data")[0] == ExitCode.USAGE
