"""Activation checkpointing (`remat`): activation memory, peak memory and time of a training step.

    python benchmarks/remat_memory.py [--layers 6 --width 64 --seq 512] [--threads 1]
                                      [--write docs/performance.md]

The GPT example (examples/gpt.py: pre-LayerNorm blocks, attention written out, GELU MLP, AdamW)
sized so activations dominate: a long sequence and a small width. One capture, as it is (attention
written out: the L x L scores are `bmm` results, which `selective` saves) and after
`softmax-fusion` (one `portable::attention`); each after `remat{policy=P}` for P in none,
selective, save-matmuls, full; in the same run, on the `cpu` backend:

- activation memory: bytes of forward values live when the backward starts (just before its
  first op), measured on real storages (`portable.testing.memory`: a weakref finalizer on every
  storage an op returns) and given statically by `portable.ir.liveness`; the two must agree.
  Goal: full <= 0.4x none;
- peak memory of the step: the most bytes of op-made storages live at once, measured and
  static (the parameters, optimizer state and batch are the caller's and not counted);
- time of a step: the `cpu` executable's median step, policies interleaved round by round,
  garbage collection off while timing (as timeit). Goal: full <= 1.4x none;
- the losses and updated state of every policy are compared with none's, bit for bit.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
MARK = "<!-- remat_memory -->"
POLICIES = ("none", "selective", "save-matmuls", "full")
WRITTEN, FUSED = "written out", "softmax-fusion"
GOALS = {"activations": 0.4, "time": 1.4}  # full / none


def _gpt_module():
    spec = importlib.util.spec_from_file_location("_bench_gpt", REPO / "examples" / "gpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def capture(layers: int, width: int, heads: int, seq: int, batch: int):
    """The GPT example's AdamW training step at this size, and its flat inputs."""
    import portable

    gpt = _gpt_module()
    config = gpt.GPTConfig(
        vocab_size=128, block_size=seq, n_layer=layers, n_head=heads, n_embd=width
    )
    torch.manual_seed(0)
    model = gpt.GPT(config)
    data = (torch.randint(0, 128, (batch, seq)), torch.randint(0, 128, (batch, seq)))
    program = portable.capture(
        model,
        data,
        loss_fn=lambda m, idx, targets: F.cross_entropy(m(idx).flatten(0, 1), targets.flatten()),
        optimizer=portable.optim.AdamW(lr=1e-3),
    )
    state = [program.weights[i.target] for i in program.signature.state_inputs]
    return program, [*state, *data], data


def _first_backward(program) -> int:
    from portable.passes.remat import step_parts

    parts = step_parts(program)
    nodes = list(program.graph.nodes)
    return next(k for k, n in enumerate(nodes) if n in parts.phase and not parts.is_forward(n))


def memory(program, flat) -> dict:
    """Measured and static activation memory (at the backward's start) and peak of one step."""
    from portable.ir.liveness import liveness
    from portable.testing.memory import measure_memory

    static = liveness(program.graph)
    measured = measure_memory(program, flat)
    k = _first_backward(program)
    return {
        "activations": measured.live_before[k],
        "activations_static": static.live_before(k),
        "peak": measured.peak_bytes,
        "peak_static": static.peak_bytes,
        "outputs": measured.outputs,
    }


def step_times(programs: dict, data, repeat: int) -> dict[str, float]:
    """Median seconds of a `cpu` step per policy, the policies interleaved round by round."""
    import portable

    exes = {name: portable.compile(p, backend="cpu") for name, p in programs.items()}
    for exe in exes.values():
        exe(*data)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in exes}
    gc.collect()
    gc.disable()  # as timeit does: a collection of the programs' graphs is not the step's cost
    try:
        for _ in range(repeat):
            for name, exe in exes.items():
                start = time.perf_counter()
                exe(*data)
                times[name].append(time.perf_counter() - start)
    finally:
        gc.enable()
    return {name: statistics.median(t) for name, t in times.items()}


def policies(program, flat, data, repeat: int) -> dict:
    """policy -> its row (memory, recomputed ops, bit-identical to none, step time)."""
    from portable.passes import get_pass

    programs, rows = {}, {}
    for policy in POLICIES:
        result = get_pass("remat", policy=policy).apply(program)
        programs[policy] = result.program
        row = memory(result.program, flat)
        counts = result.report.counts
        row["saved_report"] = counts.get("saved_bytes_after", counts["saved_bytes_before"])
        row["recomputed"] = counts["recomputed"]
        rows[policy] = row
    base = rows["none"]["outputs"]
    for row in rows.values():
        row["identical"] = all(
            torch.equal(a, b) for a, b in zip(row.pop("outputs"), base, strict=True)
        )
    for policy, seconds in step_times(programs, data, repeat).items():
        rows[policy]["time_s"] = seconds
    return rows


def measure(layers: int, width: int, heads: int, seq: int, batch: int, repeat: int) -> dict:
    """Every policy on the capture as it is (attention written out) and after `softmax-fusion`
    (one `portable::attention`, which `selective` saves and `save-matmuls` recomputes)."""
    from portable.passes import get_pass

    program, flat, data = capture(layers, width, heads, seq, batch)
    fused = get_pass("softmax-fusion").apply(program).program
    variants = {
        WRITTEN: policies(program, flat, data, repeat),
        FUSED: policies(fused, flat, data, repeat),
    }
    config = {"layers": layers, "width": width, "heads": heads, "seq": seq, "batch": batch}
    return {"config": config, "variants": variants}


def _ratio(rows: dict, policy: str, key: str) -> float:
    return rows[policy][key] / (rows["none"][key] or 1)


def _goals(name: str, rows: dict) -> str:
    act, step = _ratio(rows, "full", "activations"), _ratio(rows, "full", "time_s")
    return (
        f"{name}, full / none: activations {act:.3f} (goal <= {GOALS['activations']}: "
        f"{'met' if act <= GOALS['activations'] else 'not met'}), step time {step:.3f} "
        f"(goal <= {GOALS['time']}: {'met' if step <= GOALS['time'] else 'not met'})"
    )


def table(result: dict) -> str:
    c, variants = result["config"], result["variants"]
    mib = 1 << 20
    lines = [
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; GPT example, "
        f"{c['layers']} layers x {c['width']} wide, {c['heads']} heads, batch {c['batch']} x "
        f"{c['seq']} tokens, AdamW training step, `cpu` backend",
        "",
        "| attention | policy | activations (MiB) | / none | peak (MiB) | / none | step (ms) | "
        "/ none | recomputed ops | bit-identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in variants.items():
        for policy, r in rows.items():
            lines.append(
                f"| {name} | {policy} | {r['activations'] / mib:.1f} | "
                f"{_ratio(rows, policy, 'activations'):.3f} | {r['peak'] / mib:.1f} | "
                f"{_ratio(rows, policy, 'peak'):.3f} | {r['time_s'] * 1e3:.1f} | "
                f"{_ratio(rows, policy, 'time_s'):.3f} | {r['recomputed']} | {r['identical']} |"
            )
    agree = all(
        r["activations"] == r["activations_static"] and r["peak"] == r["peak_static"]
        for rows in variants.values()
        for r in rows.values()
    )
    lines += ["", *(_goals(name, rows) + ";" for name, rows in variants.items())]
    lines.append(f"measured storages equal the static liveness walk at every policy: {agree}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--write", type=Path, help="update this markdown file's block")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = measure(args.layers, args.width, args.heads, args.seq, args.batch, args.repeat)
    text = table(result)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.write:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from cpu_overhead import write

        write(args.write, text, MARK)
    return 0


if __name__ == "__main__":
    sys.exit(main())
