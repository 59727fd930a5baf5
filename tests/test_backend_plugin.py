"""A backend with a real toolchain, added as a plug-in through the `portable.backends` entry
point, gets `portable backends`, `lower` (with options in the target string), `lower --compile`,
`--parity` and `check` with no change to the CLI (issue 14, item 5).

The plug-in is a distribution on a temporary path (a package and its `.dist-info` with
`entry_points.txt`), found by `importlib.metadata` like an installed one, in a fresh interpreter.
Its toolchain is a Python function that "compiles" each written program to a file; its check
reports a program whose compiled file was removed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MLP = f"{REPO / 'examples' / 'mlp.py'}:MLP"

PLUGIN = '''
"""`toy`: lowers to the program's text, compiles it with `toycc` (a checksum), checks it."""

import dataclasses
import hashlib
from pathlib import Path

import torch

from portable.backends import (
    Backend, Capabilities, CheckedProgram, CompileReport, Lowered, Toolchain, Written,
)
from portable.ir.program import ProgramKind
from portable.opset.layouts import in_fake_layout
from portable.runtime import Executable
from portable.torch_compat import copy_graph_module


@dataclasses.dataclass(frozen=True)
class ToyOptions:
    level: int = 1


@dataclasses.dataclass(frozen=True)
class ToyFinding:
    what: str

    @property
    def is_error(self):
        return True

    def render(self):
        return f"error[toy-missing] {self.what}"

    def to_json(self):
        return {"severity": "error", "code": "toy-missing", "what": self.what}


class ToyBackend(Backend):
    name = "toy"
    options_type = ToyOptions

    def __init__(self, options=None):
        self.options = options or ToyOptions()

    def capabilities(self):
        return Capabilities(
            ops=None, program_kinds=frozenset(ProgramKind), variants=("v1",),
            default_variant="v1", toolchain="toycc", checks=True,
        )

    def lower(self, program, target):
        self.check_program(program, target)
        return Lowered(program, target, texts={"graph.txt": program.text()})

    def write(self, lowered, out_dir=None):
        written = super().write(lowered, out_dir)
        if out_dir is not None:
            program = Path(out_dir) / "programs" / lowered.program.name
            program.mkdir(parents=True)
            (program / "source.txt").write_text(f"level={self.options.level}\\n")
        return written

    def find_toolchain(self):
        return Toolchain("toycc", "0.1")

    def compile_written(self, written, toolchain, jobs):
        records = []
        for program in sorted((Path(written.out_dir) / "programs").iterdir()):
            digest = hashlib.sha256((program / "source.txt").read_bytes()).hexdigest()
            (program / "out.toy").write_text(digest)
            records.append({"program": program.name, "status": "pass", "seconds": 0.0,
                            "error": None})
        return CompileReport(toolchain, jobs or 1, tuple(records))

    def check(self, folder, archive=None):
        checked = []
        for program in sorted((Path(folder) / "programs").iterdir()):
            findings = [] if (program / "out.toy").is_file() else [ToyFinding("out.toy is missing")]
            checked.append(CheckedProgram(program.name, program, "v1", findings))
        return checked

    def executable(self, compiled):
        program = compiled.lowered.program
        gm = copy_graph_module(program.graph_module)
        in_fake_layout(gm)

        def run(flat):
            with torch.no_grad():
                return gm(*flat)

        return Executable(program, run, self.name)
'''

PROBE = """
import contextlib, io, json, sys
from pathlib import Path
from portable.cli import main

def cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return {"code": int(code), "out": out.getvalue(), "err": err.getvalue()}

spec, out = sys.argv[1], Path(sys.argv[2])
doc = {"backends": cli("backends", "--json")}
doc["lower"] = cli("lower", spec, "-t", "toy{level=3}", "-t", "cpu", "--compile", "--parity",
                   "-o", str(out), "--json")
doc["check"] = cli("check", str(out), "--json")
(out / "toy_v1" / "programs" / "MLP" / "out.toy").unlink()
doc["check_missing"] = cli("check", str(out))
doc["bad_option"] = cli("lower", spec, "-t", "toy{speed=9}", "-o", str(out) + "-bad")
print(json.dumps(doc))
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    (site / "toyplug.py").write_text(PLUGIN)
    info = site / "toyplug-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toyplug\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[portable.backends]\ntoy = toyplug:ToyBackend\n")
    out = tmp_path_factory.mktemp("out") / "out"
    env_path = f"{site}"
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PROBE), MLP, str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=site,
        env={**_env(), "PYTHONPATH": env_path},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1]), out


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_the_plugin_is_listed(probe):
    doc, _ = probe
    rows = {r["name"]: r for r in json.loads(doc["backends"]["out"])}
    assert rows["toy"]["variants"] == ["v1"] and rows["toy"]["can_execute_here"] is True


def test_lower_compile_and_parity_run_the_plugins_stages(probe):
    doc, out = probe
    result = doc["lower"]
    assert result["code"] == 0, result["err"]
    manifest = json.loads(result["out"])["manifest"]
    toy = next(t for t in manifest["targets"] if t["target"] == "toy:v1")
    assert toy["dir"] == "toy_v1"  # the options are not part of the target's name
    assert toy["compile"]["compiler"] == "toycc" and toy["compile"]["ok"] is True
    assert [p["program"] for p in toy["compile"]["programs"]] == ["MLP"]
    assert "toy_v1/programs/MLP/out.toy" in {f["path"] for f in toy["files"]}
    assert (out / "toy_v1" / "programs" / "MLP" / "source.txt").read_text() == "level=3\n"
    assert "compile:toy:v1" in manifest["timings"] and toy["compile"]["version"] == "0.1"
    assert manifest["parity"]["ok"] is True and "toy:v1" in manifest["parity"]["backends"]


def test_check_runs_the_plugins_check(probe):
    doc, _ = probe
    checked = json.loads(doc["check"]["out"])
    assert doc["check"]["code"] == 0 and checked["programs"][0]["folder"] == "toy_v1"
    missing = doc["check_missing"]
    assert missing["code"] == 6 and "error[toy-missing] out.toy is missing" in missing["out"]


def test_an_option_the_plugin_does_not_have_is_refused(probe):
    doc, _ = probe
    bad = doc["bad_option"]
    assert bad["code"] == 4 and "backend 'toy' has no option 'speed'" in bad["err"]
    assert "options: level: int = 1" in bad["err"]
