"""Per-rank collective latencies by op and message size, and the runtime wrapper that times them.

Message size is the bytes of the tensor this rank passes in (its shard for all_gather, its
whole buffer for all_reduce / reduce_scatter / all_to_all), bucketed by powers of two: bucket
`2^k` holds sizes in [2^k, 2^(k+1)) (0 bytes counts as `2^0`). Per bucket: the count, total
and maximum latency, p50 / p99 (nearest rank, over a uniform sample of at most `sample` latencies
per bucket, exact until then), and a histogram of latencies by powers of two of microseconds
(`latency_us`: `2^j` counts latencies in [2^j, 2^(j+1)) us), so memory stays bounded however
long the job runs.

A collective's **latency** is from its issue to the end of its wait; its **exposed** time is
what the rank spent blocked on it: the issue call plus the time inside `wait` (communication
the program overlapped with compute is not exposed).
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
import time
from collections.abc import Callable
from typing import Any

import torch

from ..errors import JobError

__all__ = ["COLLECTIVES", "CommStats", "TimedCollectives", "bucket_of", "comm_from_json"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
_MAX_PENDING = 4096  # issued, not yet waited; older entries are dropped past this


def bucket_of(nbytes: int) -> int:
    """k such that 2^k <= nbytes < 2^(k+1) (0 for 0 bytes)."""
    return max(int(nbytes), 1).bit_length() - 1


def _latency_bin(latency_s: float) -> int:
    return math.floor(math.log2(latency_s * 1e6)) if latency_s * 1e6 >= 1 else 0


@dataclasses.dataclass
class _Bucket:
    count: int = 0
    bytes: int = 0
    total_s: float = 0.0
    exposed_s: float = 0.0
    max_s: float = 0.0
    sample: list[float] = dataclasses.field(default_factory=list)
    latency_us: dict[int, int] = dataclasses.field(default_factory=dict)

    def add(
        self, nbytes: int, latency: float, exposed: float, keep: int, rng: random.Random
    ) -> None:
        self.count += 1
        self.bytes += nbytes
        self.total_s += latency
        self.exposed_s += exposed
        self.max_s = max(self.max_s, latency)
        if len(self.sample) < keep:
            self.sample.append(latency)
        else:  # reservoir sampling: each latency so far is kept with probability keep/count
            slot = rng.randrange(self.count)
            if slot < keep:
                self.sample[slot] = latency
        j = _latency_bin(latency)
        self.latency_us[j] = self.latency_us.get(j, 0) + 1

    def to_json(self) -> dict[str, Any]:
        ordered = sorted(self.sample)
        return {
            "count": self.count,
            "bytes": self.bytes,
            "total_s": self.total_s,
            "exposed_s": self.exposed_s,
            "p50_s": percentile(ordered, 0.50),
            "p99_s": percentile(ordered, 0.99),
            "max_s": self.max_s,
            "latency_us": {f"2^{j}": n for j, n in sorted(self.latency_us.items())},
        }


def percentile(ordered: list[float], q: float) -> float | None:
    """The nearest-rank q-quantile of sorted values (None when there are none)."""
    if not ordered:
        return None
    return ordered[min(max(math.ceil(q * len(ordered)) - 1, 0), len(ordered) - 1)]


class CommStats:
    """Per-rank collective latencies by op and message size (log2 byte buckets)."""

    def __init__(self, *, sample: int = 1024, seed: int = 0) -> None:
        self.sample = sample
        self._rng = random.Random(seed)
        self._ops: dict[str, dict[int, _Bucket]] = {}
        self._comm_s = 0.0
        self._exposed_s = 0.0
        self._step_comm_s = 0.0
        self._step_exposed_s = 0.0

    def record(self, op: str, nbytes: int, latency_s: float, exposed_s: float) -> None:
        """One collective of `op` on `nbytes` bytes: `latency_s` issue to done, `exposed_s`
        of it the rank spent blocked."""
        if not (nbytes >= 0 and latency_s >= 0 and exposed_s >= 0):
            raise JobError(
                f"collective {op}: bytes {nbytes}, latency {latency_s}s and exposed "
                f"{exposed_s}s must be non-negative"
            )
        buckets = self._ops.setdefault(op, {})
        bucket = buckets.setdefault(bucket_of(nbytes), _Bucket())
        bucket.add(int(nbytes), float(latency_s), float(exposed_s), self.sample, self._rng)
        self._comm_s += latency_s
        self._exposed_s += exposed_s
        self._step_comm_s += latency_s
        self._step_exposed_s += exposed_s

    def to_json(self) -> dict[str, Any]:
        ops: dict[str, Any] = {}
        for op, buckets in sorted(self._ops.items()):
            docs = {f"2^{k}": b.to_json() for k, b in sorted(buckets.items())}
            ops[op] = {
                "count": sum(b.count for b in buckets.values()),
                "bytes": sum(b.bytes for b in buckets.values()),
                "total_s": sum(b.total_s for b in buckets.values()),
                "exposed_s": sum(b.exposed_s for b in buckets.values()),
                "buckets": docs,
            }
        return {"ops": ops, "comm_s": self._comm_s, "exposed_s": self._exposed_s}

    def step_totals(self) -> tuple[float, float]:
        """(comm_s, exposed_s) recorded since the last call."""
        totals = (self._step_comm_s, self._step_exposed_s)
        self._step_comm_s = self._step_exposed_s = 0.0
        return totals


_BUCKET = re.compile(r"2\^(-?\d{1,3})")


def comm_from_json(doc: Any) -> dict[str, dict[int, dict[str, Any]]]:
    """op -> k (bucket 2^k) -> {count, total_s, p50_s, p99_s, max_s: number or None,
    latency_us: {j: count}} from a `CommStats.to_json()` document read from a file. Nothing in
    it is trusted: entries of the wrong shape are left out, numbers must be finite, op names
    are cut to 64 characters."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for op, entry in _items(doc.get("ops") if isinstance(doc, dict) else None):
        for bucket, b in _items(entry.get("buckets") if isinstance(entry, dict) else None):
            match = _BUCKET.fullmatch(bucket)
            if match is None or not isinstance(b, dict):
                continue
            keys = ("count", "total_s", "p50_s", "p99_s", "max_s")
            stats: dict[str, Any] = {k: _number(b.get(k)) for k in keys}
            bins = [(_BUCKET.fullmatch(j), _number(n)) for j, n in _items(b.get("latency_us"))]
            stats["latency_us"] = {int(m[1]): n for m, n in bins if m and n is not None}
            out.setdefault(op[:64], {})[int(match[1])] = stats
    return out


def _items(value: Any) -> list[tuple[str, Any]]:
    return [(str(k), v) for k, v in value.items()] if isinstance(value, dict) else []


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


@dataclasses.dataclass(frozen=True)
class _Issued:
    op: str
    nbytes: int
    start: float
    issue_s: float
    result: Any  # held so its id is not reused while it is in flight


class TimedCollectives:
    """Wraps a CollectiveRuntime (portable/opset/collectives.py protocol; the torch one is
    portable/distributed/runtime.py TorchCollectives, whose collectives are async functional
    collectives completed at `wait`) and records each collective: latency = issue -> wait done,
    exposed = time blocked inside `wait` (plus issue time). Delegates everything."""

    def __init__(
        self, inner: Any, stats: CommStats, *, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.inner = inner
        self.stats = stats
        self._clock = clock
        self._pending: dict[int, _Issued] = {}

    def _issue(self, op: str, x: torch.Tensor, *args: Any) -> Any:
        start = self._clock()
        out = getattr(self.inner, op)(x, *args)
        issued = _Issued(op, x.numel() * x.element_size(), start, self._clock() - start, out)
        if len(self._pending) >= _MAX_PENDING:  # never waited: forget the oldest
            del self._pending[next(iter(self._pending))]
        self._pending[id(out)] = issued
        return out

    def all_reduce(self, x: torch.Tensor, reduce_op: str, axis: str, group_size: int) -> Any:
        return self._issue("all_reduce", x, reduce_op, axis, group_size)

    def all_gather(self, x: torch.Tensor, dim: int, axis: str, group_size: int) -> Any:
        return self._issue("all_gather", x, dim, axis, group_size)

    def reduce_scatter(
        self, x: torch.Tensor, reduce_op: str, dim: int, axis: str, group_size: int
    ) -> Any:
        return self._issue("reduce_scatter", x, reduce_op, dim, axis, group_size)

    def all_to_all(
        self, x: torch.Tensor, split_dim: int, concat_dim: int, axis: str, group_size: int
    ) -> Any:
        return self._issue("all_to_all", x, split_dim, concat_dim, axis, group_size)

    def local_shard(self, x: torch.Tensor, dim: int, axis: str, group_size: int) -> Any:
        """A local slice: no communication, not recorded."""
        return self.inner.local_shard(x, dim, axis, group_size)

    def wait(self, x: torch.Tensor) -> Any:
        issued = self._pending.pop(id(x), None)
        start = self._clock()
        out = self.inner.wait(x)
        done = self._clock()
        if issued is not None:
            exposed = issued.issue_s + (done - start)
            self.stats.record(issued.op, issued.nbytes, done - issued.start, exposed)
        return out

    def __getattr__(self, name: str) -> Any:  # only for names this class does not define
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
