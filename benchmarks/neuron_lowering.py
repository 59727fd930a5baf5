"""What lowering GPT-2 small for Trainium costs, as a ratio against `torch.compile` in the same run.

    python benchmarks/neuron_lowering.py [--repeat 1] [--write docs/performance.md]

- **portable**: what `portable lower MODEL --target neuron:trn3 --out DIR` does, in-process, on a
  built model: capture the inference program, save the archive, lower it for `neuron:trn3`
  (HLO proto + text + StableHLO, command, io spec, compile script) and hash every file into the
  manifest, into a fresh DIR;
- **baseline**: the first call of `torch.compile(model)` (inductor on CPU, caches disabled, dynamo
  reset before each run): tracing, graph lowering, C++ codegen and compile, and one forward.

The model is Hugging Face `GPT2LMHeadModel` with `GPT2Config()` defaults (124M parameters, 12
layers, 768 wide), dropout 0, `use_cache=False`, in eval mode; input ids of batch 1, sequence 128.
Both paths get the same model object and input. A 2-layer GPT-2 goes through both first so that
one-time costs (imports, compiler detection) are not charged to either. The ratio is the result
(the machines are noisy); seconds are recorded for reading it. Goal: at most 1.5x.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

import portable
from portable.backends import Target
from portable.cli.lower import ARCHIVE, target_dir
from portable.cli.manifest import file_records, write_manifest

HERE = Path(__file__).resolve().parent
MARK = "<!-- neuron_lowering -->"
TARGET = "neuron:trn3"
BATCH, SEQ = 1, 128


def _sibling(stem: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{stem}", HERE / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gpt2(**sizes: int) -> torch.nn.Module:
    """GPT2LMHeadModel with GPT2Config defaults (124M) unless `sizes` override them."""
    import transformers

    config = transformers.GPT2Config(
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False, **sizes
    )
    return transformers.GPT2LMHeadModel(config).eval()


class Logits(torch.nn.Module):
    """`model(ids).logits`: one tensor out, for both paths."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids).logits


def portable_lower(model: torch.nn.Module, inputs: tuple, out: Path) -> dict[str, float]:
    """The stages of `portable lower` (lower.py) on a built model; seconds per stage."""
    seconds: dict[str, float] = {}

    def stage(name: str, fn: Callable):
        start = time.perf_counter()
        value = fn()
        seconds[name] = time.perf_counter() - start
        return value

    program = stage("capture", lambda: portable.capture(model, inputs))
    stage("save", lambda: program.save(out / ARCHIVE))
    folder = out / target_dir(Target.parse(TARGET))
    folder.mkdir()
    stage("lower", lambda: portable.lower(program, TARGET, folder))
    stage("manifest", lambda: write_manifest(out, {"files": file_records(out, out)}))
    seconds["total"] = sum(seconds.values())
    return seconds


def torch_compile_first_call(model: torch.nn.Module, inputs: tuple) -> float:
    torch._dynamo.reset()
    start = time.perf_counter()
    compiled = torch.compile(model, backend="inductor")
    with torch.no_grad():
        compiled(*inputs)
    return time.perf_counter() - start


def measure(model: torch.nn.Module, ids: torch.Tensor, repeat: int) -> dict[str, float]:
    inputs = (ids,)
    stages: list[dict[str, float]] = []
    baseline: list[float] = []
    for _ in range(repeat):
        out = Path(tempfile.mkdtemp(prefix="neuron_lowering-"))
        try:
            stages.append(portable_lower(model, inputs, out))
        finally:
            shutil.rmtree(out, ignore_errors=True)
        baseline.append(torch_compile_first_call(model, inputs))
    row = {k: statistics.median(s[k] for s in stages) for k in stages[0]}
    compile_s = statistics.median(baseline)
    return {
        "lower / torch.compile": row["total"] / compile_s,
        "portable lower s": row["total"],
        "torch.compile first call s": compile_s,
        **{f"{k} s": v for k, v in row.items() if k != "total"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="runs of each path (median)")
    parser.add_argument("--write", type=Path, help="update this markdown file's block")
    parser.add_argument("--json", action="store_true", help="also print the row as JSON")
    args = parser.parse_args()
    torch._inductor.config.force_disable_caches = True  # measure a cold compile every run
    warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")
    torch.manual_seed(0)

    tiny = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
    small = Logits(gpt2(**tiny, bos_token_id=0, eos_token_id=0))
    measure(small, torch.randint(0, 128, (BATCH, 16)), repeat=1)  # one-time costs, both paths

    model = Logits(gpt2())
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, model.model.config.vocab_size, (BATCH, SEQ))
    row = measure(model, ids, args.repeat)
    bench = _sibling("cpu_overhead")
    text = (
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, GPT-2 small "
        f"({params / 1e6:.0f}M parameters), batch {BATCH}, sequence {SEQ}, target {TARGET}, "
        f"median of {args.repeat} run(s)\n\n" + bench.table({"gpt2-small": row})
    )
    print(text)
    if args.json:
        print(json.dumps(row))
    if args.write:
        bench.write(args.write, text, mark=MARK)


if __name__ == "__main__":
    main()
