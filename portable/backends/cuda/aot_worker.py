"""`python -m portable.backends.cuda.aot_worker`: compile Triton kernels in a clean process.

Reads {"capability": 90, "out": DIR, "launches": [{ref, signature, constexprs, num_warps,
num_stages, options}]} as JSON on stdin, compiles each launch for that capability, writes
DIR/<i>.ptx and DIR/<i>.cubin, and prints a JSON list of {name, ptx, cubin, metadata}. Used by
`aot.compile_kernels` when the calling process runs Triton in interpreter mode.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path


def main() -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    request = json.load(sys.stdin)
    out = Path(request["out"])
    target = GPUTarget("cuda", request["capability"], 32)
    results = []
    for i, launch in enumerate(request["launches"]):
        module, _, name = launch["ref"].partition(":")
        fn = getattr(importlib.import_module(module), name)
        source = ASTSource(fn=fn, signature=launch["signature"], constexprs=launch["constexprs"])
        options = {
            "num_warps": launch["num_warps"],
            "num_stages": launch["num_stages"],
            "enable_fp_fusion": True,
            **launch["options"],
        }
        compiled = triton.compile(source, target=target, options=options)
        ptx, cubin = out / f"{i}.ptx", out / f"{i}.cubin"
        ptx.write_text(compiled.asm["ptx"])
        cubin.write_bytes(compiled.asm["cubin"])
        meta = {
            k: v
            for k, v in compiled.metadata._asdict().items()
            if isinstance(v, (bool, int, float, str)) or v is None
        }
        results.append(
            {"name": meta["name"], "ptx": str(ptx), "cubin": str(cubin), "metadata": meta}
        )
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
