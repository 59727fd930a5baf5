"""Archives: exact round trips, every refusal and corruption, atomic writes, no pickle, and the
format-1 compatibility fixture (tests/fixtures/archive_v1, written by make_archive_v1.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

import portable
from portable import ArchiveError
from portable.archive import FORMAT_VERSION
from portable.ir.content_hash import doc_hash
from portable.ir.plan import ShardingRule
from portable.ir.serialize import (
    decode_value,
    encode_value,
    program_from_json,
    program_to_json,
)
from portable.optim import AdamW
from tests.support import EXAMPLES

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "archive_v1"


# --- models ---------------------------------------------------------------------------------


class TinyMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class CausalBlock(nn.Module):
    """LayerNorm -> causal SDPA -> projection, then attention pooling with a -inf padding mask."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.score = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            self.qkv(self.ln(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        logits = self.score(h).squeeze(-1).masked_fill(~keep, float("-inf"))
        return (logits.softmax(-1).unsqueeze(-1) * h).sum(1)


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.bn(self.conv(x))).mean((2, 3)))


def _causal_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    keep = torch.rand(2, 8) > 0.4
    keep[:, 0] = True
    return torch.randn(2, 8, 16), keep


def _regression_loss(model, x, keep, y):
    return F.mse_loss(model(x, keep), y)


def _classification_loss(model, x, y):
    return F.cross_entropy(model(x), y)


def _program(name: str, example_spec=None) -> tuple[portable.Program, tuple]:
    """(program, inputs to run it with): small models here, `examples/` through their specs."""
    torch.manual_seed(0)
    if name == "mlp.infer":
        x = torch.randn(4, 6)
        return portable.capture(TinyMLP(), (x,)), (x,)
    if name == "causal.infer":
        inputs = _causal_inputs()
        return portable.capture(CausalBlock(), inputs), inputs
    if name == "causal.train":
        batch = (*_causal_inputs(), torch.randn(2, 16))
        opt = AdamW(lr=1e-3)
        return portable.capture(
            CausalBlock(), batch, loss_fn=_regression_loss, optimizer=opt
        ), batch
    if name == "convbn.train":
        batch = (torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,)))
        opt = AdamW(lr=1e-3)
        return portable.capture(ConvBN(), batch, loss_fn=_classification_loss, optimizer=opt), batch
    stem, mode = name.split(".")
    spec = example_spec(stem)
    training = mode == "train"
    return portable.capture_spec(
        spec, training=training
    ), spec.batch() if training else spec.inputs()


# --- comparisons ----------------------------------------------------------------------------


def _typed(value):
    """A comparable form of node args that keeps types (1 vs 1.0, list vs tuple, -0.0, nan)."""
    if isinstance(value, torch.fx.Node):
        return ("node", value.name)
    if isinstance(value, (list, tuple)):
        return (
            type(value).__name__ if isinstance(value, tuple) else "list",
            tuple(_typed(v) for v in value),
        )
    if isinstance(value, dict):
        return ("dict", tuple((k, _typed(v)) for k, v in value.items()))
    if isinstance(value, float):
        return ("float", "nan" if math.isnan(value) else value.hex())
    return (type(value).__name__, value)


def assert_same_program(a: portable.Program, b: portable.Program) -> None:
    assert b.text() == a.text()
    assert (b.kind, b.signature, b.plan, b.metadata) == (a.kind, a.signature, a.plan, a.metadata)
    assert b.content_hash == a.content_hash
    assert b.weights.keys() == a.weights.keys()
    for key, value in a.weights.items():
        assert b.weights[key].dtype == value.dtype, key
        assert torch.equal(b.weights[key], value), key
    for x, y in zip(a.graph.nodes, b.graph.nodes, strict=True):
        assert (y.name, y.op, y.target) == (x.name, x.op, x.target)
        assert _typed(y.args) == _typed(x.args) and _typed(y.kwargs) == _typed(x.kwargs), x.name
        assert y.meta.get("tensor") == x.meta.get("tensor") and y.meta.get("source") == x.meta.get(
            "source"
        )


def assert_same_results(
    a: portable.Program, b: portable.Program, inputs: tuple, steps: int = 2
) -> None:
    """Bit-identical outputs on the cpu backend (training steps: loss and every state tensor)."""
    run_a, run_b = portable.compile(a, backend="cpu"), portable.compile(b, backend="cpu")
    for _ in range(steps if a.kind is portable.ProgramKind.TRAINING_STEP else 1):
        out_a, out_b = run_a(*inputs), run_b(*inputs)
        if isinstance(out_a, portable.StepResult):
            assert torch.equal(out_a.loss, out_b.loss)
            assert out_a.state.keys() == out_b.state.keys()
            assert all(torch.equal(out_a.state[k], out_b.state[k]) for k in out_a.state)
        else:
            outs_a = out_a if isinstance(out_a, tuple) else (out_a,)
            outs_b = out_b if isinstance(out_b, tuple) else (out_b,)
            assert all(torch.equal(x, y) for x, y in zip(outs_a, outs_b, strict=True))


# --- round trips ----------------------------------------------------------------------------

CASES = ["mlp.infer", "causal.infer", "causal.train", "convbn.train"] + [
    f"{stem}.{mode}" for stem in EXAMPLES for mode in ("infer", "train")
]


@pytest.mark.parametrize("name", CASES)
def test_round_trip_is_exact(name, tmp_path, example_spec):
    program, inputs = _program(name, example_spec)
    path = program.save(tmp_path / "model.portable")
    assert sorted(os.listdir(path)) == ["program.json", "weights.safetensors"]
    loaded = portable.load(path)
    assert_same_program(program, loaded)
    assert_same_results(program, loaded, inputs)
    # a second save of the loaded program writes the same bytes
    again = loaded.save(tmp_path / "again.portable")
    for file in ("program.json", "weights.safetensors"):
        assert (again / file).read_bytes() == (path / file).read_bytes()


def test_graph_json_keeps_value_types():
    values = [
        1,
        1.0,
        -0.0,
        1e-5,
        2**40,
        math.inf,
        -math.inf,
        True,
        None,
        "s",
        [1, (2, 3.0)],
        (),
        torch.float32,
        torch.bfloat16,
        torch.device("cpu"),
        torch.strided,
        torch.contiguous_format,
        {"float": 1, "a": (1,)},
        {"tuple": [1]},
    ]
    for value in values:
        back = decode_value(json.loads(json.dumps(encode_value(value), allow_nan=False)))
        assert _typed(back) == _typed(value), value
    assert math.isnan(decode_value(json.loads(json.dumps(encode_value(math.nan)))))
    assert encode_value(1.0) == {"float": 1.0} and encode_value(math.inf) == {"float": "inf"}
    assert encode_value((1, [2])) == {"tuple": [1, [2]]}


def test_placeholder_names_that_shadow_builtins_survive(tmp_path):
    seq = nn.Sequential(nn.Linear(4, 2), nn.ReLU())
    program = portable.capture(seq, (torch.randn(3, 4),))
    assert "input" in [i.name for i in program.signature.user_inputs]
    assert_same_program(program, portable.load(program.save(tmp_path / "seq.portable")))


def test_content_hash_ignores_source_locations_but_not_args():
    program, _ = _program("mlp.infer")
    doc = program_to_json(program)
    for node in doc["graph"]:
        node.pop("source", None)
    assert doc_hash(doc, program.weights) == program.content_hash
    node = next(n for n in doc["graph"] if n["op"] == "aten.gelu.default")
    node["kwargs"]["approximate"] = "tanh"
    assert doc_hash(doc, program.weights) != program.content_hash


def test_plan_round_trips_and_mesh_axis_order_is_hashed(tmp_path):
    program, _ = _program("mlp.infer")
    program.plan = portable.Plan(
        portable.Mesh({"dp": 2, "tp": 2}),
        specs=(("fc1.weight", portable.PartitionSpec("tp", None)),),
        rules=(ShardingRule(r"fc2\..*", portable.PartitionSpec(None)),),
    )
    loaded = portable.load(program.save(tmp_path / "planned.portable"))
    assert loaded.plan == program.plan and loaded.content_hash == program.content_hash
    swapped = program.replace(
        plan=dataclasses.replace(program.plan, mesh=portable.Mesh({"tp": 2, "dp": 2}))
    )
    assert swapped.content_hash != program.content_hash


def test_plan_that_json_cannot_hold_is_refused(tmp_path):
    program, _ = _program("mlp.infer")
    spec = portable.PartitionSpec("tp", None)
    program.plan = portable.Plan(
        portable.Mesh({"tp": 2}), specs=(("fc1.weight", spec), ("fc1.weight", spec))
    )
    with pytest.raises(ArchiveError, match="does not survive JSON"):
        program.save(tmp_path / "bad.portable")
    assert not (tmp_path / "bad.portable").exists()


# --- refusals and corruption ----------------------------------------------------------------


@pytest.fixture
def saved(tmp_path) -> tuple[portable.Program, Path]:
    program, _ = _program("causal.infer")
    return program, program.save(tmp_path / "model.portable")


def _edit_json(path: Path, edit) -> None:
    doc = json.loads((path / "program.json").read_text())
    edit(doc)
    (path / "program.json").write_text(json.dumps(doc, indent=1))


def test_missing_archive_and_files(saved, tmp_path):
    with pytest.raises(ArchiveError, match="no archive at"):
        portable.load(tmp_path / "nope.portable")
    _, path = saved
    with pytest.raises(ArchiveError, match="is not a portable archive"):
        portable.load(path / "program.json")
    (path / "weights.safetensors").unlink()
    with pytest.raises(ArchiveError, match="has no weights.safetensors"):
        portable.load(path)


def test_invalid_json(saved):
    _, path = saved
    text = (path / "program.json").read_text()
    (path / "program.json").write_text(text[: len(text) // 2])
    with pytest.raises(ArchiveError, match="program.json is not valid JSON"):
        portable.load(path)


def test_truncated_weights(saved):
    _, path = saved
    data = (path / "weights.safetensors").read_bytes()
    (path / "weights.safetensors").write_bytes(data[:-100])
    with pytest.raises(
        ArchiveError, match=rf"is truncated: {len(data) - 100} bytes, expected {len(data)}"
    ):
        portable.load(path)


def test_flipped_weight_byte(saved):
    _, path = saved
    data = bytearray((path / "weights.safetensors").read_bytes())
    data[-7] ^= 0x01
    (path / "weights.safetensors").write_bytes(bytes(data))
    with pytest.raises(
        ArchiveError, match="weights hash mismatch: expected [0-9a-f]{64} got [0-9a-f]{64}"
    ):
        portable.load(path)


def test_tampered_op_argument(saved):
    _, path = saved

    def edit(doc):
        node = next(n for n in doc["program"]["graph"] if n["op"] == "portable.attention.default")
        node["args"][4] = False  # is_causal=True -> False

    _edit_json(path, edit)
    with pytest.raises(
        ArchiveError, match="content hash mismatch: expected [0-9a-f]{64} got [0-9a-f]{64}"
    ):
        portable.load(path)


def test_consistently_replaced_weights_fail_the_content_hash(saved):
    program, path = saved
    weights = {k: v.clone() for k, v in program.weights.items()}
    weights["ln.weight"] += 1
    safetensors.torch.save_file(weights, path / "weights.safetensors")
    data = (path / "weights.safetensors").read_bytes()

    def edit(doc):
        import hashlib

        doc["weights"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())

    _edit_json(path, edit)
    with pytest.raises(ArchiveError, match="content hash mismatch"):
        portable.load(path)


def test_unknown_op_is_named(saved):
    program, path = saved

    def edit(doc):
        node = next(n for n in doc["program"]["graph"] if n["op"] == "portable.layer_norm.default")
        node["op"] = "aten.frobnicate.default"
        doc["content_hash"] = doc_hash(doc["program"], program.weights)  # a consistent forgery

    _edit_json(path, edit)
    with pytest.raises(ArchiveError, match="op aten.frobnicate.default, which is not in"):
        portable.load(path)
    with pytest.raises(ArchiveError, match="frobnicate"):
        program_from_json(
            json.loads((path / "program.json").read_text())["program"], program.weights
        )


def test_node_names_must_be_plain_identifiers(saved):
    """Node names become Python identifiers in the rebuilt GraphModule's code: a forged name must
    be refused before any code is generated, even when the forger recomputes the hash."""
    program, path = saved

    def edit(doc):
        doc["program"]["graph"][-2]["name"] = "x = __import__('os')"
        doc["content_hash"] = doc_hash(doc["program"], program.weights)

    _edit_json(path, edit)
    with pytest.raises(ArchiveError, match="node name .* is not a plain identifier"):
        portable.load(path)


def test_newer_format_version_is_refused(saved):
    _, path = saved
    _edit_json(path, lambda doc: doc.update(format_version=FORMAT_VERSION + 1))
    with pytest.raises(ArchiveError) as info:
        portable.load(path)
    assert f"written by a newer portable (format {FORMAT_VERSION + 1} > {FORMAT_VERSION})" in str(
        info.value
    )
    assert "fix: upgrade portable" in str(info.value)


def test_newer_opset_is_refused(saved):
    _, path = saved
    _edit_json(path, lambda doc: doc["program"].update(opset_version="2.0"))
    with pytest.raises(ArchiveError, match=r"uses opset 2.0, newer than this portable's"):
        portable.load(path)


# --- writing --------------------------------------------------------------------------------


def test_refuses_to_overwrite_what_is_not_an_archive(tmp_path):
    program, _ = _program("mlp.infer")
    file = tmp_path / "notes.txt"
    file.write_text("keep me")
    with pytest.raises(ArchiveError, match="refusing to overwrite .*notes.txt: it is a file"):
        program.save(file)
    assert file.read_text() == "keep me"
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train.csv").write_text("1,2")
    with pytest.raises(ArchiveError, match="not a portable archive") as info:
        program.save(folder)
    assert "fix: choose another path" in str(info.value)
    assert os.listdir(folder) == ["train.csv"]
    (tmp_path / "empty").mkdir()
    assert portable.load(program.save(tmp_path / "empty")).content_hash == program.content_hash


def test_overwrites_an_existing_archive(saved, tmp_path):
    _, path = saved
    other, _ = _program("mlp.infer")
    other.save(path)
    assert portable.load(path).content_hash == other.content_hash
    assert sorted(os.listdir(tmp_path)) == ["model.portable"]


def test_failed_save_leaves_nothing_behind(saved, tmp_path, monkeypatch):
    program, path = saved
    other, _ = _program("mlp.infer")

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        other.save(tmp_path / "new.portable")
    with pytest.raises(OSError, match="disk full"):
        other.save(path)
    assert sorted(os.listdir(tmp_path)) == ["model.portable"]  # no temp or partial directories
    monkeypatch.undo()
    assert_same_program(program, portable.load(path))


@pytest.mark.parametrize("error", [OSError, KeyboardInterrupt, RuntimeError])
def test_failed_swap_restores_the_old_archive(saved, tmp_path, monkeypatch, error):
    """Whatever is raised between the two renames of the swap, the old archive is put back."""
    program, path = saved
    other, _ = _program("mlp.infer")
    rename = os.rename

    def moving_in_fails(src, dst):
        if ".tmp-" in os.fspath(src) and Path(dst) == path:  # old moved aside; new one in fails
            raise error("interrupted")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", moving_in_fails)
    with pytest.raises(error, match="interrupted"):
        other.save(path)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["model.portable"]
    assert_same_program(program, portable.load(path))


def test_a_save_killed_between_the_renames_is_undone_by_the_next_save(saved, tmp_path):
    """kill -9 after the old archive was moved aside: the next save to the path puts it back
    first (then replaces it), and no temp directory or lock is left."""
    import subprocess
    import sys

    program, path = saved
    script = f"""
import os, signal, portable
from pathlib import Path
rename = os.rename
def killed(src, dst):
    if ".tmp-" in os.fspath(src) and Path(dst) == Path({str(path)!r}):
        os.kill(os.getpid(), signal.SIGKILL)
    rename(src, dst)
os.rename = killed
portable.load({str(path)!r}).save({str(path)!r})
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    assert not path.exists() and any(".old-" in p for p in os.listdir(tmp_path))
    from portable.atomic_dir import recover_stale

    recover_stale(path)  # what the next save does first
    assert sorted(os.listdir(tmp_path)) == ["model.portable"]
    assert_same_program(program, portable.load(path))
    program.save(path)
    assert sorted(os.listdir(tmp_path)) == ["model.portable"]


def test_loading_does_not_unpickle(saved, monkeypatch):
    program, path = saved

    def forbidden(*args, **kwargs):
        raise AssertionError("load used pickle")

    for module, name in (
        (pickle, "load"),
        (pickle, "loads"),
        (pickle, "Unpickler"),
        (torch, "load"),
    ):
        monkeypatch.setattr(module, name, forbidden)
    assert_same_program(program, portable.load(path))
    json.loads((path / "program.json").read_text())  # plain JSON
    assert (
        safetensors.torch.load_file(path / "weights.safetensors").keys() == program.weights.keys()
    )


# --- compatibility --------------------------------------------------------------------------


@pytest.mark.parametrize("version", [1, 2])
def test_format_fixtures_still_load_and_compute(version):
    """Archives written by an older portable load and compute the recorded outputs; format 1 is
    checked by its own hash formula (without metadata) and gets the format-2 content hash."""
    fixture = FIXTURE.parent / f"archive_v{version}"
    header = json.loads((fixture / "mlp.portable" / "program.json").read_text())
    assert header["format_version"] == version
    program = portable.load(fixture / "mlp.portable")
    assert program.name == "mlp" and program.kind is portable.ProgramKind.INFERENCE
    assert (program.content_hash == header["content_hash"]) is (version == 2)
    expected = safetensors.torch.load_file(fixture / "expected.safetensors")
    output = portable.compile(program, backend="cpu")(expected["input"])
    # Recorded on another machine: the archive is exact, the float kernels may differ in the last bit.
    torch.testing.assert_close(output, expected["output"], rtol=1e-6, atol=1e-6)
    if version == 2:  # its batch dim is dynamic: other sizes run too
        assert portable.compile(program)(torch.randn(9, 6)).shape == (9, 3)
