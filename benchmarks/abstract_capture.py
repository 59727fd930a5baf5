"""Abstract capture at full scale: Llama-3-70B and Llama-3.1-405B training steps captured from
`meta`-device models and partitioned for 144 chips.

    python benchmarks/abstract_capture.py [--models 70b,405b] [--smoke] [--neuron]
                                          [--json out.json] [--write docs/abstract-capture.md
                                           --write docs/performance.md]

Each model runs in a fresh process (so its peak RSS is its own, imports included):

1. `transformers.LlamaForCausalLM(config)` under `torch.device("meta")`: no weight has data;
2. `portable.capture` of one training step: AdamW, loss = cross entropy of the logits, bfloat16
   compute (`Precision(compute="bfloat16")`: fp32 master weights), `remat="selective"`, a batch
   of 18 sequences of 2048 tokens (one per data-parallel rank): the abstract program
   (docs/abstract-capture.md; the deep stack is traced as 5 layers and the middle one repeated);
3. `spmd-partition` under mesh dp=18 x tp=8 (144 chips): Megatron tensor parallelism with the
   presets of portable/parallel.py (attention head-parallel, MLP column/row-parallel, the
   embedding vocab-parallel, the LM head column-parallel), batch split over dp;
4. with `--neuron`, the per-rank program lowered for `neuron:trn3` on the Gen2 UltraServer
   topology (HLO and the offline validator; its findings are recorded, not raised).

Recorded: wall and CPU seconds of each step, the peak RSS of the process after the partition
(and after the neuron lowering), node counts and the parameter count. Goal (issue 19): 70B capture + partition in under 60 s and 4 GiB here. Wall
time depends on what else the machine runs; CPU seconds less so. `--smoke` runs a 7-layer
Llama of width 64 under dp=2 x tp=2 (what tests/test_benchmarks.py runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MARK = "<!-- abstract_capture -->"
GOAL_SECONDS, GOAL_BYTES = 60.0, 4 << 30


@dataclasses.dataclass(frozen=True)
class Case:
    """A Llama config, its batch and the 144-chip (or smoke) plan's sizes."""

    name: str
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    batch: int
    seq: int
    dp: int
    tp: int
    rope_theta: float = 500000.0


CASES = {
    "70b": Case("Llama-3-70B", 8192, 28672, 80, 64, 8, 128256, 18, 2048, 18, 8),
    "405b": Case("Llama-3.1-405B", 16384, 53248, 126, 128, 8, 128256, 18, 2048, 18, 8),
    "smoke": Case("smoke (7 layers, width 64)", 64, 128, 7, 4, 2, 128, 4, 16, 2, 2, 10000.0),
}


def meta_model(case: Case) -> torch.nn.Module:
    """`LlamaForCausalLM` of the case's config, built on the meta device (no data)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=case.vocab,
        hidden_size=case.hidden,
        intermediate_size=case.ffn,
        num_hidden_layers=case.layers,
        num_attention_heads=case.heads,
        num_key_value_heads=case.kv_heads,
        max_position_embeddings=max(case.seq, 8192 if case.hidden > 64 else case.seq),
        rope_parameters={"rope_type": "default", "rope_theta": case.rope_theta},
        use_cache=False,
    )
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def lm_loss(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(idx).logits.flatten(0, 1), targets.flatten())


def plan_for(case: Case) -> Any:
    """Mesh dp x tp: Megatron tensor parallelism over tp, the batch over dp."""
    from portable import Mesh, Plan
    from portable import parallel as par

    stem = r"model\.layers\.\d+"
    rules = [
        *par.head_parallel(
            rf"{stem}\.self_attn", heads=case.heads, kv_heads=case.kv_heads, axis_size=case.tp
        ),
        *par.column_parallel(rf"{stem}\.mlp\.(gate|up)_proj", bias=False),
        *par.row_parallel(rf"{stem}\.mlp\.down_proj"),
        *par.vocab_parallel(r"model\.embed_tokens"),
        *par.column_parallel("lm_head", bias=False),
    ]
    return Plan(Mesh({"dp": case.dp, "tp": case.tp}), rules=rules, batch_axes=("dp",))


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(start: tuple[float, float]) -> dict[str, float]:
    wall, cpu = _clock()
    return {"wall_s": round(wall - start[0], 2), "cpu_s": round(cpu - start[1], 2)}


def measure(case: Case, neuron: bool = False) -> dict[str, Any]:
    """Capture, partition (and with `neuron`, lower) `case` in this process; its figures."""
    import portable
    from portable.passes.spmd_partition import partition

    start = _clock()
    model = meta_model(case)
    built = _since(start)
    batch = tuple(torch.zeros(case.batch, case.seq, dtype=torch.int64) for _ in range(2))
    start = _clock()
    program = portable.capture(
        model,
        batch,
        loss_fn=lm_loss,
        optimizer=portable.optim.AdamW(lr=1e-4),
        precision=portable.Precision(compute="bfloat16"),
        remat="selective",
    )
    captured = _since(start)
    start = _clock()
    per_rank, report = partition(program.replace(plan=plan_for(case)))
    partitioned = _since(start)
    row: dict[str, Any] = {
        "model": case.name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "batch": f"{case.batch} x {case.seq}",
        "plan": f"dp={case.dp} x tp={case.tp}",
        "build": built,
        "capture": captured,
        "partition": partitioned,
        "nodes": len(program.graph.nodes),
        "per_rank_nodes": len(per_rank.graph.nodes),
        "abstract": per_rank.abstract,
        "repeated_layers": program.metadata.get("repeated_layers"),
        "collectives": sum(v for k, v in report.counts.items() if "[" in k and "bytes" not in k),
    }
    row["peak_rss_bytes"] = _peak_rss()
    if neuron:
        row["neuron"] = {**lower_for_neuron(per_rank), "peak_rss_bytes": _peak_rss()}
    return row


def _peak_rss() -> int:
    """The process's peak resident set so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def lower_for_neuron(per_rank: Any) -> dict[str, Any]:
    """Lower the per-rank program for trn3 on the Gen2 UltraServer topology (36 servers x 4
    chips: the 144 chips), offline: seconds and the validator's error codes (a finding is a
    result: a plan that does not fit in HBM says so)."""
    import portable
    from portable.backends.neuron.findings import NeuronValidationError
    from portable.backends.neuron.options import NeuronOptions

    start = _clock()
    codes: dict[str, int] = {}
    try:
        portable.lower(per_rank, "neuron:trn3", options=NeuronOptions(topology="trn3-gen2"))
    except NeuronValidationError as exc:
        for finding in exc.findings:
            codes[finding.code] = codes.get(finding.code, 0) + 1
    return {**_since(start), "findings": codes}


def goal(row: dict[str, Any]) -> str:
    """The issue's goal for a 70B row: capture + partition under 60 s and 4 GiB."""
    seconds = row["capture"]["wall_s"] + row["partition"]["wall_s"]
    ok = seconds < GOAL_SECONDS and row["peak_rss_bytes"] < GOAL_BYTES
    gib = row["peak_rss_bytes"] / (1 << 30)
    return f"{'met' if ok else 'MISSED'}: {seconds:.1f} s < 60 s, {gib:.2f} GiB < 4 GiB"


def in_fresh_process(key: str, neuron: bool) -> dict[str, Any]:
    """`measure(CASES[key])` in a new interpreter: a peak RSS of its own."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--one", key]
    argv += ["--neuron"] if neuron else []
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, check=False)
    if done.returncode:
        raise SystemExit(f"{key} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | params | batch | plan | capture s (cpu) | partition s (cpu) | nodes | "
        "peak RSS | goal |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        lines.append(
            f"| {r['model']} | {_count(r['parameters'])} | {r['batch']} | {r['plan']} | "
            f"{r['capture']['wall_s']} ({r['capture']['cpu_s']}) | "
            f"{r['partition']['wall_s']} ({r['partition']['cpu_s']}) | "
            f"{r['nodes']} / {r['per_rank_nodes']} | {r['peak_rss_bytes'] / (1 << 30):.2f} GiB | "
            f"{goal(r) if r['model'].startswith('Llama-3-70B') else ''} |"
        )
    notes = [
        f"- {r['model']}: the per-rank program lowered for neuron:trn3 (trn3-gen2) in "
        f"{r['neuron']['wall_s']} s (cpu {r['neuron']['cpu_s']} s), peak RSS "
        f"{r['neuron']['peak_rss_bytes'] / (1 << 30):.2f} GiB; validator findings: "
        f"{r['neuron']['findings'] or 'none'}"
        for r in rows
        if "neuron" in r
    ]
    return head + "\n".join(lines) + "\n" + ("\n" + "\n".join(notes) + "\n" if notes else "")


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="70b,405b", help="comma list of: 70b, 405b")
    parser.add_argument("--smoke", action="store_true", help="a 7-layer Llama, in-process")
    parser.add_argument("--neuron", action="store_true", help="also lower for neuron:trn3")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--write", type=Path, action="append", help="update this markdown file's block (repeatable)"
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one case, JSON
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(CASES[args.one], args.neuron)))
        return 0
    if args.smoke:
        rows = [measure(CASES["smoke"], args.neuron)]
    else:
        rows = [in_fresh_process(k, args.neuron) for k in args.models.split(",")]
    text = table(rows)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if args.write:
        sys.path.insert(0, str(HERE))
        from cpu_overhead import write

        for path in args.write:
            write(path, text, MARK)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
