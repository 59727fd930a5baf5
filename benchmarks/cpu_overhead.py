"""What capture and the `cpu` backend cost, as ratios against baselines measured in the same run.

    python benchmarks/cpu_overhead.py [--write docs/performance.md]

- capture time of a program vs `torch.export.export(...).run_decompositions()` of the same model;
- `cpu` inference call vs the eager `model(x)` (same thread count, no_grad both);
- `cpu` training step vs one eager `zero_grad / loss.backward() / optimizer.step()`.

Each timing is the median of repeated runs after a warm-up; ratios, not seconds, are the result
(the machines are noisy)."""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

import portable
from portable.optim import to_torch

REPO = Path(__file__).resolve().parents[1]
MARK = "<!-- cpu_overhead -->"


def load(stem: str, name: str) -> portable.ModelSpec:
    spec = importlib.util.spec_from_file_location(
        f"_bench_{stem}", REPO / "examples" / f"{stem}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return portable.spec_of(getattr(module, name))


def median_time(fn, repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(stem: str, name: str, repeat: int) -> dict[str, float]:
    spec = load(stem, name)
    model = spec.build().eval()
    inputs, batch = spec.inputs(), spec.batch()

    export_s = median_time(lambda: torch.export.export(model, inputs).run_decompositions(), 3, 1)
    capture_s = median_time(lambda: portable.capture(model, inputs), 3, 1)

    run = portable.compile(portable.capture(model, inputs))
    with torch.no_grad():
        eager_s = median_time(lambda: model(*inputs), repeat)
    cpu_s = median_time(lambda: run(*inputs), repeat)

    step = portable.compile(
        portable.capture(spec.build(), batch, loss_fn=spec.loss_fn, optimizer=spec.optimizer)
    )
    train_model = spec.build().train()
    opt = to_torch(spec.optimizer, train_model.parameters())

    def eager_step():
        opt.zero_grad()
        spec.loss_fn(train_model, *batch).backward()
        opt.step()

    eager_train_s = median_time(eager_step, repeat)
    cpu_train_s = median_time(lambda: step(*batch), repeat)
    return {
        "capture / export": capture_s / export_s,
        "cpu inference / eager": cpu_s / eager_s,
        "cpu train step / eager step": cpu_train_s / eager_train_s,
        "eager inference ms": eager_s * 1e3,
        "eager train step ms": eager_train_s * 1e3,
    }


def table(results: dict[str, dict[str, float]]) -> str:
    cols = list(next(iter(results.values())))
    lines = ["| model | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for model, row in results.items():
        lines.append(f"| {model} | " + " | ".join(f"{row[c]:.2f}" for c in cols) + " |")
    return "\n".join(lines)


def write(path: Path, text: str, mark: str = MARK) -> None:
    """Replace the block between two `mark` lines of `path` with `text` (append it if absent)."""
    doc = path.read_text() if path.exists() else "# Performance\n"
    block = f"{mark}\n{text}\n{mark}"
    if mark in doc:
        head, _, rest = doc.partition(mark)
        _, _, tail = rest.partition(mark)
        doc = head + block + tail
    else:
        doc += "\n" + block + "\n"
    path.write_text(doc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--write", type=Path, help="update this markdown file's cpu_overhead block")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = {
        f"{stem}:{name}": measure(stem, name, args.repeat)
        for stem, name in (
            ("mlp", "MLP"),
            ("gpt", "GPT"),
            ("llama", "Llama"),
            ("cnn", "CNN"),
            ("moe", "MoE"),
        )
    }
    text = (
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeat} runs\n\n"
        + table(results)
    )
    print(text)
    if args.write:
        write(args.write, text)


if __name__ == "__main__":
    main()
