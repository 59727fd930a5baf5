"""Ahead-of-time compilation of every Triton kernel of the `cuda` backend for sm_90 and sm_100.

No GPU is needed: Triton compiles for an explicit target. Each kernel family is compiled with the
configurations real programs plan (dtypes, masks, head dims, MX formats and scale rules), and the
outputs are checked: the PTX names the arch-specific target, the cubin is a CUDA ELF for that SM,
and the metadata agrees with what was written. In this test process Triton runs in interpreter
mode (tests/conftest.py), so compilation goes through the clean subprocess of `aot.py`; the
last test compiles in-process in a fresh interpreter without TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from portable.backends.cuda.aot import compile_kernels  # noqa: E402
from portable.backends.cuda.kernels import attention, mx, softmax  # noqa: E402
from portable.backends.cuda.targets import ARCHS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
meta = torch.device("meta")


def _t(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device=meta)


def _softmax_plans():
    return [
        *softmax.plan_scale_mask_softmax(_t(4, 8, 128)),
        *softmax.plan_scale_mask_softmax(
            _t(2, 4, 64, 64, dtype=torch.bfloat16), _t(64, 64, dtype=torch.bool), 0.125
        ),
        *softmax.plan_scale_mask_softmax(_t(3, 5000, dtype=torch.float16), _t(5000), 2.0),
        *softmax.plan_scale_mask_softmax(_t(6, 33, 7), None, 1.0, 1),
    ]


def _attention_plans():
    return [
        *attention.plan_attention(_t(2, 4, 64, 64), _t(2, 4, 64, 64), _t(2, 4, 64, 64), None, True),
        *attention.plan_attention(
            *(_t(1, 8, 256, 128, dtype=torch.bfloat16) for _ in range(3)),
            _t(1, 1, 1, 256, dtype=torch.bool),
            True,
        ),
        *attention.plan_attention(  # grouped-query, additive mask, head dim 80
            _t(2, 8, 32, 80, dtype=torch.float16),
            _t(2, 2, 48, 80, dtype=torch.float16),
            _t(2, 2, 48, 80, dtype=torch.float16),
            _t(32, 48, dtype=torch.float16),
        ),
    ]


def _mx_plans():
    plans = []
    for fmt in ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "int8"):
        for rule in ("floor", "rceil", "ceil", "even"):
            plans += mx.plan_quantize([64, 96], torch.float32, fmt, 0, rule, 32)
        plans += mx.plan_quantize([8, 256], torch.bfloat16, fmt, -1, "rceil", 32)
        codes = [8, 128] if fmt == "e2m1" else [8, 256]
        plans += mx.plan_dequantize(codes, fmt, -1, torch.float32, 32)
        plans += mx.plan_dequantize(codes, fmt, -1, torch.bfloat16, 32)
    return plans


FAMILIES = {"softmax": _softmax_plans, "attention": _attention_plans, "mx": _mx_plans}


def _elf_sm(cubin: bytes) -> int:
    assert cubin[:4] == b"\x7fELF" and cubin[4] == 2, "a 64-bit ELF"
    assert int.from_bytes(cubin[18:20], "little") == 190, "e_machine EM_CUDA"
    return (int.from_bytes(cubin[48:52], "little") >> 8) & 0xFF  # ELF ABI v8: SM in e_flags


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_kernel_compiles_for_the_arch(family, arch, tmp_path):
    plans = FAMILIES[family]()
    assert plans
    target = ARCHS[arch]
    compiled = compile_kernels(plans, target)
    assert len(compiled) == len({p.key for p in plans})
    for kernel in compiled:
        assert f".target {target.ptx_target}" in kernel.ptx
        assert f".entry {kernel.name}(" in kernel.ptx
        assert _elf_sm(kernel.cubin) == target.capability
        files = kernel.write(tmp_path / arch)
        record = json.loads(files[2].read_text())
        assert record["arch"] == arch and record["function"] == kernel.name
        assert record["signature"] == kernel.launch.signature
        assert record["grid_rule"] and len(record["grid"]) >= 1
        # every constexpr of the signature has its value recorded
        constexprs = [k for k, v in kernel.launch.signature.items() if v == "constexpr"]
        assert sorted(record["constexprs"]) == sorted(constexprs)


def test_cuobjdump_names_the_arch(tmp_path):
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip("this Triton wheel has no cuobjdump")
    (kernel,) = compile_kernels(softmax.plan_scale_mask_softmax(_t(4, 128)), ARCHS["sm_100"])
    path = tmp_path / "k.cubin"
    path.write_bytes(kernel.cubin)
    listing = subprocess.run([str(tool), "--list-elf", str(path)], capture_output=True, text=True)
    assert "sm_100a" in listing.stdout, listing.stdout + listing.stderr


def test_compiles_in_process_without_the_interpreter(tmp_path):
    """A process without TRITON_INTERPRET compiles in-process (no worker) to the same bytes."""
    code = (
        "import sys, torch\n"
        "from portable.backends.cuda.aot import compile_kernels\n"
        "from portable.backends.cuda.kernels import softmax\n"
        "from portable.backends.cuda.kernels.launch import interpreted\n"
        "from portable.backends.cuda.targets import ARCHS\n"
        "plans = softmax.plan_scale_mask_softmax(torch.empty(4, 128, device='meta'))\n"
        "assert not interpreted(plans[0].fn)\n"
        "(k,) = compile_kernels(plans, ARCHS['sm_90'])\n"
        "sys.stdout.write(k.record()['ptx_sha256'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (here,) = compile_kernels(
        softmax.plan_scale_mask_softmax(_t(4, 128)), ARCHS["sm_90"]
    )  # through the worker
    assert proc.stdout == here.record()["ptx_sha256"]
