"""The command line used wrongly: every mistake is one `error:` line and a typed exit code."""

from __future__ import annotations

from pathlib import Path

from .base import Scenario, cli, cli_outcome

REPO = Path(__file__).resolve().parents[2]
MLP = f"{REPO / 'examples' / 'mlp.py'}:MLP"
LLAMA = f"{REPO / 'examples' / 'llama.py'}:Llama"


def _lower(*extra: str, want=3, must_say: str = ""):
    def run(tmp: Path) -> str:
        return cli_outcome(
            ["lower", *extra, "--out", str(tmp / "o"), "-q"], want=want, must_say=must_say
        )

    return run


def out_is_a_file(tmp: Path) -> str:
    (tmp / "o").write_text("mine")
    argv = ["lower", MLP, "-t", "cpu", "--out", str(tmp / "o"), "-q"]
    result = cli_outcome(argv, want=5, must_say="not a directory portable wrote")
    return result if (tmp / "o").read_text() == "mine" else "lost:--out file replaced"


def out_is_foreign(tmp: Path) -> str:
    (tmp / "o").mkdir()
    (tmp / "o" / "notes.txt").write_text("mine")
    argv = ["lower", MLP, "-t", "cpu", "--out", str(tmp / "o"), "-q"]
    result = cli_outcome(argv, want=5, must_say="did not write")
    return result if (tmp / "o" / "notes.txt").exists() else "lost:foreign dir replaced"


def inference_archive_with_train(tmp: Path) -> str:
    cli(["lower", MLP, "-t", "cpu", "--out", str(tmp / "a"), "-q"])
    argv = ["lower", str(tmp / "a" / "program.portable"), "--train", "-t", "cpu"]
    return cli_outcome([*argv, "--out", str(tmp / "o"), "-q"], must_say="training step")


def run_world_size(tmp: Path) -> str:
    plan = tmp / "plan.json"
    plan.write_text('{"mesh": {"dp": 2, "tp": 2}, "batch_axes": ["dp"]}')
    argv = ["run", MLP, "--nproc", "3", "--steps", "1", "--plan", str(plan)]
    return cli_outcome(argv, must_say="4 positions")


def _plain(*argv: str, want=3, must_say: str = ""):
    return lambda tmp: cli_outcome(list(argv), want=want, must_say=must_say)


SCENARIOS = [
    Scenario("unknown target", "cli", _lower(MLP, "-t", "tpu", must_say="use one of")),
    Scenario("unknown pass", "cli", _lower(MLP, "-t", "cpu", "-p", "fuse-all", must_say="dce")),
    Scenario(
        "unknown pass option",
        "cli",
        _lower(MLP, "-t", "cpu", "-p", "mx-quantize{colour=red}", must_say="format"),
    ),
    Scenario("missing spec file", "cli", _lower("nope.py:M", "-t", "cpu", must_say="nope.py")),
    Scenario(
        "missing spec name", "cli", _lower(f"{REPO / 'examples' / 'mlp.py'}:Nope", "-t", "cpu")
    ),
    Scenario(
        "undecorated spec", "cli", _lower("torch.nn:Linear", "-t", "cpu", must_say="@portable")
    ),
    Scenario("missing plan file", "cli", _lower(MLP, "-t", "cpu", "--plan", "nope.json")),
    Scenario(
        "bad --max-alloc", "cli", _plain("--max-alloc", "lots", "backends", must_say="bad size")
    ),
    Scenario("--out is a file", "cli", out_is_a_file),
    Scenario("--out holds foreign files", "cli", out_is_foreign),
    Scenario("--train on an inference archive", "cli", inference_archive_with_train),
    Scenario("run with a world size the plan does not have", "cli", run_world_size),
    Scenario(
        "inspect a missing archive", "cli", _plain("inspect", "nope.portable", must_say="nope")
    ),
    Scenario("check a folder that is no output", "cli", _plain("check", str(REPO / "docs"))),
    Scenario(
        "--aot without a GPU",
        "cli",
        _lower(MLP, "-t", "cuda", "--aot", want=(3, 4), must_say="GPU"),
    ),
]
