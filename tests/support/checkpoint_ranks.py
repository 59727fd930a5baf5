"""Rank functions for tests/test_jobs_checkpoint.py, run by torch.multiprocessing.spawn over gloo.

Each rank writes what it saw to `out/rank<r>.json` (the test asserts on those); a rank that
raises fails the spawn with its traceback.
"""

from __future__ import annotations

import datetime
import errno
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from portable.errors import CheckpointError
from portable.ir.plan import Mesh
from portable.ir.sharding import Sharding, shard
from portable.jobs import checkpoint as ckpt

W = torch.arange(48, dtype=torch.float32).reshape(8, 6) / 7  # a weight, saved Shard(0)
V = torch.arange(6, dtype=torch.bfloat16)  # replicated
STEP = torch.tensor(5, dtype=torch.int64)  # a replicated plain tensor
ROW = Sharding((("dp",), ()))
COL = Sharding(((), ("dp",)))


def _init(rank: int, world: int, store_file: str) -> None:
    store = dist.FileStore(store_file, world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )


def _report(out: str, rank: int, doc: dict[str, Any]) -> None:
    Path(out, f"rank{rank}.json").write_text(json.dumps(doc))


def two_ranks(rank: int, store_file: str, root: str, out: str) -> None:
    """Save Shard(0) halves (sync, then async with the tensors changed right after the call,
    then a save that fails on rank 1 only), and load back as Replicate and as Shard(1)."""
    _init(rank, 2, store_file)
    mesh = Mesh({"dp": 2})
    dm = ckpt.device_mesh(mesh)
    store = ckpt.CheckpointStore(root, keep=3)
    local = shard(W, ROW, mesh, rank)
    state = {
        "blocks.0.attn.qkv.weight": ckpt.to_dtensor(local.clone(), ROW, mesh, dm),
        "norm.weight": ckpt.to_dtensor(V.clone(), Sharding.replicated(1), mesh, dm),
        "optimizer.step": STEP.clone(),
    }
    saved = store.save(5, state, {"program": "p", "rank_count": 2}).wait()
    doc: dict[str, Any] = {"saved": str(saved.path)}

    # async: the call returns once staged; changing the tensors then does not change the save
    pending = store.save(6, state, {"program": "p"}, async_=True)
    state["blocks.0.attn.qkv.weight"].to_local().add_(100.0)
    doc["async_step"] = pending.wait().step

    # Replicate targets: every rank gets the whole tensor
    whole = {
        "blocks.0.attn.qkv.weight": ckpt.to_dtensor(
            torch.zeros(8, 6), Sharding.replicated(2), mesh, dm
        ),
        "optimizer.step": torch.tensor(0),
    }
    store.load(store.verify(Path(root) / "step-6"), whole)
    doc["replicate_ok"] = bool(torch.equal(whole["blocks.0.attn.qkv.weight"].to_local(), W))
    doc["step_ok"] = int(whole["optimizer.step"]) == 5

    # Shard(1): another plan of the same weight
    cols = {"blocks.0.attn.qkv.weight": ckpt.to_dtensor(torch.zeros(8, 3), COL, mesh, dm)}
    store.load(saved, cols)
    expected = shard(W, COL, mesh, rank)
    doc["shard1_ok"] = bool(torch.equal(cols["blocks.0.attn.qkv.weight"].to_local(), expected))

    # a disk that fills up on rank 1 only: every rank raises the same error, nothing committed
    doc["full_disk"] = _full_disk_on(rank, 1, lambda: store.save(7, state, {"program": "p"}))
    doc["listing"] = sorted(p.name for p in Path(root).iterdir())
    doc["latest"] = store.latest().step  # type: ignore[union-attr]
    _report(out, rank, doc)
    dist.destroy_process_group()


def _full_disk_on(rank: int, failing: int, save: Any) -> str:
    from torch.distributed.checkpoint import filesystem

    original = filesystem._write_item

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    filesystem._write_item = full if rank == failing else original  # type: ignore[assignment]
    try:
        save()
    except CheckpointError as exc:
        return str(exc)
    finally:
        filesystem._write_item = original  # type: ignore[assignment]
    return "no error"


def four_ranks(rank: int, store_file: str, root: str, out: str) -> None:
    """A 2x2 mesh: DTensors from to_dtensor hold what portable's `shard` gives each rank (a dim
    split by both axes, major first), and the refusals; then a save of the 4-way split."""
    _init(rank, 4, store_file)
    mesh = Mesh({"dp": 2, "tp": 2})
    dm = ckpt.device_mesh(mesh)
    value = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    doc: dict[str, Any] = {"coordinate": list(dm.get_coordinate())}
    for name, sharding in {
        "both_dim0": Sharding((("dp", "tp"), ())),
        "tp_dp": Sharding((("tp",), ("dp",))),
        "dp_only": Sharding((("dp",), ())),
    }.items():
        dt = ckpt.to_dtensor(shard(value, sharding, mesh, rank), sharding, mesh, dm)
        doc[name] = bool(torch.equal(dt.full_tensor(), value)) and tuple(dt.shape) == (8, 6)
    for name, sharding in {
        "reversed": Sharding((("tp", "dp"), ())),
        "partial": Sharding(((), ()), (("dp", "sum"),)),
    }.items():
        try:
            ckpt.to_dtensor(value, sharding, mesh, dm)
            doc[name] = "no error"
        except CheckpointError as exc:
            doc[name] = str(exc)
    both = Sharding((("dp", "tp"), ()))
    state = {"w": ckpt.to_dtensor(shard(value, both, mesh, rank), both, mesh, dm)}
    ckpt.CheckpointStore(root).save(1, state, {"program": "p"})
    _report(out, rank, doc)
    dist.destroy_process_group()
