"""Exposed communication with and without `comm-overlap`: 2-process gloo data-parallel GPT.

    python benchmarks/comm_overlap.py [--layers 8 --width 256 --steps 5] [--json R] [--write MD]

A GPT (examples/gpt.py) with a larger config, captured as a training step (AdamW), partitioned
for data parallelism over 2 ranks (`Plan(Mesh({"dp": 2}), batch_axes=("dp",))`), run by two
processes on gloo with one torch thread each, on the `portable.distributed` runtime
(`TorchCollectives`: collectives run asynchronously until their `portable.wait`). In the same
run, interleaved round by round, each rank times one step (median over steps and rounds) of:

- `baseline`: the per-rank program as `spmd-partition` leaves it (each gradient's all-reduce
  issued right before its use, waited at once);
- `overlap`: the same program after `comm-overlap{bucket_mb=...}`;
- `compute-only`: the baseline with every collective replaced by a local op of the same shape
  (all-reduce -> clone, all-gather -> cat of copies, reduce-scatter -> slice; waits removed).

Exposed communication = step time - compute-only step time. Goal: overlap's exposed time at most
half the baseline's. Both variants start from the same state; their losses must be identical.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
MARK = "<!-- comm_overlap -->"
VARIANTS = ("baseline", "overlap", "compute-only")


def programs(layers: int, width: int, batch: int, seq: int, bucket_mb: float):
    """{variant: per-rank program}, the global flat inputs, and the pass report."""
    import importlib.util

    import portable
    from portable import Mesh, Plan
    from portable.passes.comm_overlap import CommOverlap
    from portable.passes.spmd_partition import partition

    spec = importlib.util.spec_from_file_location("_bench_gpt", REPO / "examples" / "gpt.py")
    gpt = importlib.util.module_from_spec(spec)
    sys.modules["_bench_gpt"] = gpt
    spec.loader.exec_module(gpt)
    config = gpt.GPTConfig(
        vocab_size=1024, block_size=seq, n_layer=layers, n_head=max(1, width // 64), n_embd=width
    )
    torch.manual_seed(0)
    model = gpt.GPT(config)
    batch_data = (
        torch.randint(0, config.vocab_size, (batch, seq)),
        torch.randint(0, config.vocab_size, (batch, seq)),
    )
    spec_ = portable.spec_of(gpt.GPT)
    program = portable.capture(
        model, batch_data, loss_fn=spec_.loss_fn, optimizer=spec_.optimizer, name="gpt"
    )
    per_rank, _ = partition(program.replace(plan=Plan(Mesh({"dp": 2}), batch_axes=("dp",))))
    result = CommOverlap(bucket_mb=bucket_mb).apply(per_rank)
    state = [program.weights[i.target] for i in program.signature.state_inputs]
    return (
        {
            "baseline": per_rank,
            "overlap": result.program,
            "compute-only": compute_only(per_rank),
        },
        [*state, *batch_data],
        result.report,
    )


def compute_only(program):
    """The program with each collective replaced by a local op of the same result shape."""
    import torch.fx

    aten, ops = torch.ops.aten, torch.ops.portable
    out = program.replace()
    g = out.graph
    for node in list(g.nodes):
        if node.target is ops.wait.default:
            node.replace_all_uses_with(node.args[0])
            g.erase_node(node)
    for node in list(g.nodes):
        args = node.args
        if node.target is ops.all_reduce.default:
            new = (aten.clone.default, (args[0],))
        elif node.target is ops.all_gather.default:
            new = (aten.cat.default, ([args[0]] * args[3], args[1]))
        elif node.target is ops.reduce_scatter.default:
            size = node.meta["tensor"].shape[args[2]]
            new = (aten.slice.Tensor, (args[0], args[2], 0, size))
        else:
            continue
        with g.inserting_before(node):
            local = g.call_function(*new)
        local.meta.update({k: v for k, v in node.meta.items() if k in ("tensor", "val", "source")})
        node.replace_all_uses_with(local)
        g.erase_node(node)
    g.lint()
    out.graph_module.recompile()
    return out


# ---------------------------------------------------------------------------- one rank


def rank_main(args) -> None:
    import torch.distributed as dist

    import portable
    from portable.distributed import TorchCollectives
    from portable.ir.plan import Mesh
    from portable.ir.sharding import shard
    from portable.opset.collectives import collective_runtime

    torch.set_num_threads(1)
    variants, flat, report = programs(args.layers, args.width, args.batch, args.seq, args.bucket_mb)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=2
    )
    mesh = Mesh({"dp": 2})
    runtime = TorchCollectives(mesh)
    base = variants["baseline"]
    local = [
        shard(v, base.spmd.input(i.name).sharding, mesh, args.rank)
        for i, v in zip(base.signature.inputs, flat, strict=True)
    ]
    exes, users = {}, None
    for name, program in variants.items():
        sig = program.signature
        by_target = {
            i.target: v.clone() for i, v in zip(sig.inputs, local, strict=True) if i.target
        }
        weights = {k: by_target.get(k, w) for k, w in program.weights.items()}
        exes[name] = portable.compile(program.replace(weights=weights), backend="cpu")
        users = [v for i, v in zip(sig.inputs, local, strict=True) if i.kind.value == "user_input"]
    times: dict[str, list[float]] = {n: [] for n in VARIANTS}
    losses: dict[str, list[float]] = {n: [] for n in VARIANTS}
    with collective_runtime(runtime):
        for round_ in range(args.rounds + 1):  # round 0 warms up
            for name in VARIANTS:
                for _ in range(args.steps):
                    dist.barrier()
                    start = time.perf_counter()
                    loss = exes[name](*users).loss
                    elapsed = time.perf_counter() - start
                    if round_ > 0:
                        times[name].append(elapsed)
                    losses[name].append(float(loss))
    # each rank's median; the step time of the job is the slower rank's
    med = torch.tensor([statistics.median(times[n]) for n in VARIANTS], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    if args.rank == 0:
        step = dict(zip(VARIANTS, med.tolist(), strict=True))
        result = {
            "benchmark": "comm_overlap",
            "config": {
                k: getattr(args, k)
                for k in ("layers", "width", "batch", "seq", "bucket_mb", "steps", "rounds")
            },
            "step_s": step,
            "exposed_s": {n: step[n] - step["compute-only"] for n in ("baseline", "overlap")},
            "losses_identical": losses["baseline"] == losses["overlap"],
            "pass": report.counts,
        }
        base_exp, over_exp = result["exposed_s"]["baseline"], result["exposed_s"]["overlap"]
        result["exposed_ratio"] = over_exp / base_exp if base_exp > 0 else None
        Path(args.out).write_text(json.dumps(result) + "\n")
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- driver


def measure(args) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="comm-overlap-") as tmp:
        out = Path(tmp) / "result.json"
        common = [sys.executable, __file__, "--port", str(port), "--out", str(out)]
        for key in ("layers", "width", "batch", "seq", "bucket_mb", "steps", "rounds"):
            common += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [
            subprocess.Popen(
                [*common, "--rank", str(r)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(2)
        ]
        logs = [p.communicate(timeout=1800)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError("a rank failed:\n" + "\n".join(log[-3000:] for log in logs))
        return json.loads(out.read_text())


def table(r: dict) -> str:
    c = r["config"]
    lines = [
        f"GPT {c['layers']} layers x {c['width']} wide, global batch {c['batch']} x "
        f"{c['seq']} tokens, 2 ranks (gloo, 1 thread each), bucket_mb={c['bucket_mb']}",
        "",
        "| variant | step (ms) | exposed communication (ms) |",
        "|---|---|---|",
    ]
    for name in VARIANTS:
        exposed = r["exposed_s"].get(name)
        shown = f"{exposed * 1e3:.1f}" if exposed is not None else "-"
        lines.append(f"| {name} | {r['step_s'][name] * 1e3:.1f} | {shown} |")
    ratio = r["exposed_ratio"]
    lines += [
        "",
        f"exposed communication, overlap / baseline: {ratio:.2f} (goal <= 0.5)"
        if ratio is not None
        else "baseline exposes nothing",
        f"losses identical: {r['losses_identical']}; pass counts: "
        + ", ".join(f"{k}={v}" for k, v in r["pass"].items()),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--bucket-mb", dest="bucket_mb", type=float, default=4.0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--write", type=Path, help="update this markdown file's block")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        rank_main(args)
        return 0
    result = measure(args)
    text = table(result)
    print(text)
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.write:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from cpu_overhead import write

        write(args.write, text, MARK)
    return 0


if __name__ == "__main__":
    sys.exit(main())
