"""Hand-written HLO for the neuron validator's tests: parsed by XLA, serialized, read back."""

from __future__ import annotations

from portable.backends.neuron import TARGETS
from portable.backends.neuron.findings import Severity
from portable.backends.neuron.hlo import module_from_proto, proto_from_text
from portable.backends.neuron.validate import validate


def hlo_module(body: str, *, header: str = "HloModule m", computations: str = ""):
    """Parse HLO text with XLA's parser, serialize it, read it back (the validator's path)."""
    return module_from_proto(proto_from_text(f"{header}\n{computations}\n{body}"))


def entry(result: str, lines: str, params: str = "p: f32[4]") -> str:
    decl = ", ".join(params.split(", "))
    return f"ENTRY %main ({decl}) -> ({result}) {{\n{lines}\n}}"


def findings_of(module, variant: str = "trn3", **kw):
    return validate(module, TARGETS[variant], kw.pop("options", None), **kw)


def codes(findings, severity: Severity = Severity.ERROR) -> list[str]:
    return [f.code for f in findings if f.severity is severity]
