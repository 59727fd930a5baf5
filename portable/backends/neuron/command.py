"""The neuronx-cc command of one program, and the same flags as a NEURON_CC_FLAGS string.

    neuronx-cc compile --framework=XLA --target=trn3 model/graph.hlo --output graph.neff
      --logfile log-neuron-cc.txt --model-type=transformer --auto-cast=none
      --logical-nc-config=2 -O1 [--distribution-strategy=llm-training]
      [--native-int64=disabled] --implicit-integer-downcast=all --verbose=35

- `--logical-nc-config` only for generations with logical cores (trn2, trn3); it must equal the
  runtime's NEURON_LOGICAL_NC_CONFIG. trn1 has none.
- `--distribution-strategy=llm-training` for training steps of `--model-type=transformer`
  (the NxD training setting); inference and other model types go without it.
- The int64 flags are pinned: the 2.32 release notes announce new defaults (native int64, hard
  errors for lossy integer downcasts), and the compile cache keys on the exact flags.
  `--implicit-integer-downcast=all` goes to every target (it also governs int32 dot / scatter /
  all-reduce / reduce-scatter, which compute in FP32 everywhere); `--native-int64=disabled` only
  to trn2 and later: the 2.32 CLI reference makes `--native-int64` "only available on trn2 and
  later" (trn1 always computes int64 as int32).
- `--target=trn3` is what AWS's own code passes (the NKI MX examples, NxD's hardware enum); the
  2.32 CLI reference lists only inf2, trn1, trn1n and trn2 (the manifest says so).
Paths are relative to the program's directory (`programs/<key>/`), where the command runs.
"""

from __future__ import annotations

import shlex

from portable.ir.program import ProgramKind

from .options import NeuronOptions
from .targets import NeuronTarget

__all__ = [
    "HLO_FILE",
    "LOG_FILE",
    "NEFF_FILE",
    "INT64_FLAGS",
    "NATIVE_INT64_TARGETS",
    "compiler_flags",
    "int64_flags",
    "neuron_cc_flags",
    "neuronx_cc_argv",
]

HLO_FILE = "model/graph.hlo"
NEFF_FILE = "graph.neff"
LOG_FILE = "log-neuron-cc.txt"
INT64_FLAGS = ("--native-int64=disabled", "--implicit-integer-downcast=all")
NATIVE_INT64_TARGETS = frozenset({"trn2", "trn3"})  # CLI reference: "trn2 and later"


def int64_flags(target: NeuronTarget) -> tuple[str, ...]:
    """The pinned int64 flags `target`'s compiler accepts (no --native-int64 before trn2)."""
    if target.compiler_target in NATIVE_INT64_TARGETS:
        return INT64_FLAGS
    return tuple(f for f in INT64_FLAGS if not f.startswith("--native-int64"))


def compiler_flags(target: NeuronTarget, options: NeuronOptions, kind: ProgramKind) -> list[str]:
    """The flags that decide the compiled program (what NEURON_CC_FLAGS carries)."""
    flags = [
        f"--target={target.compiler_target}",
        f"--model-type={options.model_type}",
        f"--auto-cast={options.auto_cast}",
    ]
    if target.logical_nc_config is not None:
        flags.append(f"--logical-nc-config={target.logical_nc_config}")
    flags.append(f"-O{options.optlevel}")
    if kind is ProgramKind.TRAINING_STEP and options.model_type == "transformer":
        flags.append("--distribution-strategy=llm-training")
    flags.extend(int64_flags(target))
    return flags


def neuronx_cc_argv(target: NeuronTarget, options: NeuronOptions, kind: ProgramKind) -> list[str]:
    """The exact argv, run from the program's directory."""
    flags = compiler_flags(target, options, kind)
    head = ["neuronx-cc", "compile", "--framework=XLA", flags[0], HLO_FILE]
    io = ["--output", NEFF_FILE, "--logfile", LOG_FILE]
    return [*head, *io, *flags[1:], "--verbose=35"]


def neuron_cc_flags(target: NeuronTarget, options: NeuronOptions, kind: ProgramKind) -> str:
    """The flags as torch-neuronx / JAX users set them: `NEURON_CC_FLAGS="..."`."""
    return shlex.join(compiler_flags(target, options, kind))
