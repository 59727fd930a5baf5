"""Planner speed: `estimate` per configuration once a model's costs are counted, and `search`
over at least 10,000 configurations.

Goals (issue 19): <= 1 ms per estimate, a 10,000-configuration search in <= 10 s. The costs are
counted once (a capture, timed separately) from a small Transformer, repeated to `--layers`
blocks so the per-estimate work is that of a full-depth model.

    python benchmarks/planner_speed.py [--layers 96] [--devices 1024]
"""

from __future__ import annotations

import argparse
import sys
import time

from portable import planner
from portable.errors import PlannerError
from portable.planner.estimate import price
from portable.planner.search import candidates


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=96)
    ap.add_argument("--devices", type=int, default=1024)
    ap.add_argument("--global-batch", type=int, default=1536)
    args = ap.parse_args(argv)
    model = planner.Transformer(layers=2, hidden=256, heads=8, vocab=1024, seq=256)
    start = time.perf_counter()
    costs = planner.costs_of(model).with_layers(args.layers)
    counted = time.perf_counter() - start
    system = planner.system("h100", devices=args.devices)
    plans = list(candidates(costs, system.devices, args.global_batch, heads=8))
    start = time.perf_counter()
    priced = 0
    for plan in plans:
        try:
            price(costs, system, plan)
            priced += 1
        except PlannerError:
            pass
    per = (time.perf_counter() - start) / max(len(plans), 1)
    start = time.perf_counter()
    found = planner.search(costs, system, args.global_batch, heads=8, top=5)
    searched = time.perf_counter() - start
    print(f"costs counted in {counted:.1f} s ({args.layers} layers)")
    print(f"{len(plans)} configurations ({priced} valid) on h100 x {args.devices}")
    print(f"estimate: {per * 1e3:.3f} ms per configuration (goal <= 1 ms)")
    print(f"search: {searched:.2f} s for {len(plans)} configurations (goal <= 10 s for 10,000)")
    print(f"best: {found[0].plan.describe()} {found[0].step_time_s:.3f} s" if found else "none fit")
    ok = per <= 1e-3 and len(plans) >= 10_000 and searched <= 10.0
    print("goals met" if ok else "GOALS MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
