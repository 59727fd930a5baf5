"""Compiling `neuron` outputs with neuronx-cc, and `portable check`.

The real compiler is not installable here, so `tests/fixtures/fake_neuronx_cc` stands in for it:
each test that compiles copies it into a temporary bin directory as `neuronx-cc` (its shebang set
to this interpreter, which has jaxlib) and puts that directory first on PATH. The fake checks the
argv and parses the HLO proto with jaxlib, and fails on request (FAKE_NEURONX_CC_* variables) the
way the real compiler does: SIGKILL (host out of memory), SIGABRT / SIGSEGV (crash), an NCC_ error.
Program directories are either hand-made from HLO text (compile.py alone) or written by
`portable lower --target neuron:trn3` (the CLI). One test runs the real compiler when it is on
PATH and skips otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from portable.backends.neuron import compile as ncc
from portable.cli import ExitCode, main

REPO = Path(__file__).resolve().parents[1]
FAKE = REPO / "tests" / "fixtures" / "fake_neuronx_cc"
MLP = f"{REPO / 'examples' / 'mlp.py'}:MLP"
COMMAND = [
    "neuronx-cc",
    "compile",
    "--framework=XLA",
    "--target=trn3",
    "model/graph.hlo",
    "--output",
    "graph.neff",
    "--logfile",
    "log-neuron-cc.txt",
    "--model-type=transformer",
    "--auto-cast=none",
    "--logical-nc-config=2",
    "-O1",
    "--native-int64=disabled",
    "--implicit-integer-downcast=all",
    "--verbose=35",
]
TUPLE_HLO = """HloModule m, entry_computation_layout={(f32[4]{0})->(f32[4]{0})}

ENTRY main {
  p0 = f32[4]{0} parameter(0)
  s = f32[4]{0} sine(p0)
  ROOT t = (f32[4]{0}) tuple(s)
}
"""
SHARDING_HLO = TUPLE_HLO.replace(
    "s = f32[4]{0} sine(p0)",
    's = f32[4]{0} custom-call(p0), custom_call_target="xla.sdy.Sharding"',
)
REAL_COMPILER = shutil.which("neuronx-cc")


def hlo_proto(text: str) -> bytes:
    from jaxlib import _hlo

    return _hlo.hlo_module_from_text(text).as_serialized_hlo_module_proto()


def make_program(
    root: Path, key: str = "p0", *, hlo: bytes | None = None, argv: list[str] = COMMAND
) -> Path:
    """A `programs/<key>/` directory as the neuron backend writes it (command one arg a line)."""
    folder = root / "programs" / key
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "graph.hlo").write_bytes(hlo if hlo is not None else hlo_proto(TUPLE_HLO))
    (folder / "command.txt").write_text("\n".join(argv) + "\n")
    return folder


@pytest.fixture
def fake_cc(tmp_path_factory, monkeypatch) -> Path:
    """`neuronx-cc` (the fake) first on PATH; no FAKE_* knob set. Returns the argv log path."""
    bin_dir = tmp_path_factory.mktemp("bin")
    exe = bin_dir / "neuronx-cc"
    lines = FAKE.read_text().splitlines(keepends=True)
    exe.write_text(f"#!{sys.executable}\n" + "".join(lines[1:]))
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    for name in list(os.environ):
        if name.startswith("FAKE_NEURONX_CC_"):
            monkeypatch.delenv(name)
    argv_log = bin_dir / "argv.jsonl"
    monkeypatch.setenv("FAKE_NEURONX_CC_ARGV_LOG", str(argv_log))
    return argv_log


@pytest.fixture
def no_cc(tmp_path_factory, monkeypatch) -> None:
    """PATH holds no `neuronx-cc` (an empty directory only)."""
    monkeypatch.setenv("PATH", str(tmp_path_factory.mktemp("empty-bin")))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# compile.py with hand-made programs -------------------------------------------------------------


def test_available_reports_the_version_or_why_not(fake_cc, monkeypatch, tmp_path):
    assert ncc.neuronx_cc_available() == (True, "2.99.0.0+fake")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert ncc.neuronx_cc_available() == (False, "neuronx-cc not on PATH")


def test_compile_program_writes_neff_and_log(fake_cc, tmp_path):
    folder = make_program(tmp_path)
    result = ncc.compile_program(folder)
    assert result.ok and result.status == "pass" and result.returncode == 0
    assert result.neff == folder.resolve() / "graph.neff" and result.neff.is_file()
    assert result.neff_sha256 == sha256(result.neff)
    assert result.log == folder.resolve() / "log-neuron-cc.txt"
    assert "Compiler status PASS" in result.log.read_text()
    assert result.codes == () and result.error is None and result.seconds > 0
    # the compiler ran in the program directory with exactly the argv of command.txt
    (call,) = [json.loads(line) for line in fake_cc.read_text().splitlines()]
    assert call == {"cwd": str(folder.resolve()), "argv": COMMAND[1:]}
    record = result.to_json(tmp_path.resolve())
    assert record["neff"] == "programs/p0/graph.neff" and record["status"] == "pass"


def test_equal_programs_give_equal_neffs(fake_cc, tmp_path):
    proto = hlo_proto(TUPLE_HLO)
    a = ncc.compile_program(make_program(tmp_path, "a", hlo=proto))
    b = ncc.compile_program(make_program(tmp_path, "b", hlo=proto))
    other = ncc.compile_program(make_program(tmp_path, "c", hlo=hlo_proto(TUPLE_HLO + "\n")))
    assert a.neff_sha256 == b.neff_sha256 != other.neff_sha256


def test_shell_quoted_command_is_accepted(fake_cc, tmp_path):
    folder = make_program(tmp_path)
    line = " ".join(COMMAND[:8]) + " \\\n  " + " ".join(COMMAND[8:])
    (folder / "command.txt").write_text(f"# compile program p0\n{line}\n")
    assert ncc.read_command(folder) == COMMAND
    assert ncc.compile_program(folder).ok


@pytest.mark.parametrize(
    ("mode", "status", "returncode", "phrases"),
    [
        ("oom", "out_of_memory", -9, ["SIGKILL", "host ran out of memory", "fewer compiles"]),
        ("crash", "crashed", -6, ["crashed (signal SIGABRT, exit -6)", "compiler bug"]),
        ("segv", "crashed", -11, ["crashed (signal SIGSEGV, exit -11)"]),
        ("unsupported", "failed", 1, ["(exit 1): NCC_EVRF001", "operator the compiler does not"]),
        ("nopass", "failed", 0, ["exited 0", "no 'Compiler status PASS'"]),
        (  # a three-letter code family; every code of the output is listed and explained
            "cfg",
            "failed",
            1,
            [
                "(exit 1): NCC_CFG015, NCC_EVRF011",
                "NCC_CFG015: control-flow graph validation overflowed",
                "NCC_EVRF011: a strided convolution with input (lhs) dilation",
            ],
        ),
    ],
)
def test_failures_are_explained(fake_cc, monkeypatch, tmp_path, mode, status, returncode, phrases):
    folder = make_program(tmp_path, "block3")
    (folder / "graph.neff").write_bytes(b"stale NEFF of an earlier run")
    monkeypatch.setenv("FAKE_NEURONX_CC_FAIL", mode)
    with pytest.raises(ncc.NeuronCompileError) as info:
        ncc.compile_program(folder)
    message = str(info.value)
    assert "program block3" in message and "fix:" in message
    assert f"log: {folder.resolve() / 'log-neuron-cc.txt'}" in message
    assert f"rerun: cd {folder.resolve()} && neuronx-cc compile --framework=XLA" in message
    for phrase in phrases:
        assert phrase in message
    result = info.value.result
    assert (result.status, result.returncode, result.ok) == (status, returncode, False)
    assert result.neff is None and not (folder / "graph.neff").exists()  # the stale one is gone
    assert result.log.is_file() and result.error == message


def test_unknown_custom_call_fails_with_ncc_code(fake_cc, tmp_path):
    folder = make_program(tmp_path, hlo=hlo_proto(SHARDING_HLO))
    with pytest.raises(ncc.NeuronCompileError) as info:
        ncc.compile_program(folder)
    assert info.value.result.codes == ("NCC_EHCA005",)
    message = str(info.value)
    assert "custom call whose target the compiler does not recognise" in message
    assert "xla.sdy.Sharding" in message  # from the compiler's output


def test_input_that_is_not_hlo_fails(fake_cc, tmp_path):
    folder = make_program(tmp_path, hlo=b"not a proto")
    with pytest.raises(ncc.NeuronCompileError) as info:
        ncc.compile_program(folder)
    assert info.value.result.codes == ("NCC_XFAK001",)
    assert "NCC_XFAK001: a code portable has no explanation for" in str(info.value)


@pytest.mark.parametrize(
    ("drop", "add", "complaint"),
    [
        ("--native-int64=disabled", None, "--native-int64 must be pinned"),
        ("--implicit-integer-downcast=all", None, "--implicit-integer-downcast must be pinned"),
        ("--target=trn3", "--target=trn9", "invalid choice 'trn9'"),
        ("--target=trn3", "--target=trn1", "--logical-nc-config is not supported"),
        ("--verbose=35", "--no-such-flag", "unrecognized arguments: --no-such-flag"),
    ],
)
def test_fake_compiler_checks_the_argv(fake_cc, tmp_path, drop, add, complaint):
    argv = [a for a in COMMAND if a != drop] + ([add] if add else [])
    with pytest.raises(ncc.NeuronCompileError) as info:
        ncc.compile_program(make_program(tmp_path, argv=argv))
    assert info.value.result.returncode == 2 and complaint in str(info.value)


def test_timeout_stops_the_compiler(fake_cc, monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_NEURONX_CC_SLEEP", "60")
    with pytest.raises(ncc.NeuronCompileError) as info:
        ncc.compile_program(make_program(tmp_path), timeout=2)
    result = info.value.result
    assert result.status == "timeout" and result.seconds < 30
    assert "did not finish program p0 within 2s" in str(info.value)


def test_compile_all_runs_every_program_and_collects_failures(fake_cc, monkeypatch, tmp_path):
    for key in ("stage1", "stage0", "stage2"):
        make_program(tmp_path, key)
    monkeypatch.setenv("FAKE_NEURONX_CC_FAIL", "oom")
    monkeypatch.setenv("FAKE_NEURONX_CC_ONLY", "stage1")
    results = ncc.compile_all(tmp_path, jobs=2)
    assert [(r.program, r.status) for r in results] == [
        ("stage0", "pass"),
        ("stage1", "out_of_memory"),
        ("stage2", "pass"),
    ]
    assert "SIGKILL" in results[1].error
    assert len(fake_cc.read_text().splitlines()) == 3


def test_compile_all_without_programs(fake_cc, tmp_path):
    with pytest.raises(ncc.NeuronCompileError, match="holds no programs"):
        ncc.compile_all(tmp_path)


def test_compile_without_compiler(no_cc, tmp_path):
    with pytest.raises(ncc.NeuronCompileError, match="neuronx-cc not on PATH"):
        ncc.compile_program(make_program(tmp_path))
    assert ncc.neuronx_cc_available() == (False, "neuronx-cc not on PATH")


def test_only_the_compiler_is_run(fake_cc, tmp_path):
    folder = make_program(tmp_path, argv=["rm", "-rf", "model"])
    with pytest.raises(ncc.NeuronCompileError, match="is not a `neuronx-cc compile` command"):
        ncc.compile_program(folder)
    assert (folder / "model" / "graph.hlo").exists()


def test_outputs_outside_the_program_are_refused(fake_cc, tmp_path):
    victim = tmp_path / "keep.txt"
    victim.write_text("not a NEFF")
    argv = [a if a != "graph.neff" else "../../keep.txt" for a in COMMAND]
    with pytest.raises(ncc.NeuronCompileError, match="outside the program directory"):
        ncc.compile_program(make_program(tmp_path, argv=argv))
    assert victim.read_text() == "not a NEFF" and not fake_cc.exists()


def test_code_table_explains_the_documented_codes():
    # every code of the 2.32 error-code reference's index, and the release notes' CFG015
    documented = "EARG001 EBIR023 EBVF030 EHCA005 EMOD025 EOOM001 EOOM002 ESFH002 ESPP004 "
    documented += "ESPP047 EUOC002 EXSP001 EXTP004 CFG015 "
    documented += " ".join(f"EVRF{n:03d}" for n in (1, 4, 5, 6, 7, 9, 10, 11, 13, 15, 16))
    documented += " " + " ".join(f"EVRF{n:03d}" for n in (17, 18, 19, 22, 31, *range(35, 66)))
    for code in documented.split():
        meaning, fix = ncc.NCC_CODES[f"NCC_{code}"]
        assert meaning and fix
    assert ncc.explain_codes(["NCC_EMOD025", "NCC_EZZZ999"]) == [
        "NCC_EMOD025: a dynamic shape: every tensor dimension must be static",
        "NCC_EZZZ999: a code portable has no explanation for",
    ]


# portable lower --compile -----------------------------------------------------------------------


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def listed(manifest: dict) -> dict[str, dict]:
    records = manifest["program"]["files"] + [f for t in manifest["targets"] for f in t["files"]]
    return {r["path"]: r for r in records}


def test_lower_compile_writes_neff_log_and_manifest(fake_cc, tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, err = run(
        capsys, "lower", MLP, "-t", "neuron:trn3", "-t", "cpu", "--compile", "--out", str(out)
    )
    assert code == ExitCode.OK, err
    program = out / "neuron_trn3" / "programs" / "MLP"
    assert (program / "graph.neff").is_file() and (program / "log-neuron-cc.txt").is_file()
    manifest = json.loads((out / "manifest.json").read_text())
    neuron, cpu = manifest["targets"]
    assert cpu["compile"] is None
    record = neuron["compile"]
    assert record["compiler"] == "neuronx-cc" and record["version"] == "2.99.0.0+fake"
    assert record["ok"] is True and record["jobs"] == 1
    (entry,) = record["programs"]
    assert entry["program"] == "MLP" and entry["status"] == "pass" and entry["returncode"] == 0
    assert entry["neff"] == "neuron_trn3/programs/MLP/graph.neff"
    assert entry["log"] == "neuron_trn3/programs/MLP/log-neuron-cc.txt"
    assert entry["neff_sha256"] == sha256(program / "graph.neff") and entry["seconds"] > 0
    assert entry["codes"] == [] and entry["error"] is None
    # the NEFF and the log are listed with their hashes, like every other file
    files = listed(manifest)
    assert files[entry["neff"]]["sha256"] == entry["neff_sha256"]
    for path, rec in files.items():
        assert sha256(out / path) == rec["sha256"], path
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert on_disk == set(files) | {"manifest.json"}
    assert manifest["timings"]["compile:neuron:trn3"] > 0
    assert "compiled neuron:trn3: 1/1 program(s) passed" in stdout
    assert "compiling neuron:trn3 with neuronx-cc 2.99.0.0+fake" in err and "MLP: ok" in err
    # a compiled output is an ordinary portable output: --force replaces it
    assert run(capsys, "lower", MLP, "-t", "neuron:trn3", "--out", str(out), "--force")[0] == 0
    assert not (program / "graph.neff").exists()


def test_lower_compile_without_compiler_refuses_before_capture(no_cc, tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, err = run(capsys, "lower", MLP, "-t", "neuron:trn3", "--compile", "-o", str(out))
    assert code == ExitCode.COMPILER_MISSING == 7
    assert "error: --compile needs the Neuron compiler: neuronx-cc not on PATH" in err
    assert "scripts/compile.sh" in err and "capturing" not in err
    assert not out.exists() and stdout == ""


def test_lower_compile_without_compiler_json(no_cc, tmp_path, capsys):
    code, stdout, _ = run(
        capsys, "lower", MLP, "-t", "neuron", "--compile", "-o", str(tmp_path / "o"), "--json"
    )
    doc = json.loads(stdout)
    assert doc["status"] == "error" and doc["exit_code"] == code == 7
    assert doc["error"]["type"] == "CompilerMissingError"


def test_lower_compile_needs_a_neuron_target(fake_cc, tmp_path, capsys):
    code, _, err = run(capsys, "lower", MLP, "-t", "cpu", "--compile", "-o", str(tmp_path / "o"))
    assert code == ExitCode.USER_ERROR
    assert "--compile compiles neuron targets, and none was given (targets: cpu)" in err


@pytest.mark.parametrize(
    ("mode", "status", "phrase"),
    [
        ("unsupported", "failed", "(exit 1): NCC_EVRF001"),
        ("oom", "out_of_memory", "the host ran out of memory"),
        ("crash", "crashed", "crashed (signal SIGABRT, exit -6)"),
    ],
)
def test_lower_compile_failure_keeps_output_and_explains(
    fake_cc, monkeypatch, tmp_path, capsys, mode, status, phrase
):
    monkeypatch.setenv("FAKE_NEURONX_CC_FAIL", mode)
    out = tmp_path / "out"
    code, stdout, err = run(
        capsys, "lower", MLP, "-t", "neuron:trn3", "--compile", "-o", str(out), "--json"
    )
    assert code == ExitCode.COMPILE_FAILED == 8
    doc = json.loads(stdout)
    assert doc["status"] == "compile_failed" and doc["exit_code"] == 8
    (entry,) = doc["manifest"]["targets"][0]["compile"]["programs"]
    assert entry["status"] == status and entry["neff"] is None and phrase in entry["error"]
    # the output is in place, with the log; messages name DIR, not the staging directory
    program = out / "neuron_trn3" / "programs" / "MLP"
    assert (program / "log-neuron-cc.txt").is_file() and not (program / "graph.neff").exists()
    assert "error: neuron:trn3: neuronx-cc" in err and phrase in err
    assert f"log: {program.resolve() / 'log-neuron-cc.txt'}" in err
    assert ".out.tmp-" not in err and ".out.tmp-" not in entry["error"]
    assert doc["manifest"] == json.loads((out / "manifest.json").read_text())


@pytest.mark.skipif(
    REAL_COMPILER is None, reason="neuronx-cc (AWS Neuron SDK) is not on PATH on this machine"
)
def test_real_compiler_compiles_the_mlp(tmp_path, capsys):
    ok, version = ncc.neuronx_cc_available()
    assert ok, version
    out = tmp_path / "out"
    code, _, err = run(capsys, "lower", MLP, "-t", "neuron:trn3", "--compile", "-o", str(out))
    assert code == ExitCode.OK, err
    manifest = json.loads((out / "manifest.json").read_text())
    (entry,) = manifest["targets"][0]["compile"]["programs"]
    assert entry["status"] == "pass" and (out / entry["neff"]).stat().st_size > 0
    assert "Compiler status PASS" in (out / entry["log"]).read_text()


# portable check ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lowered(tmp_path_factory) -> Path:
    """A fresh `portable lower MLP --target neuron:trn3` output (copy it before changing it)."""
    out = tmp_path_factory.mktemp("check") / "out"
    assert main(["lower", MLP, "-t", "neuron:trn3", "-o", str(out), "-q"]) == 0
    return out


def test_a_bare_neuron_target_is_trn3_and_portable_check_finds_it(tmp_path, capsys):
    """`-t neuron` (and `-t all`) lowers for the default variant and writes `neuron_trn3/`, the
    folder the docs name and `portable check` looks in (was `neuron/`: check found nothing)."""
    out = tmp_path / "out"
    code, stdout, err = run(capsys, "lower", MLP, "-t", "neuron", "-o", str(out), "--json")
    assert code == ExitCode.OK, err
    (target,) = json.loads(stdout)["manifest"]["targets"]
    assert (target["target"], target["dir"]) == ("neuron:trn3", "neuron_trn3")
    assert sorted(p.name for p in out.iterdir()) == [
        "manifest.json",
        "neuron_trn3",
        "program.portable",
    ]
    code, stdout, _ = run(capsys, "check", str(out))
    assert code == ExitCode.OK and "neuron_trn3/programs/MLP: 0 error(s)" in stdout


def test_an_unknown_variant_is_refused_before_capture(tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, err = run(capsys, "lower", MLP, "-t", "neuron:trn9", "-o", str(out))
    assert code == ExitCode.BACKEND_ERROR
    assert "error: unknown target neuron:trn9" in err and "trn3, trn2, trn1" in err
    assert "capturing" not in err and not out.exists() and stdout == ""


def copy_of(lowered: Path, tmp_path: Path) -> tuple[Path, Path]:
    out = tmp_path / "out"
    shutil.copytree(lowered, out)
    return out, out / "neuron_trn3" / "programs" / "MLP"


def test_check_passes_on_a_fresh_lowering(lowered, capsys):
    code, stdout, _ = run(capsys, "check", str(lowered))
    assert code == ExitCode.OK
    assert "neuron_trn3/programs/MLP: 0 error(s)" in stdout
    assert f"checked 1 program(s) in {lowered}: 0 error(s)" in stdout and stdout.endswith("ok\n")
    code, stdout, _ = run(capsys, "check", str(lowered / "neuron_trn3"), "--json")
    doc = json.loads(stdout)
    assert code == 0 and doc["status"] == "ok" and doc["errors"] == 0
    (program,) = doc["programs"]
    assert program["program"] == "MLP" and program["target"] == "trn3"


def test_check_passes_on_a_compiled_output(fake_cc, tmp_path, capsys):
    out = tmp_path / "out"
    assert run(capsys, "lower", MLP, "-t", "neuron:trn3", "--compile", "-o", str(out))[0] == 0
    assert run(capsys, "check", str(out))[0] == ExitCode.OK


def test_check_finds_float64_in_a_tampered_program(lowered, tmp_path, capsys):
    from portable.backends.neuron.hlo import proto_from_text

    out, program = copy_of(lowered, tmp_path)
    text = (program / "model" / "graph.hlo.txt").read_text().replace("f32", "f64")
    (program / "model" / "graph.hlo").write_bytes(proto_from_text(text))
    code, stdout, _ = run(capsys, "check", str(out))
    assert code == ExitCode.CHECK_FINDINGS == 6
    assert "error[dtype-f64] float64 value" in stdout
    assert "examples/mlp.py:35" in stdout  # findings point at the user's line
    assert "warning[artifact-modified]" in stdout and stdout.endswith("FINDINGS\n")
    code, stdout, _ = run(capsys, "check", str(out), "--json")
    doc = json.loads(stdout)
    assert doc["status"] == "findings" and doc["exit_code"] == code == 6
    codes = {f["code"] for f in doc["programs"][0]["findings"]}
    assert {"dtype-f64", "artifact-modified"} <= codes


def test_check_finds_a_broken_command_and_a_missing_hlo(lowered, tmp_path, capsys):
    out, program = copy_of(lowered, tmp_path)
    command = (program / "command.txt").read_text()
    (program / "command.txt").write_text(command.replace(" --native-int64=disabled", ""))
    (program / "model" / "graph.hlo").unlink()
    code, stdout, _ = run(capsys, "check", str(out))
    assert code == ExitCode.CHECK_FINDINGS
    assert "error[artifact-command] command.txt: the int64 flags are not pinned" in stdout
    assert "--native-int64=disabled missing" in stdout
    assert "error[artifact-hlo] model/graph.hlo is missing" in stdout


def test_check_strict_counts_warnings(lowered, tmp_path, capsys):
    out, _ = copy_of(lowered, tmp_path)
    manifest_path = out / "neuron_trn3" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["programs"][0]["hlo_sha256"] = "0" * 64  # graph.hlo is valid, but not as recorded
    manifest_path.write_text(json.dumps(manifest))
    code, stdout, _ = run(capsys, "check", str(out))
    assert code == ExitCode.OK and "warning[artifact-modified]" in stdout
    code, stdout, _ = run(capsys, "check", str(out), "--strict")
    assert code == ExitCode.CHECK_FINDINGS and stdout.endswith("FINDINGS\n")


def test_check_without_neuron_programs(tmp_path, capsys):
    code, _, err = run(capsys, "check", str(tmp_path))
    assert code == ExitCode.USER_ERROR and "holds no neuron program" in err


def test_log_parser_reads_three_and_four_letter_code_families(fake_cc, monkeypatch, tmp_path):
    folder = make_program(tmp_path)
    (folder / "log-neuron-cc.txt").unlink(missing_ok=True)
    monkeypatch.setenv("FAKE_NEURONX_CC_FAIL", "cfg")
    with pytest.raises(ncc.NeuronCompileError) as info:
        ncc.compile_program(folder)
    assert info.value.result.codes == ("NCC_CFG015", "NCC_EVRF011")
    lines = "ERROR [NCC_CFG015] x\nsee NCC_EVRF001, not NCC_EVRF0011 or NCC_AB001 or XNCC_EVRF002"
    assert ncc._CODE.findall(lines) == ["NCC_CFG015", "NCC_EVRF001"]


def test_native_int64_is_refused_before_trn2(fake_cc, tmp_path):
    """The CLI reference: --native-int64 is "only available on trn2 and later"."""
    trn1 = [a for a in COMMAND if a != "--logical-nc-config=2"]
    trn1[trn1.index("--target=trn3")] = "--target=trn1"
    with pytest.raises(ncc.NeuronCompileError) as info:
        ncc.compile_program(make_program(tmp_path, argv=trn1))
    assert "only available on trn2 and later" in str(info.value)
    without = [a for a in trn1 if a != "--native-int64=disabled"]
    assert ncc.compile_program(make_program(tmp_path, "trn1", argv=without)).ok


@pytest.mark.parametrize(
    ("variant", "flags", "problems"),
    [
        ("trn3", ["--native-int64=disabled", "--implicit-integer-downcast=all"], []),
        ("trn1", ["--implicit-integer-downcast=all"], []),
        (
            "trn1",
            ["--native-int64=disabled", "--implicit-integer-downcast=all"],
            ["--native-int64=disabled is only available on trn2 and later, not trn1"],
        ),
        (
            "trn2",
            ["--implicit-integer-downcast=all"],
            ["the int64 flags are not pinned (--native-int64=disabled missing)"],
        ),
    ],
)
def test_check_pins_the_int64_flags_per_target(variant, flags, problems):
    from portable.backends.neuron.check import _int64_problems

    assert _int64_problems(["neuronx-cc", "compile", *flags], variant) == problems
