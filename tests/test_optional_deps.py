"""A base install (torch, safetensors, numpy; no extras): every backend whose optional packages
are missing is listed with them and the `pip install` that adds them, and refused with that
message (BackendError, exit 4) wherever it is used; nothing crashes and the missing packages are
never imported.

The absence is simulated in a fresh interpreter: Python's path finder reports jax, jaxlib,
triton, onnx, onnxruntime and onnxscript as not found (exactly what `importlib.util.find_spec`
and `import` see when they are not installed). A real base venv behaves the same (checked by
hand: docs/testing.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MLP = f"{REPO / 'examples' / 'mlp.py'}:MLP"
EXTRAS = {
    "xla": ("jax", "jaxlib"),
    "cuda": ("triton",),
    "onnx": ("onnx", "onnxruntime", "onnxscript"),
}
MISSING = sorted(m for modules in EXTRAS.values() for m in modules)
BACKEND_EXTRA = {"xla": "xla", "neuron": "xla", "cuda": "cuda", "onnx": "onnx"}

# Runs in the subprocess: hide the packages, then run CLI commands and API calls in-process and
# print one JSON document with their outcomes.
_PROBE = """
import contextlib, io, json, sys
import importlib.machinery as machinery

BLOCKED = set(sys.argv[1].split(","))
_find = machinery.PathFinder.find_spec


def _hidden(fullname, path=None, target=None):
    return None if fullname.split(".")[0] in BLOCKED else _find(fullname, path, target)


machinery.PathFinder.find_spec = staticmethod(_hidden)

import torch
import portable
from portable.cli import main

def cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return {"code": int(code), "out": out.getvalue(), "err": err.getvalue()}

def api(call, *args):
    try:
        call(*args)
    except portable.PortableError as exc:
        return {"type": type(exc).__name__, "what": exc.what, "fix": exc.fix}
    except Exception as exc:
        return {"type": "RAW " + type(exc).__name__, "what": str(exc), "fix": None}
    return {"type": None}

out_dir, lowered = sys.argv[2], sys.argv[3]
program = portable.capture(torch.nn.Linear(4, 2), (torch.randn(3, 4),))
doc = {
    "backends_json": cli("backends", "--json"),
    "backends_table": cli("backends"),
    "lower": {t: cli("lower", sys.argv[4], "-t", t, "-o", f"{out_dir}/{t}", "-q")
              for t in ("neuron", "xla", "cuda", "onnx", "all", "cpu")},
    "check": cli("check", lowered),
    "api_lower": {b: api(portable.lower, program, b) for b in ("xla", "neuron", "cuda", "onnx")},
    "api_compile": {b: api(portable.compile, program, b)
                    for b in ("xla", "neuron", "cuda", "onnx")},
    "imported": sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED),
}
print(json.dumps(doc))
"""


@pytest.fixture(scope="module")
def base_install(tmp_path_factory):
    """The probe's outcomes in an interpreter without any optional package."""
    pytest.importorskip("jax")  # a real neuron output to `portable check`, written here
    from portable.cli import main

    tmp = tmp_path_factory.mktemp("base")
    lowered = tmp / "lowered"
    assert main(["lower", MLP, "-t", "neuron:trn3", "-o", str(lowered), "-q"]) == 0
    argv = [sys.executable, "-c", _PROBE, ",".join(MISSING), str(tmp / "o"), str(lowered), MLP]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=tmp)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1]), tmp


def _install(backend: str) -> str:
    return f"pip install 'portable[{BACKEND_EXTRA[backend]}]'"


def test_backends_lists_what_is_missing_and_how_to_install_it(base_install):
    doc, _ = base_install
    listing = doc["backends_json"]
    assert listing["code"] == 0, listing["err"]
    rows = {r["name"]: r for r in json.loads(listing["out"])}
    assert rows["cpu"]["missing"] == [] and rows["cpu"]["install"] is None
    assert rows["cpu"]["can_execute_here"] is True
    for name, extra in BACKEND_EXTRA.items():
        row = rows[name]
        assert row["missing"] == list(EXTRAS[extra]), row
        assert row["install"] == _install(name)
        assert row["can_execute_here"] is False and _install(name) in row["reason"]
        assert "error" not in row
    # capabilities that do not need the missing packages are still listed
    assert rows["cuda"]["variants"] == ["sm_90", "sm_100"] and rows["onnx"]["ops"] > 0
    assert rows["xla"]["ops"] is None and rows["neuron"]["program_kinds"] is None
    table = doc["backends_table"]
    assert table["code"] == 0 and "pip install 'portable[xla]'" in table["out"]


@pytest.mark.parametrize("target", ["neuron", "xla", "cuda", "onnx"])
def test_lower_refuses_a_backend_without_its_packages(base_install, target):
    doc, tmp = base_install
    result = doc["lower"][target]
    assert result["code"] == 4, result["err"]
    missing = ", ".join(EXTRAS[BACKEND_EXTRA[target]])
    assert f"error: backend {target} needs {missing}, not installed here" in result["err"]
    assert f"fix: {_install(target)}" in result["err"]
    assert "Traceback" not in result["err"] and not (tmp / "o" / target).exists()


def test_lower_all_is_refused_naming_what_is_usable(base_install):
    doc, tmp = base_install
    result = doc["lower"]["all"]
    assert result["code"] == 4 and "not installed here" in result["err"]
    assert "or name the targets instead of `all` (usable here: cpu)" in result["err"]
    assert not (tmp / "o" / "all").exists()
    assert doc["lower"]["cpu"]["code"] == 0, doc["lower"]["cpu"]["err"]


def test_check_without_jax_says_what_to_install(base_install):
    result = base_install[0]["check"]
    assert result["code"] == 4
    assert "backend neuron needs jax, jaxlib" in result["err"]
    assert "pip install 'portable[xla]'" in result["err"]


@pytest.mark.parametrize("call", ["api_lower", "api_compile"])
def test_python_api_refuses_with_a_backend_error(base_install, call):
    doc, _ = base_install
    for backend, outcome in doc[call].items():
        assert outcome["type"] == "BackendError", (backend, outcome)
        assert outcome["fix"] == _install(backend)
    assert doc["imported"] == []  # the refusals import nothing of what is missing
