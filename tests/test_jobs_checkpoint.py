"""Checkpoints of `portable train` (portable/jobs/checkpoint.py, dcp_reader.py, hf_init.py):
the commit protocol, verification of every byte, metadata read without running pickle code,
resharding loads across plans and processes, async saves, Hugging Face initial weights."""

from __future__ import annotations

import errno
import json
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem

from portable.errors import CheckpointError
from portable.jobs import checkpoint as ckpt
from portable.jobs import checkpoint_manifest
from portable.jobs.checkpoint import CheckpointStore, checkpoint_key, weight_key
from portable.jobs.dcp_reader import SafeFileSystemReader, read_metadata, unpickle_metadata
from portable.jobs.hf_init import HfTensor, read_hf_checkpoint


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "blocks.0.attn.qkv.weight": torch.randn(6, 4, generator=g),
        "norm.weight": torch.randn(4, generator=g).to(torch.bfloat16),
        "optimizer.step": torch.tensor(7.0),
        "optimizer.blocks.0.attn.qkv.weight.exp_avg": torch.randn(6, 4, generator=g),
        "rng.seed": torch.tensor(1234, dtype=torch.int64),
        "rng.offset": torch.tensor(99, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }


def _zeros(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def _listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "checkpoints")


# --------------------------------------------------------------------------- names, round trip


def test_checkpoint_keys_map_optimizer_state_to_optim() -> None:
    assert checkpoint_key("optimizer.blocks.0.w.exp_avg") == "optim.blocks.0.w.exp_avg"
    assert checkpoint_key("optimizer.step") == "optim.step"
    assert checkpoint_key("blocks.0.attn.qkv.weight") == "blocks.0.attn.qkv.weight"
    assert checkpoint_key("rng.seed") == "rng.seed"
    for key in ("optimizer.step", "blocks.0.optimizer.x", "rng.offset", "optim.x"):
        assert checkpoint_key(weight_key(checkpoint_key(key))) == checkpoint_key(key)
    assert weight_key("optim.step") == "optimizer.step"


def test_round_trip_is_bit_exact(store: CheckpointStore) -> None:
    state = _state()
    meta = {"program": "sha256:abc", "plan": {"mesh": {"dp": 1}}, "cursor": {"step": 3}}
    saved = store.save(3, state, meta).wait()
    assert saved.path == store.root / "step-3" and saved.meta == meta
    assert _listing(store.root) == ["step-3"]  # no staging or lock file left
    assert _listing(saved.path) == [".metadata", "__0_0.distcp", "portable.json"]
    doc = json.loads((saved.path / "portable.json").read_text())
    assert (doc["format"], doc["format_version"], doc["step"]) == ("portable-checkpoint", 1, 3)
    assert doc["meta"] == meta and set(doc["files"]) == {".metadata", "__0_0.distcp"}
    keys = set(read_metadata(saved.path).state_dict_metadata)
    assert {"optim.step", "optim.blocks.0.attn.qkv.weight.exp_avg", "rng.seed"} <= keys
    assert not any(k.startswith("optimizer.") for k in keys)

    latest = store.latest()
    assert latest == saved
    targets = _zeros(state)
    store.load(latest, targets)
    for key, value in state.items():
        assert targets[key].dtype == value.dtype and torch.equal(targets[key], value), key


def test_keep_last_k_and_replace_a_step(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ck", keep=2)
    state = _state()
    for step in (1, 2, 3, 4):
        store.save(step, state, {"n": step})
    assert _listing(store.root) == ["step-3", "step-4"]
    state["rng.seed"].fill_(5)
    store.save(4, state, {"n": "again"})  # an existing step is replaced once the new one is done
    assert _listing(store.root) == ["step-3", "step-4"]
    latest = store.latest()
    assert latest is not None and latest.meta == {"n": "again"}
    targets = _zeros(state)
    store.load(latest, targets)
    assert int(targets["rng.seed"]) == 5
    with pytest.raises(CheckpointError, match="keep"):
        CheckpointStore(tmp_path / "x", keep=0)


# --------------------------------------------------------------------------- verification


def _truncate(step: Path) -> None:
    path = step / "__0_0.distcp"
    path.write_bytes(path.read_bytes()[:-10])


def _flip(step: Path) -> None:
    path = step / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _symlink(step: Path) -> None:
    (step / "__0_0.distcp").unlink()
    (step / "__0_0.distcp").symlink_to(step.parent / "step-1" / "__0_0.distcp")


def _directory(step: Path) -> None:
    (step / "__0_0.distcp").unlink()
    (step / "__0_0.distcp").mkdir()


CORRUPTIONS = {
    "uncommitted": (lambda s: (s / "portable.json").unlink(), "never committed"),
    "truncated": (_truncate, "truncated"),
    "flipped byte": (_flip, "corrupted"),
    "symlink": (_symlink, "is a symlink"),
    "extra symlink": (lambda s: (s / "x").symlink_to("/etc/passwd"), "does not list"),
    "extra file": (lambda s: (s / "notes.txt").write_text("hi"), "does not list"),
    "missing file": (lambda s: (s / "__0_0.distcp").unlink(), "lacks"),
    "not a file": (_directory, "not a regular file"),
    "bad json": (lambda s: (s / "portable.json").write_text("{"), "not valid JSON"),
    "other version": (
        lambda s: (s / "portable.json").write_text(
            (s / "portable.json").read_text().replace('"format_version": 1', '"format_version": 9')
        ),
        "format_version 9",
    ),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_a_bad_newer_checkpoint_is_refused_and_the_previous_one_used(
    store: CheckpointStore, name: str
) -> None:
    state = _state()
    store.save(1, state, {"n": 1})
    other = dict(state, **{"rng.seed": torch.tensor(77)})
    store.save(2, other, {"n": 2})
    corrupt, message = CORRUPTIONS[name]
    corrupt(store.root / "step-2")
    with pytest.raises(CheckpointError, match=message) as info:
        store.verify(store.root / "step-2")
    assert str(store.root / "step-2") in str(info.value) and "fix:" in str(info.value)
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        latest = store.latest()
    assert latest is not None and latest.step == 1
    assert store.skipped == [(store.root / "step-2", str(info.value))]
    store.latest()  # recorded once
    assert len(store.skipped) == 1
    targets = _zeros(state)
    store.load(latest, targets)
    assert torch.equal(targets["rng.seed"], state["rng.seed"])


def test_staging_directories_are_never_candidates(store: CheckpointStore) -> None:
    store.save(1, _state(), {})
    (store.root / ".step-9.tmp-1-deadbeef").mkdir()
    (store.root / "step-9.partial").mkdir()
    latest = store.latest()
    assert latest is not None and latest.step == 1


# --------------------------------------------------------------------------- hostile metadata


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _replace_metadata(step: Path, data: bytes) -> None:
    """Swap `.metadata` and re-list it in portable.json (an attacker controls both files)."""
    import hashlib

    (step / ".metadata").write_bytes(data)
    doc = json.loads((step / "portable.json").read_text())
    doc["files"][".metadata"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step / "portable.json").write_text(json.dumps(doc))


def _real_metadata(step: Path) -> object:
    return read_metadata(step)  # through the safe reader, as every load


def _traversal(step: Path) -> bytes:
    md = _real_metadata(step)
    for info in md.storage_data.values():  # type: ignore[attr-defined]
        info.relative_path = "../../escape.distcp"
    return pickle.dumps(md)


def _bytes_entry(step: Path) -> bytes:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = _real_metadata(step)
    md.state_dict_metadata["rng.seed"] = BytesStorageMetadata()  # type: ignore[attr-defined]
    return pickle.dumps(md)


# BUILD with a slot state on a class: would set Metadata.__eq__ (protocol 0 by hand)
_CLASS_STATE = b"ctorch.distributed.checkpoint.metadata\nMetadata\n(N(dS'__eq__'\nI1\nstb."
# a dict keyed by a deep tuple: hashing it would recurse in C
_DEEP_KEY = b"\x80\x04}" + b")" + b"\x85" * 100_000 + b"K\x01s."


def test_malicious_metadata_is_refused_without_running_it(
    store: CheckpointStore, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    step = store.save(1, _state(), {}).wait().path
    evil = pickle.dumps(_RunsCode(marker))
    with pytest.raises(CheckpointError, match=r"names posix\.system"):
        unpickle_metadata(evil, "evil")
    _replace_metadata(step, evil)  # the manifest matches: only the reader stands in the way
    with pytest.raises(CheckpointError, match="never holds"):
        store.verify(step)
    with pytest.raises(CheckpointError, match="never holds"):
        store.load(ckpt.Checkpoint(1, step, {}), _zeros(_state()))
    with pytest.raises(CheckpointError, match="never holds"):
        SafeFileSystemReader(step).read_metadata()
    assert not marker.exists()
    for data, message in (
        (_CLASS_STATE, "sets the state of a type"),
        (_DEEP_KEY, "keys a dict by a tuple"),
        (b"\x80\x04K\x01.", "not a Metadata"),
        (b"garbage", "not a DCP metadata file"),
    ):
        with pytest.raises(CheckpointError, match=message):
            unpickle_metadata(data, "x")
    from torch.distributed.checkpoint.metadata import Metadata

    assert callable(Metadata.__eq__)  # the class-state BUILD was refused before it ran


@pytest.mark.parametrize(
    ("forge", "message"),
    [(_traversal, "not a file name inside"), (_bytes_entry, "as bytes, not a tensor")],
)
def test_forged_metadata_is_refused_before_reading(store: CheckpointStore, forge, message) -> None:
    step = store.save(1, _state(), {}).wait().path
    _replace_metadata(step, forge(step))
    with pytest.raises(CheckpointError, match=message):
        store.load(ckpt.Checkpoint(1, step, {}), _zeros(_state()))


def test_metadata_and_manifest_sizes_are_bounded(store: CheckpointStore) -> None:
    from portable import limits

    step = store.save(1, _state(), {}).wait().path
    with limits.override(max_json_bytes=100):
        with pytest.raises(CheckpointError, match="over the limit"):
            read_metadata(step)
        with pytest.raises(CheckpointError, match="over 100 bytes"):
            store.verify(step)


# --------------------------------------------------------------------------- failures


def _no_space(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("where", ["shards", "manifest"])
def test_full_disk_keeps_the_previous_checkpoint(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    state = _state()
    store.save(1, state, {"n": 1})
    store.save(2, state, {"n": 2})
    if where == "shards":
        monkeypatch.setattr(filesystem, "_write_item", _no_space)
    else:
        monkeypatch.setattr(checkpoint_manifest, "_write_json", _no_space)
    for step in (3, 2):  # a new step, and a replacement of a committed one
        with pytest.raises(
            CheckpointError, match=f"could not write checkpoint step-{step}: No space left"
        ) as info:
            store.save(step, _zeros(state), {"n": "lost"})
        assert "free space" in str(info.value) and "intact" in str(info.value)
        assert _listing(store.root) == ["step-1", "step-2"]  # staging dir and lock removed
    latest = store.latest()
    assert latest is not None and (latest.step, latest.meta) == (2, {"n": 2})
    targets = _zeros(state)
    store.load(latest, targets)
    assert torch.equal(targets["blocks.0.attn.qkv.weight"], state["blocks.0.attn.qkv.weight"])


def test_load_refuses_another_program(store: CheckpointStore) -> None:
    checkpoint = store.save(1, _state(), {}).wait().path
    found = store.verify(checkpoint)
    bad_shape = dict(_zeros(_state()), **{"blocks.0.attn.qkv.weight": torch.zeros(4, 6)})
    with pytest.raises(CheckpointError, match=r"\[6, 4\] float32, the program has \[4, 6\]"):
        store.load(found, bad_shape)
    bad_dtype = {"norm.weight": torch.zeros(4)}
    with pytest.raises(CheckpointError, match="bfloat16, the program has .* another program"):
        store.load(found, bad_dtype)
    missing = {"optimizer.blocks.9.w.exp_avg": torch.zeros(2)}
    with pytest.raises(CheckpointError, match="no 'optim.blocks.9.w.exp_avg'"):
        store.load(found, missing)
    with pytest.raises(CheckpointError, match="not JSON"):
        store.save(2, _state(), {"x": float("nan")})


# --------------------------------------------------------------------------- async


def test_async_save_returns_before_writing_and_copies_the_state(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _state()
    expected = {k: v.clone() for k, v in state.items()}
    release = threading.Event()
    original = filesystem._write_item

    def slow_write(*args: object, **kwargs: object) -> object:
        assert release.wait(30)
        return original(*args, **kwargs)

    monkeypatch.setattr(filesystem, "_write_item", slow_write)
    pending = store.save(1, state, {"n": 1}, async_=True)
    assert not pending.done()
    for value in state.values():  # the caller's next step overwrites its tensors
        value.zero_() if value.dtype != torch.bool else value.fill_(False)
    assert store.latest() is None  # nothing committed yet
    release.set()
    saved = pending.wait()
    assert pending.done() and saved.step == 1
    targets = _zeros(state)
    store.load(saved, targets)
    for key, value in expected.items():
        assert torch.equal(targets[key], value), key

    monkeypatch.setattr(filesystem, "_write_item", _no_space)
    failed = store.save(2, state, {}, async_=True)
    with pytest.raises(CheckpointError, match="step-2: No space left"):
        failed.wait()
    unwaited = store.save(3, state, {}, async_=True)  # fails too, and nobody waits for it
    while not unwaited.done():
        time.sleep(0.005)
    monkeypatch.setattr(filesystem, "_write_item", original)
    with pytest.raises(CheckpointError, match="step-3: No space"):  # the next save reports it
        store.save(4, state, {}, async_=True)
    store.save(4, state, {}, async_=True)  # reported once: this one goes ahead
    store.save(5, state, {})  # and is waited for before this one starts
    assert _listing(store.root) == ["step-1", "step-4", "step-5"]


# --------------------------------------------------------------------------- plain DCP


PLAIN_LOAD = """
import sys, torch, torch.distributed.checkpoint as dcp
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Module()
        self.attn.qkv = torch.nn.Linear(4, 6, bias=False)
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block()])
        self.norm = torch.nn.LayerNorm(4, bias=False, dtype=torch.bfloat16)
model = Model()
state = model.state_dict()
dcp.load(state, checkpoint_id=sys.argv[1])
model.load_state_dict(state)
expected = torch.load(sys.argv[2], weights_only=True)
assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
assert "portable" not in sys.modules
print("ok")
"""


def test_plain_dcp_loads_a_checkpoint_without_portable(
    store: CheckpointStore, tmp_path: Path
) -> None:
    state = _state()
    step = store.save(1, state, {}).wait().path
    weights = {k: state[k] for k in ("blocks.0.attn.qkv.weight", "norm.weight")}
    torch.save(weights, tmp_path / "expected.pt")
    run = subprocess.run(
        [sys.executable, "-c", PLAIN_LOAD, str(step), str(tmp_path / "expected.pt")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


# --------------------------------------------------------------------------- several ranks


def _spawn(
    fn_name: str, nprocs: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, list[dict]]:
    import torch.multiprocessing as mp

    from tests.support import checkpoint_ranks

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))  # spawned ranks import it

    root, out = tmp_path / "checkpoints", tmp_path / "out"
    out.mkdir()
    fn = getattr(checkpoint_ranks, fn_name)
    mp.spawn(fn, args=(str(tmp_path / "store"), str(root), str(out)), nprocs=nprocs)
    return root, [json.loads((out / f"rank{r}.json").read_text()) for r in range(nprocs)]


def test_two_ranks_save_shards_and_reshard_on_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.support.checkpoint_ranks import STEP, V, W

    root, docs = _spawn("two_ranks", 2, tmp_path, monkeypatch)
    for doc in docs:
        assert doc["replicate_ok"] and doc["shard1_ok"] and doc["step_ok"], doc
        assert doc["async_step"] == 6 and doc["latest"] == 6
        assert doc["full_disk"].startswith("could not write checkpoint step-7: No space left")
        assert doc["listing"] == ["step-5", "step-6"]
    assert docs[0]["full_disk"] == docs[1]["full_disk"]
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(root / "step-5"))

    # DP=2 -> one process without torch.distributed: whole tensors
    store = CheckpointStore(root)
    latest = store.latest()
    assert latest is not None and latest.step == 6
    whole = {
        "blocks.0.attn.qkv.weight": torch.zeros(8, 6),
        "norm.weight": torch.zeros(6).bfloat16(),
    }
    whole["optimizer.step"] = torch.tensor(0)
    store.load(store.verify(root / "step-5"), whole)
    assert torch.equal(whole["blocks.0.attn.qkv.weight"], W)
    assert torch.equal(whole["norm.weight"], V) and torch.equal(whole["optimizer.step"], STEP)


def test_four_ranks_dtensors_match_portable_sharding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from portable.ir.plan import Mesh
    from portable.ir.sharding import coords_of

    root, docs = _spawn("four_ranks", 4, tmp_path, monkeypatch)
    mesh = Mesh({"dp": 2, "tp": 2})
    for rank, doc in enumerate(docs):
        assert doc["coordinate"] == [coords_of(mesh, rank)["dp"], coords_of(mesh, rank)["tp"]]
        assert doc["both_dim0"] and doc["tp_dp"] and doc["dp_only"], doc
        assert "not in the mesh's axis order" in doc["reversed"]
        assert "cannot be checkpointed" in doc["partial"]
    # the 4-way split of dim 0 read back whole by one process
    store = CheckpointStore(root)
    target = {"w": torch.zeros(8, 6)}
    store.load(store.verify(root / "step-1"), target)
    assert torch.equal(target["w"], torch.arange(48, dtype=torch.float32).reshape(8, 6))


# --------------------------------------------------------------------------- Hugging Face


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory: pytest.TempPathFactory):
    transformers = pytest.importorskip("transformers")
    from tests.conftest import _HF_COMMON, _LLAMA_SIZES

    torch.manual_seed(0)
    made = {}
    for tied in (False, True):
        config = transformers.LlamaConfig(**_HF_COMMON, **_LLAMA_SIZES, tie_word_embeddings=tied)
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        path = tmp_path_factory.mktemp(f"llama_tied_{tied}")
        model.save_pretrained(path, max_shard_size="60KB")
        made[tied] = (path, {k: v.clone() for k, v in model.state_dict().items()})
    single = tmp_path_factory.mktemp("llama_single")
    model.save_pretrained(single)
    made["single"] = (single, made[True][1])
    return made


def test_hf_sharded_checkpoint_reads_only_this_ranks_slices(llama_dirs, monkeypatch) -> None:
    import safetensors

    path, weights = llama_dirs[False]
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) >= 2
    opened = []
    real_open = safetensors.safe_open
    monkeypatch.setattr(
        safetensors, "safe_open", lambda f, **kw: opened.append(f) or real_open(f, **kw)
    )
    names = ["model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"]
    for rank in (0, 1):
        wanted = {}
        for name in names:
            rows = weights[name].shape[0] // 2
            wanted[name] = HfTensor(
                tuple(weights[name].shape), torch.float32, (slice(rank * rows, (rank + 1) * rows),)
            )
        got = read_hf_checkpoint(path, wanted)
        for name in names:
            expected = weights[name][wanted[name].index].float()
            assert got[name].dtype == torch.float32 and torch.equal(got[name], expected)
    assert {Path(f).name for f in opened} == {index[n] for n in names}
    assert len({index[n] for n in names}) < len(set(index.values()))


def test_hf_tied_weights_need_their_alias(llama_dirs) -> None:
    path, weights = llama_dirs[True]
    shape = tuple(weights["model.embed_tokens.weight"].shape)
    wanted = {"lm_head.weight": HfTensor(shape, torch.bfloat16, (slice(0, 64), slice(0, 32)))}
    with pytest.raises(CheckpointError, match=r"no tensor 'lm_head.weight'.*model-0000"):
        read_hf_checkpoint(path, wanted)
    aliases = {"lm_head.weight": "model.embed_tokens.weight"}
    for directory in (path, llama_dirs["single"][0]):
        got = read_hf_checkpoint(directory, wanted, aliases=aliases)
        assert torch.equal(got["lm_head.weight"], weights["model.embed_tokens.weight"][:64, :32])


def test_hf_bad_directories_are_refused(llama_dirs, tmp_path: Path) -> None:
    import shutil

    source, weights = llama_dirs[False]
    name = "model.norm.weight"
    good = {name: HfTensor(tuple(weights[name].shape), torch.float32, ())}
    with pytest.raises(CheckpointError, match=r"wants \[3\]"):
        read_hf_checkpoint(source, {name: HfTensor((3,), torch.float32, ())})
    with pytest.raises(CheckpointError, match="only floating dtypes are cast"):
        read_hf_checkpoint(source, {name: HfTensor(good[name].shape, torch.int64, ())})
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    file = index["weight_map"][name]
    index["weight_map"][name] = "../x.safetensors"
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="not a plain file name inside the directory"):
        read_hf_checkpoint(bad, good)
    index["weight_map"][name] = file
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    (bad / file).unlink()
    (bad / file).symlink_to(source / file)  # a link out of the directory
    with pytest.raises(CheckpointError, match="symlink out of"):
        read_hf_checkpoint(bad, good)
    (bad / file).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        read_hf_checkpoint(bad, good)


def test_safe_reader_reads_what_dcp_reads(tmp_path: Path) -> None:
    state = _state()
    dcp.save(state, checkpoint_id=tmp_path / "plain")  # a Path: the pickle holds a PosixPath
    safe = read_metadata(tmp_path / "plain")
    unsafe = dcp.FileSystemReader(tmp_path / "plain").read_metadata()
    assert safe.state_dict_metadata == unsafe.state_dict_metadata
    assert safe.storage_data == unsafe.storage_data and safe.planner_data == unsafe.planner_data
    targets = _zeros(state)
    dcp.load(targets, storage_reader=SafeFileSystemReader(tmp_path / "plain"), no_dist=True)
    assert all(torch.equal(targets[k], v) for k, v in state.items())
