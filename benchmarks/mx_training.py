"""Does MXFP8 training track fp32? The GPT example trained both ways on the same data.

    python benchmarks/mx_training.py [--steps 200] [--write docs/performance.md]
                                     [--plot docs/mx_training.png] [--json curves.json]

The training step of `examples/gpt.py` (2 layers, 64 wide, vocabulary 128) is captured once
(AdamW, lr 3e-3, batch 8 x 32 tokens) and run on the `cpu` backend twice from the same initial
weights, on the same batches:

- **fp32**: the captured program as it is;
- **MXFP8**: the program after the `mx-quantize` pass (`PIPELINE`: E4M3 elements, rceil scales,
  fake quantization, i.e. quantize-dequantize of both operands of all three GEMMs of every
  linear, the first and last layers included).

The data is a fixed Markov chain over the vocabulary: every token has 4 equally likely successors,
so the best achievable loss is ln 4 = 1.386 and the curve has somewhere to go. The result is the
relative gap between the final losses (mean of the last 10 steps). Goal: within 2%.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

import portable
from portable.optim import AdamW

HERE = Path(__file__).resolve().parent
MARK = "<!-- mx_training -->"
PASS = "mx-quantize"
FORMAT, RULE = "e4m3", "rceil"
PIPELINE = f"{PASS}{{format={FORMAT},scale={RULE},mode=fake,keep_first_last=false}}"
LR = 3e-3
BATCH, SEQ = 8, 32  # 256 tokens a step: a multiple of 32, the block of the weight-gradient GEMM
SUCCESSORS = 4
TAIL = 10  # the final loss is the mean of this many last steps
GOAL = 0.02
SEED = 0


def _sibling(stem: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{stem}", HERE / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def markov_batches(steps: int, vocab: int, seed: int = SEED) -> list[tuple[torch.Tensor, ...]]:
    """`steps` batches `(idx, targets)` of [BATCH, SEQ] token ids drawn from a fixed chain in
    which each token has SUCCESSORS distinct, equally likely successors (targets = idx shifted
    by one): the loss floor is ln(SUCCESSORS)."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.stack(
        [torch.randperm(vocab, generator=g)[:SUCCESSORS] for _ in range(vocab)]
    )
    tokens = torch.empty(steps, BATCH, SEQ + 1, dtype=torch.long)
    tokens[..., 0] = torch.randint(0, vocab, (steps, BATCH), generator=g)
    for t in range(SEQ):
        pick = torch.randint(0, SUCCESSORS, (steps, BATCH), generator=g)
        tokens[..., t + 1] = successors[tokens[..., t], pick]
    return [(seq[:, :-1].contiguous(), seq[:, 1:].contiguous()) for seq in tokens]


def mx_pipeline():
    """The `mx-quantize` pass, from the registry; SystemExit with the reason if it is missing."""
    from portable.passes import parse_pipeline, registry

    if PASS not in registry.names():
        raise SystemExit(
            f"mx_training: the `{PASS}` pass is not registered (registered passes: "
            f"{', '.join(registry.names())}); it comes with the mx-quantize issue"
        )
    return parse_pipeline(PIPELINE)


def quantized_operands(program: portable.Program) -> int:
    target = torch.ops.portable.mx_quantize.default
    return sum(node.target is target for node in program.graph_module.graph.nodes)


def train(program: portable.Program, batches) -> tuple[list[float], float]:
    """Per-step losses of `program` on the `cpu` backend, and the median seconds per step."""
    exe = portable.compile(program, backend="cpu")
    losses, seconds = [], []
    for batch in batches:
        start = time.perf_counter()
        losses.append(float(exe(*batch).loss))
        seconds.append(time.perf_counter() - start)
    return losses, statistics.median(seconds)


def final(losses: list[float]) -> float:
    return statistics.fmean(losses[-TAIL:])


def measure(steps: int = 200) -> dict:
    """Both curves and their summary (the JSON record; see `--json`)."""
    from portable.passes import PassManager

    passes = mx_pipeline()  # fail before any work when the pass is missing
    spec = _sibling("cpu_overhead").load("gpt", "GPT")
    model = spec.build()
    batches = markov_batches(steps, model.config.vocab_size)
    program = portable.capture(model, batches[0], loss_fn=spec.loss_fn, optimizer=AdamW(lr=LR))
    mx_program, reports = PassManager(passes).run(program)
    n_quantized = quantized_operands(mx_program)
    if n_quantized == 0:
        raise SystemExit(f"mx_training: `{PIPELINE}` quantized nothing ({reports[-1].summary()})")
    fp32, fp32_s = train(program, batches)
    mxfp8, mxfp8_s = train(mx_program, batches)
    f32, fmx = final(fp32), final(mxfp8)
    return {
        "format_version": 1,
        "model": "examples/gpt.py:GPT",
        "pipeline": PIPELINE,
        "pass_report": reports[-1].to_json(),
        "quantized_operands": n_quantized,
        "steps": steps,
        "batch": [BATCH, SEQ],
        "optimizer": AdamW(lr=LR).to_dict(),
        "data": f"Markov chain, {SUCCESSORS} successors per token, seed {SEED}",
        "loss_floor": math.log(SUCCESSORS),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "losses": {"fp32": fp32, "mxfp8": mxfp8},
        "final": {"fp32": f32, "mxfp8": fmx},
        "gap": (fmx - f32) / f32,
        "max_step_gap": max(abs(m - f) / f for f, m in zip(fp32, mxfp8, strict=True)),
        "step_ms": {"fp32": fp32_s * 1e3, "mxfp8": mxfp8_s * 1e3},
    }


def table(result: dict) -> str:
    tail = min(TAIL, result["steps"])
    f, ms, gap = result["final"], result["step_ms"], result["gap"]
    verdict = "met" if abs(gap) <= GOAL else "not met"
    lines = [
        f"| run | first loss | final loss (mean of last {tail}) | step ms |",
        "|---|---|---|---|",
    ]
    for run in ("fp32", "mxfp8"):
        first = result["losses"][run][0]
        lines.append(f"| {run} | {first:.4f} | {f[run]:.4f} | {ms[run]:.1f} |")
    lines.append("")
    lines.append(
        f"MXFP8 / fp32 final loss: {1 + gap:.4f} (gap {gap:+.2%}; goal within {GOAL:.0%}: "
        f"{verdict}); largest per-step gap {result['max_step_gap']:.2%}; loss floor of the "
        f"data ln {SUCCESSORS} = {result['loss_floor']:.4f}"
    )
    return "\n".join(lines)


def report(result: dict) -> str:
    b, s = result["batch"]
    head = (
        f"torch {result['torch']}, {result['threads']} threads, `{result['model']}`, "
        f"{result['steps']} steps of {b} x {s} tokens, AdamW lr {result['optimizer']['lr']:g}, "
        f"`cpu` backend; MXFP8 = `{result['pipeline']}` ({result['quantized_operands']} "
        "GEMM operands quantized)"
    )
    return head + "\n\n" + table(result)


def plot(result: dict, path: Path) -> None:
    """A small PNG of both loss curves (matplotlib, Agg; imported only here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    steps = range(1, result["steps"] + 1)
    for run, label, style in (("fp32", "fp32", "-"), ("mxfp8", "MXFP8", "--")):
        final_loss = result["final"][run]
        ax.plot(
            steps, result["losses"][run], style, lw=1.2, label=f"{label} (final {final_loss:.3f})"
        )
    ax.axhline(result["loss_floor"], color="grey", lw=0.8, ls=":", label=f"floor ln {SUCCESSORS}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(
        f"GPT example, {result['steps']} steps: fp32 vs MXFP8 ({FORMAT.upper()}, {RULE}, "
        f"fake quant), gap {result['gap']:+.2%}",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps of each run")
    parser.add_argument("--write", type=Path, help="update this markdown file's block")
    parser.add_argument("--plot", type=Path, help="write a PNG of both loss curves here")
    parser.add_argument("--json", type=Path, help="write the curves and summary as JSON here")
    args = parser.parse_args(argv)
    torch.manual_seed(SEED)
    result = measure(args.steps)
    text = report(result)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, args.plot)
    if args.write:
        _sibling("cpu_overhead").write(args.write, text, mark=MARK)


if __name__ == "__main__":
    sys.exit(main())
