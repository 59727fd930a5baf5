"""Written artifacts are reproducible: no file names portable's own source (torch.onnx's and
torch.export's trace frames, Triton's line info), so two installs lower a program to the same
bytes, and lowering twice in one process gives the same bytes (the traces named torch.fx's
generated code by a per-process counter). The stack traces that stay are the user's lines."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

import portable
from portable.capture import capture_spec
from tests.support import load_spec

PACKAGE = str(Path(portable.__file__).resolve().parent).encode()
NEEDS = {"onnx": "onnxscript", "cuda": "triton"}


@pytest.fixture(scope="module")
def gpt():
    return capture_spec(load_spec("gpt"))


@pytest.fixture(scope="module", params=sorted(NEEDS))
def lowered_twice(request, gpt, tmp_path_factory):
    """(target, first folder, second folder): the GPT example lowered twice for the target."""
    pytest.importorskip(NEEDS[request.param])
    root = tmp_path_factory.mktemp(request.param)
    folders = [root / "first", root / "second"]  # neither exists: lower creates them
    for folder in folders:
        portable.lower(gpt, request.param, folder)
    return request.param, *folders


def _digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_artifacts_do_not_name_the_install(lowered_twice):
    _, first, _ = lowered_twice
    files = [p for p in first.rglob("*") if p.is_file()]
    assert files, "nothing was written"
    assert [str(p.relative_to(first)) for p in files if PACKAGE in p.read_bytes()] == []


def test_lowering_twice_writes_the_same_bytes(lowered_twice):
    _, first, second = lowered_twice
    assert _digests(first) == _digests(second)


@pytest.mark.parametrize("lowered_twice", ["onnx"], indirect=True)
def test_onnx_nodes_trace_to_the_users_line(lowered_twice):
    _, first, _ = lowered_twice
    import onnx

    model = onnx.load(str(first / "model.onnx"), load_external_data=False)
    traces = [
        p.value
        for n in model.graph.node
        for p in n.metadata_props
        if p.key == "pkg.torch.onnx.stack_trace"
    ]
    assert traces and all("examples/gpt.py" in t for t in traces), traces[:3]
