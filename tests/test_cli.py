"""The `portable` CLI: lower, inspect, the listings, exit codes, the manifest and atomic output.

Commands run in-process through `main([...])` (one test runs the console module in a
subprocess). Models are the examples, named by file path (`examples/mlp.py:MLP`). Each output
directory lives under `tmp_path`; the manifest's sha256 of every file is checked against disk.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import portable
from portable.backends import cpu as cpu_backend
from portable.backends import get_backend
from portable.backends import registry as backend_registry
from portable.cli import ExitCode, main
from portable.cli.manifest import FORMAT, FORMAT_VERSION
from portable.errors import BackendError
from portable.opset import OPSET_VERSION, opset_table
from portable.passes import registry as pass_registry

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MLP = f"{EXAMPLES / 'mlp.py'}:MLP"
GPT = f"{EXAMPLES / 'gpt.py'}:GPT"
MLP_PARAMS = 32 * 64 + 64 + 64 * 4 + 4


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def manifest_of(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def files_on_disk(out: Path) -> set[str]:
    return {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}


def check_manifest_files(out: Path, manifest: dict) -> None:
    """Every listed file exists with the recorded sha256 and size; nothing unlisted is there."""
    records = manifest["program"]["files"] + [f for t in manifest["targets"] for f in t["files"]]
    assert records, "manifest lists no files"
    for record in records:
        data = (out / record["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == record["sha256"], record["path"]
        assert len(data) == record["size"], record["path"]
    assert files_on_disk(out) == {r["path"] for r in records} | {"manifest.json"}


def no_leftovers(parent: Path) -> list[str]:
    """Temporary staging directories left beside an output."""
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


@pytest.fixture(scope="module")
def mlp_out(tmp_path_factory) -> Path:
    """One inference lowering of MLP with a pass pipeline, shared by read-only tests."""
    out = tmp_path_factory.mktemp("mlp") / "out"
    assert (
        main(
            ["lower", MLP, "--target", "cpu", "--pass", "dce,canonicalize", "--out", str(out), "-q"]
        )
        == 0
    )
    return out


# lower ------------------------------------------------------------------------------------------


def test_lower_writes_archive_target_and_manifest(mlp_out):
    manifest = manifest_of(mlp_out)
    assert manifest["format"] == FORMAT and manifest["format_version"] == FORMAT_VERSION
    assert manifest["tool"] == {"name": "portable", "version": portable.__version__}
    assert set(manifest["toolchain"]) == {"python", "portable", "torch", "numpy", "safetensors"}
    prog = manifest["program"]
    assert (prog["name"], prog["kind"], prog["opset_version"]) == (
        "MLP",
        "inference",
        OPSET_VERSION,
    )
    assert [t["target"] for t in manifest["targets"]] == ["cpu"]
    assert (
        manifest["targets"][0]["dir"] == "cpu"
        and manifest["targets"][0]["can_execute_here"] is True
    )
    assert [p["spec"] for p in manifest["passes"]] == ["dce", "canonicalize"]
    assert all({"changed", "counts"} <= set(p) for p in manifest["passes"])
    assert set(manifest["timings"]) == {"capture", "passes", "save", "lower:cpu"}
    assert manifest["parity"] is None
    check_manifest_files(mlp_out, manifest)
    assert (mlp_out / "cpu" / "graph.txt").read_text().startswith("program MLP (inference")


def test_archive_loads_with_the_recorded_hash_and_passes(mlp_out):
    program = portable.load(mlp_out / "program.portable")
    assert program.content_hash == manifest_of(mlp_out)["program"]["content_hash"]
    assert program.metadata["passes"] == ["dce", "canonicalize"]


def test_lower_from_an_archive_keeps_the_program(mlp_out, tmp_path, capsys):
    code, _, _ = run(
        capsys,
        "lower",
        str(mlp_out / "program.portable"),
        "-t",
        "cpu",
        "--out",
        str(tmp_path / "o"),
        "--parity",
        "-q",
    )
    assert code == ExitCode.OK
    manifest = manifest_of(tmp_path / "o")
    assert manifest["source"]["kind"] == "archive"
    assert manifest["program"]["content_hash"] == manifest_of(mlp_out)["program"]["content_hash"]
    assert manifest["parity"]["ok"] is True


def test_train_on_an_inference_archive_is_a_user_error(mlp_out, tmp_path, capsys):
    code, _, err = run(
        capsys,
        "lower",
        str(mlp_out / "program.portable"),
        "-t",
        "cpu",
        "--train",
        "--out",
        str(tmp_path / "o"),
        "-q",
    )
    assert code == ExitCode.USER_ERROR
    assert "--train asks for a training step" in err and "inference" in err
    assert not (tmp_path / "o").exists()


def test_gpt_training_step_all_targets_parity_json(tmp_path, capsys):
    out = tmp_path / "gpt"
    code, stdout, err = run(
        capsys,
        "lower",
        GPT,
        "--target",
        "all",
        "--train",
        "--pass",
        "dce",
        "--pass",
        "canonicalize,dce",
        "--parity",
        "--json",
        "--out",
        str(out),
    )
    assert code == ExitCode.OK
    assert err == ""  # --json: no stage lines
    doc = json.loads(stdout)
    assert (doc["status"], doc["exit_code"], doc["out_dir"]) == ("ok", 0, str(out))
    manifest = doc["manifest"]
    assert manifest == manifest_of(out)
    assert (manifest["program"]["name"], manifest["program"]["kind"]) == (
        "GPT.train_step",
        "training_step",
    )
    # `all` with --train: every backend that lowers training steps (onnx exports inference only)
    training = [
        n
        for n in backend_registry.names()
        if portable.ProgramKind.TRAINING_STEP in get_backend(n).capabilities().program_kinds
    ]
    assert "onnx" in backend_registry.names() and "onnx" not in training
    assert [t["target"].split(":")[0] for t in manifest["targets"]] == training
    assert "neuron:trn3" in [t["target"] for t in manifest["targets"]]  # the default variant
    assert [p["spec"] for p in manifest["passes"]] == ["dce", "canonicalize", "dce"]
    parity = manifest["parity"]
    runnable = [n for n in training if get_backend(n).can_execute_here()[0]]
    assert parity["ok"] is True and parity["steps"] == 3 and parity["backends"] == runnable
    assert "xla" in runnable and "neuron" not in runnable
    assert [t["target"].split(":")[0] for t in parity["lowered_only"]] == [
        n for n in training if n not in runnable
    ]
    assert "neuron:trn3" in [t["target"] for t in parity["lowered_only"]]
    # check_parity's one policy (docs/testing.md): its defaults plus the measured allowance
    assert (parity["report"]["rtol"], parity["report"]["atol"]) == (1e-5, 1e-6)
    assert any(r["quantity"] == "loss step 3" for r in parity["report"]["rows"])
    check_manifest_files(out, manifest)
    assert portable.load(out / "program.portable").kind is portable.ProgramKind.TRAINING_STEP


def test_stage_lines_go_to_stderr(tmp_path, capsys):
    code, stdout, err = run(capsys, "lower", MLP, "-t", "cpu", "--out", str(tmp_path / "o"))
    assert code == ExitCode.OK
    lines = [line for line in err.splitlines() if line.startswith("[")]
    assert [line.split(" ...")[0] for line in lines] == [
        "[1/3] capturing MLP",
        "[2/3] saving program.portable",
        "[3/3] lowering for cpu",
    ]
    assert all(line.endswith("s") for line in lines)
    assert stdout.startswith(f"wrote {tmp_path / 'o'}: MLP (inference")


def test_parity_mismatch_exits_1_and_still_writes(tmp_path, capsys, monkeypatch):
    import portable.testing as testing

    def mismatching(program, inputs, **kw):
        row = testing.ParityRow("cpu", "output output", 1.0, 1.0, (0, 0), False)
        return testing.ParityReport(program.name, program.kind.value, "cpu", 1e-5, 1e-6, 1, (row,))

    monkeypatch.setattr(testing, "check_parity", mismatching)
    out = tmp_path / "o"
    code, stdout, _ = run(capsys, "lower", MLP, "-t", "cpu", "--parity", "--out", str(out), "-q")
    assert code == ExitCode.PARITY_MISMATCH
    assert "MISMATCH" in stdout and "parity: MISMATCH" in stdout
    assert manifest_of(out)["parity"]["ok"] is False


def test_targets_that_cannot_run_here_are_lowered_only(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(
        cpu_backend.CpuBackend, "can_execute_here", lambda self: (False, "no such device")
    )
    out = tmp_path / "o"
    code, stdout, _ = run(capsys, "lower", MLP, "-t", "cpu", "--parity", "--out", str(out), "-q")
    assert code == ExitCode.OK
    assert "cpu: lowered only (no such device)" in stdout
    manifest = manifest_of(out)
    assert manifest["parity"]["lowered_only"] == [{"target": "cpu", "reason": "no such device"}]
    assert manifest["targets"][0]["can_execute_here"] is False
    assert manifest["targets"][0]["reason"] == "no such device"


# output directory -------------------------------------------------------------------------------


def test_foreign_directory_is_refused_and_untouched(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    for extra in ([], ["--force"]):
        code, _, err = run(capsys, "lower", MLP, "-t", "cpu", "--out", str(out), "-q", *extra)
        assert code == ExitCode.OUTPUT_CONFLICT
        assert "portable did not write" in err and "notes.txt" in err
    assert files_on_disk(out) == {"notes.txt"} and (out / "notes.txt").read_text() == "keep me"
    assert no_leftovers(tmp_path) == []


def test_a_file_is_never_replaced(tmp_path, capsys):
    out = tmp_path / "file"
    out.write_text("x")
    code, _, err = run(capsys, "lower", MLP, "-t", "cpu", "--out", str(out), "-q", "--force")
    assert code == ExitCode.OUTPUT_CONFLICT and "not a directory" in err
    assert out.read_text() == "x"


def test_earlier_output_needs_force(mlp_out, tmp_path, capsys):
    import shutil

    out = tmp_path / "o"
    shutil.copytree(mlp_out, out)
    before = (out / "manifest.json").read_text()
    code, _, err = run(capsys, "lower", MLP, "-t", "cpu", "--out", str(out), "-q")
    assert code == ExitCode.OUTPUT_CONFLICT and "--force" in err
    assert (out / "manifest.json").read_text() == before
    code, _, _ = run(capsys, "lower", MLP, "-t", "cpu", "--out", str(out), "-q", "--force")
    assert code == ExitCode.OK
    manifest = manifest_of(out)
    assert manifest["passes"] == []  # the new run's, not the copied one's
    check_manifest_files(out, manifest)
    assert no_leftovers(tmp_path) == []


def test_portable_output_with_an_unlisted_file_is_foreign(mlp_out, tmp_path, capsys):
    import shutil

    out = tmp_path / "o"
    shutil.copytree(mlp_out, out)
    (out / "cpu" / "mine.txt").write_text("x")
    code, _, err = run(capsys, "lower", MLP, "-t", "cpu", "--out", str(out), "-q", "--force")
    assert code == ExitCode.OUTPUT_CONFLICT and "cpu/mine.txt" in err
    assert (out / "cpu" / "mine.txt").exists()


def test_an_empty_directory_is_filled(tmp_path, capsys):
    out = tmp_path / "empty"
    out.mkdir()
    assert run(capsys, "lower", MLP, "-t", "cpu", "--out", str(out), "-q")[0] == ExitCode.OK
    check_manifest_files(out, manifest_of(out))


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (BackendError("compiler crashed"), ExitCode.BACKEND_ERROR),
        (RuntimeError("bug"), ExitCode.INTERNAL_ERROR),
    ],
)
def test_failure_mid_lowering_leaves_nothing(tmp_path, capsys, monkeypatch, error, code):
    def broken(self, lowered, out_dir=None):
        (out_dir / "partial.bin").write_bytes(b"half")
        raise error

    monkeypatch.setattr(cpu_backend.CpuBackend, "write", broken)  # the stage that writes
    out = tmp_path / "o"
    got, _, err = run(capsys, "lower", MLP, "-t", "cpu", "--out", str(out))
    assert got == code
    assert "lowering for cpu ... failed" in err and str(error) in err
    assert not out.exists()
    assert no_leftovers(tmp_path) == []


# user errors ------------------------------------------------------------------------------------


def test_unknown_backend_lists_known_ones(tmp_path, capsys):
    code, _, err = run(capsys, "lower", MLP, "-t", "nope", "--out", str(tmp_path / "o"))
    assert code == ExitCode.USER_ERROR
    assert err.startswith("error: unknown backend 'nope'")
    assert all(name in err for name in backend_registry.names())
    assert "Traceback" not in err and not (tmp_path / "o").exists()


def test_unknown_pass_lists_known_ones(tmp_path, capsys):
    code, _, err = run(
        capsys, "lower", MLP, "-t", "cpu", "-p", "dce,bogus", "--out", str(tmp_path / "o")
    )
    assert code == ExitCode.USER_ERROR
    assert "unknown pass 'bogus'" in err and all(name in err for name in pass_registry.names())


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("missing/model.py:MLP", "no such file: missing/model.py"),
        (f"{EXAMPLES / 'mlp.py'}:Nope", "has no attribute 'Nope'"),
        (f"{EXAMPLES / 'mlp.py'}:BATCH", "`BATCH` in"),
        ("portable.errors:CaptureError", "is not decorated with @portable"),
        ("no_such_pkg.models:GPT", "no module named 'no_such_pkg'"),
        ("just-a-word", "cannot read SPEC"),
    ],
)
def test_bad_spec_is_a_user_error(tmp_path, capsys, spec, message):
    code, _, err = run(capsys, "lower", spec, "-t", "cpu", "--out", str(tmp_path / "o"))
    assert code == ExitCode.USER_ERROR
    assert err.startswith("error: ") and message in err and "fix:" in err
    assert "Traceback" not in err


def test_missing_attribute_names_the_decorated_objects(tmp_path, capsys):
    _, _, err = run(capsys, "inspect", f"{EXAMPLES / 'gpt.py'}:Gpt")
    assert "@portable objects there: GPT" in err


def test_debug_prints_the_traceback(tmp_path, capsys):
    code, _, err = run(
        capsys, "--debug", "lower", "missing.py:X", "-t", "cpu", "--out", str(tmp_path / "o")
    )
    assert code == ExitCode.USER_ERROR and "Traceback" in err
    code, _, err = run(
        capsys, "lower", "missing.py:X", "-t", "cpu", "--out", str(tmp_path / "o"), "--debug"
    )
    assert code == ExitCode.USER_ERROR and "Traceback" in err


def test_json_error_document(tmp_path, capsys):
    code, stdout, _ = run(
        capsys, "lower", "missing.py:X", "-t", "cpu", "--out", str(tmp_path / "o"), "--json"
    )
    doc = json.loads(stdout)
    assert doc["status"] == "error" and doc["exit_code"] == code == ExitCode.USER_ERROR
    assert doc["error"]["type"] == "CaptureError" and "missing.py" in doc["error"]["message"]


def test_usage_errors_exit_2(capsys):
    assert run(capsys, "lower", MLP)[0] == ExitCode.USAGE
    assert run(capsys, "frobnicate")[0] == ExitCode.USAGE
    code, stdout, _ = run(capsys, "--help")
    assert code == ExitCode.OK and "exit codes:" in stdout and "70" in stdout


# inspect and listings ---------------------------------------------------------------------------


def test_inspect_archive_shows_the_op_histogram(mlp_out, capsys):
    code, stdout, _ = run(capsys, "inspect", str(mlp_out / "program.portable"))
    assert code == ExitCode.OK
    assert f"program MLP (inference, opset {OPSET_VERSION})" in stdout
    assert "passes applied: dce, canonicalize" in stdout
    histogram = stdout.split("ops (")[1].split("\n\n")[0]
    assert "aten.addmm.default  2" in histogram and "aten.gelu.default" in histogram
    assert f"{MLP_PARAMS:,} parameters" in stdout
    assert "plan: single device" in stdout


def test_inspect_json_and_text(mlp_out, capsys):
    code, stdout, _ = run(capsys, "inspect", str(mlp_out / "program.portable"), "--json", "--text")
    assert code == ExitCode.OK
    doc = json.loads(stdout)
    program = portable.load(mlp_out / "program.portable")
    assert (
        doc["ops"]["aten.addmm.default"] == 2 and sum(doc["ops"].values()) == doc["totals"]["ops"]
    )
    assert doc["totals"]["parameters"] == MLP_PARAMS
    assert doc["totals"]["parameter_bytes"] == MLP_PARAMS * 4
    assert doc["program"]["content_hash"] == program.content_hash
    assert doc["text"] == program.text()
    assert [i["kind"] for i in doc["signature"]["inputs"]][-1] == "user_input"
    assert doc["plan"]["single_device"] is True


def test_inspect_training_spec_shows_aliasing(capsys):
    code, stdout, _ = run(capsys, "inspect", MLP, "--train", "--json")
    assert code == ExitCode.OK
    doc = json.loads(stdout)
    assert doc["program"]["kind"] == "training_step"
    aliased = [o for o in doc["signature"]["outputs"] if o["aliases"]]
    assert aliased and all(o["kind"] in ("updated_parameter", "updated_state") for o in aliased)
    assert any(s["kind"] == "optimizer_state" for s in doc["state"])


def test_backends_listing(capsys):
    code, stdout, _ = run(capsys, "backends", "--json")
    rows = json.loads(stdout)
    assert code == ExitCode.OK and [r["name"] for r in rows] == backend_registry.names()
    cpu = rows[0]
    assert cpu["can_execute_here"] is True and set(cpu["program_kinds"]) == {
        "inference",
        "training_step",
    }
    assert 0 < cpu["ops"] <= len(opset_table())
    code, stdout, _ = run(capsys, "backends")
    assert stdout.splitlines()[0].split() == [
        "name",
        "program",
        "kinds",
        "variants",
        "ops",
        "runs",
        "here",
        "reason",
    ]


def test_passes_listing(capsys):
    code, stdout, _ = run(capsys, "passes", "--json")
    rows = {r["name"]: r for r in json.loads(stdout)}
    assert code == ExitCode.OK and sorted(rows) == pass_registry.names()
    assert rows["canonicalize"]["options"] == [
        {"name": "disable", "type": "str", "default": "", "required": False}
    ]
    assert rows["dce"]["options"] == [] and rows["dce"]["summary"]
    code, stdout, _ = run(capsys, "passes")
    assert "disable: str = ''" in stdout


def test_ops_listing(capsys):
    code, stdout, _ = run(capsys, "ops", "--json")
    rows = json.loads(stdout)
    assert code == ExitCode.OK and [r["name"] for r in rows] == list(opset_table())
    add = rows[0]
    assert set(add) == {"name", "dtypes", "shape", "semantics", "signature"}
    code, stdout, _ = run(capsys, "ops")
    assert "portable.attention.default" in stdout and "softmax(q @ k^T" in stdout


# the console module -----------------------------------------------------------------------------


def test_console_module_in_a_subprocess(tmp_path):
    out = tmp_path / "o"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "portable.cli",
            "lower",
            MLP,
            "--target",
            "cpu",
            "--out",
            str(out),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "RuntimeWarning" not in proc.stderr and "[1/" not in proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["status"] == "ok" and doc["manifest"]["program"]["name"] == "MLP"
    check_manifest_files(out, manifest_of(out))


# helpers ----------------------------------------------------------------------------------------


def test_targets_expand_all_and_drop_repeats():
    from portable.backends import Target, registry
    from portable.cli.lower import parse_targets, target_dir

    # a bare target is its backend's default variant: `all` lowers neuron for trn3
    every = [Target(n, get_backend(n).capabilities().default_variant) for n in registry.names()]
    assert parse_targets(["cpu", "all", " cpu "]) == every
    assert {"cpu", "xla", "neuron", "onnx"} <= {t.backend for t in every}
    assert Target("neuron", "trn3") in every and Target("cuda") in every
    assert parse_targets(["neuron", "neuron:trn3"]) == [Target("neuron", "trn3")]
    training = parse_targets(["all"], training=True)  # backends that lower training steps
    assert Target("onnx") not in training and {"cpu", "xla"} <= {t.backend for t in training}
    assert target_dir(Target("neuron", "trn2")) == "neuron_trn2"
    # a backend that lowers several variants together gets one folder, variants merged
    assert target_dir(Target("cuda", "sm_90")) == "cuda"
    merged = parse_targets(["cuda:sm_90", "cpu", "cuda:sm_100", "cuda:sm_90"])
    assert merged == [Target("cuda", "sm_90,sm_100"), Target("cpu")]
    assert parse_targets(["cuda:sm_100", "cuda"]) == [Target("cuda")]
    assert (
        "/" not in target_dir(Target("x", "../../etc"))
        and target_dir(Target("x", "../../etc")) != ".."
    )


def test_progress_on_a_terminal_prints_the_label_first():
    import io

    from portable.cli.progress import Progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    progress = Progress(2, enabled=True, stream=stream)
    with progress.stage("a", "doing a"):
        assert stream.getvalue() == "[1/2] doing a ... "
    with pytest.raises(ValueError), progress.stage("b", "doing b"):
        raise ValueError
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("[1/2] doing a ... ") and lines[0].endswith("s")
    assert lines[1].startswith("[2/2] doing b ... failed after ")
    assert set(progress.timings) == {"a", "b"}


def test_parity_after_a_quantizing_pass_skips_the_eager_comparison(tmp_path, capsys):
    """mx-quantize changes the numbers on purpose: backends are still compared with `cpu`, the
    quantized `cpu` program is not compared with the unquantized eager model."""
    out = tmp_path / "o"
    code, stdout, _ = run(
        capsys, "lower", MLP, "-p", "mx-quantize{keep_first_last=false}", "-t", "cpu",
        "--parity", "--json", "--out", str(out),
    )  # fmt: skip
    assert code == ExitCode.OK
    manifest = json.loads(stdout)["manifest"]
    assert manifest["parity"]["eager_compared"] is False
    assert manifest["passes"][0]["counts"]["forward"] == 2
    assert {layer["module"] for layer in manifest["passes"][0]["layers"]} == {"fc1", "fc2"}
