"""`portable plan`: SPEC resolution (presets, config files, transformer: specs), the ranked table,
--json, --compare, --plot, and the typed errors for bad input and plans that cannot exist.

Every command plans one tiny transformer, whose costs are counted once per process (the
planner caches them), so the file takes seconds beyond that one count. The presets are
resolved, never counted (a Llama-3-70B count takes tens of seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from portable import planner
from portable.cli import ExitCode, main
from portable.cli.app import build_parser
from portable.errors import PlannerError
from portable.planner.presets import PRESETS, parse_transformer, resolve

SPEC = "transformer:layers=2,hidden=64,heads=4,vocab=128,seq=32"
H100 = ["--system", "h100", "--devices", "8", "--global-batch", "16"]


@pytest.fixture(scope="module", autouse=True)
def counted() -> planner.Costs:
    """The tiny transformer's costs, counted once: every `portable plan` below reuses them."""
    return planner.costs_of(parse_transformer(SPEC))


def plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------- the table


def test_the_table_ranks_the_fastest_plans_that_fit(capsys, counted) -> None:
    code, out, err = plan(capsys, SPEC, *H100, "--top", "3")
    assert code == ExitCode.OK, err
    best = planner.search(counted, planner.system("h100", devices=8), 16, top=3, heads=4)
    lines = out.splitlines()
    assert lines[0] == f"{SPEC}: 0.1M parameters, seq 32, global batch 16 (512 tokens per step)"
    assert lines[2].startswith("h100 x 8: ") and lines[2].endswith(
        "plans fit in 74.5 GiB per device; the 3 fastest:"
    )
    assert (
        lines[3].split()
        == (
            "rank plan micro-batch step tokens/s MFU memory/device compute comm bubble optimizer"
        ).split()
    )
    rows = lines[4:7]
    for rank, (row, est) in enumerate(zip(rows, best, strict=True), 1):
        assert row.startswith(f"{rank}     {est.plan.describe()}")
        assert f"{est.mfu:.1%}" in row and "/ 74.5 GiB" in row
    assert "[1/2] counting the costs of" in err and "[2/2] searching the plans on h100 x 8" in err


def test_json_is_the_estimates_with_the_model_and_system(capsys) -> None:
    code, out, err = plan(capsys, SPEC, *H100, "--top", "4", "--price-per-hour", "3", "--json")
    assert code == ExitCode.OK and err == ""  # no stage lines with --json
    doc = json.loads(out)
    assert doc["status"] == "ok" and doc["global_batch"] == 16 and doc["compare"] is None
    assert doc["model"] == {
        "spec": SPEC,
        "kind": "transformer",
        "name": SPEC,
        "seq": 32,
        "heads": 4,
        "parameters": parse_transformer(SPEC).parameters,
    }
    assert doc["system"]["name"] == "h100" and doc["system"]["devices"] == 8
    assert doc["system"]["price_per_device_hour"] == 3.0
    plans = doc["plans"]
    assert len(plans) == 4 and doc["fitting_plans"] >= 4
    costs = [p["cost_per_step"] for p in plans]
    assert costs == sorted(costs)  # ranked by cost per step when priced
    for p in plans:
        assert p["fits"] and p["memory_per_device_bytes"] <= p["memory_limit_bytes"]
        assert p["cost_per_step"] == pytest.approx(3.0 * 8 * p["step_time_s"] / 3600)


def test_a_price_adds_cost_columns(capsys) -> None:
    code, out, _ = plan(capsys, SPEC, *H100, "--top", "1", "--price-per-hour", "2.5")
    assert code == ExitCode.OK
    assert "the 1 cheapest per step:" in out
    assert "cost/step" in out and "cost/1M tokens" in out and "$" in out


# --------------------------------------------------------------------------- --compare


def test_compare_shows_the_best_of_each_side_by_side(capsys, counted) -> None:
    code, out, _ = plan(
        capsys, SPEC, *H100, "--compare", "trn2:16", "--compare-price-per-hour", "1"
    )
    assert code == ExitCode.OK
    assert "\ntrn2 x 16: " in out
    side = out[out.index("best plan") :].splitlines()
    assert side[0].split() == "best plan h100 x 8 trn2 x 16 trn2 x 16 / h100 x 8".split()
    assert [row.split()[0] for row in side[1:]] == [
        "plan",
        "step",
        "tokens/s",
        "MFU",
        "memory/device",
    ]
    best = planner.search(counted, planner.system("trn2", devices=16), 16, top=1, heads=4)[0]
    assert best.plan.describe() in side[1]
    assert "cost/step" in out.split("\n\n")[2]  # trn2's table: its price was given
    assert (
        "cost/step" not in out[out.index("best plan") :]
    )  # h100's price (--price-per-hour) was not


@pytest.mark.parametrize(
    "compare",
    [["--compare", "trn2:16"], ["--compare", "trn2", "--devices", "16"],
     ["--compare", "trn2", "--compare-devices", "16"]],
)  # fmt: skip
def test_the_compared_systems_devices_in_each_spelling(capsys, compare) -> None:
    code, out, _ = plan(capsys, SPEC, *H100, *compare, "--json")
    assert code == ExitCode.OK
    doc = json.loads(out)
    assert doc["system"]["devices"] == 8  # --devices before --compare is --system's
    assert doc["compare"]["system"] == doc["compare"]["system"] | {"name": "trn2", "devices": 16}


def test_devices_after_compare_belongs_to_the_compared_system() -> None:
    def parse(argv: list[str]) -> argparse.Namespace:
        return build_parser().parse_args(
            ["plan", "m", "--system", "h100", "--global-batch", "8", *argv]
        )

    args = parse(["--compare", "trn2", "--devices", "64"])
    assert args.devices is None and args.compare == ("trn2", None) and args.compare_devices == 64
    args = parse(["--compare", "trn2:32", "--devices", "64"])
    assert args.devices == 64 and args.compare == ("trn2", 32) and args.compare_devices is None
    with pytest.raises(SystemExit) as exc:  # a second count for the same system
        parse(["--devices", "8", "--devices", "8"])
    assert exc.value.code == ExitCode.USAGE


# --------------------------------------------------------------------------- --plot


def test_plot_writes_a_png_of_every_plan_searched(capsys, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "out" / "plan.png"
    argv = [SPEC, *H100, "--compare", "trn2:16", "--plot", str(png), "--json"]
    code, out, _ = plan(capsys, *argv)
    assert code == ExitCode.OK
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in png.parent.iterdir()) == ["plan.png"]  # no temporary left
    doc = json.loads(out)
    assert doc["plot"] == str(png) and doc["searched"] >= doc["fitting_plans"] > 0


def test_plot_without_matplotlib_names_the_extra(capsys, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setitem(__import__("sys").modules, "matplotlib.figure", None)
    code, _, err = plan(capsys, SPEC, *H100, "--plot", str(tmp_path / "p.png"))
    assert code == ExitCode.USER_ERROR
    assert "--plot needs matplotlib" in err and "pip install 'portable[report]'" in err
    assert "counting" not in err  # refused before the costs are counted
    assert not list(tmp_path.iterdir())


# --------------------------------------------------------------------------- SPEC


def test_presets_resolve_to_their_published_sizes_without_counting() -> None:
    pytest.importorskip("transformers")
    seventy = resolve("llama3-70b")
    config = seventy.model
    assert type(config).__name__ == "LlamaConfig" and seventy.kind == "preset"
    sizes = (config.hidden_size, config.intermediate_size, config.num_hidden_layers)
    assert sizes == (8192, 28672, 80)
    assert (config.num_attention_heads, config.num_key_value_heads) == (64, 8)
    assert config.vocab_size == 128256 and config.use_cache is False
    assert (seventy.seq, seventy.heads) == (8192, 64)
    assert seventy.parameters == pytest.approx(70.55e9, rel=1e-3)
    assert resolve("llama3-405b").parameters == pytest.approx(405.85e9, rel=1e-3)
    assert resolve("llama3-8b", seq=4096).seq == 4096
    gpt3 = resolve("GPT3-175B")
    assert isinstance(gpt3.model, planner.Transformer) and gpt3.seq == 2048
    assert gpt3.parameters == pytest.approx(174.6e9, rel=1e-3)
    assert set(PRESETS) == {"llama3-8b", "llama3-70b", "llama3-405b", "gpt3-175b"}


def test_transformer_spec_fields() -> None:
    t = parse_transformer(f"{SPEC},ffn=96,kv_heads=2,gated_mlp=1,experts=8,top_k=2,dropout=0")
    assert (t.layers, t.hidden, t.heads, t.vocab, t.seq) == (2, 64, 4, 128, 32)
    assert (t.ffn, t.kv_heads, t.gated_mlp, t.experts, t.top_k, t.dropout) == (
        96, 2, True, 8, 2, 0.0,
    )  # fmt: skip
    assert resolve(SPEC, seq=64).model.seq == 64


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("transformer:layers=2", "lacks hidden, heads, vocab, seq"),
        ("transformer:layers=2,,hidden=3", "is not a transformer spec"),
        (f"{SPEC},colour=red", "Transformer has no field 'colour'"),
        (f"{SPEC},layers=3", "gives layers twice"),
        (f"{SPEC},gated_mlp=maybe", "gated_mlp=maybe"),
        (f"{SPEC},dropout=nan", "dropout=nan"),
        ("transformer:layers=2,hidden=64,heads=5,vocab=9,seq=8", "not a multiple of heads=5"),
        ("transformer:layers=99999,hidden=64,heads=4,vocab=9,seq=8", "bound of 1024"),
        ("lama3-70b", "unknown model 'lama3-70b' (closest: llama3-70b)"),
        ("no/such/config.json", "no such file or folder"),
    ],
)
def test_bad_specs_are_planner_errors(spec: str, message: str) -> None:
    with pytest.raises(PlannerError) as exc:
        resolve(spec)
    assert message in str(exc.value) and "fix:" in str(exc.value)


def _config(tmp_path: Path, **changes: object) -> Path:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128,
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    doc = json.loads(path.read_text()) | changes
    path.write_text(json.dumps(doc))
    return path


def test_a_config_json_or_its_folder(tmp_path: Path) -> None:
    path = _config(tmp_path)
    for where in (path, tmp_path):
        got = resolve(str(where), seq=128)
        assert got.kind == "config" and got.seq == 128 and got.heads == 4
        assert got.model.num_hidden_layers == 2 and got.model.use_cache is False
    with pytest.raises(PlannerError, match="no training sequence length"):
        resolve(str(path))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"auto_map": {"AutoConfig": "evil.Config"}}, "runs no code from a config"),
        ({"model_type": "evil"}, "model_type 'evil' is not a causal language model"),
        ({"num_hidden_layers": 10**6}, "num_hidden_layers=1000000 is over the planner's bound"),
        ({"hidden_size": "wide"}, "is not a config transformers reads"),
    ],
)
def test_hostile_configs_are_refused(tmp_path: Path, changes: dict, message: str) -> None:
    path = _config(tmp_path, **changes)
    with pytest.raises(PlannerError) as exc:
        resolve(str(path), seq=128)
    assert message in str(exc.value)


def test_a_config_that_is_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    with pytest.raises(PlannerError, match="holds a JSON list, not an object"):
        resolve(str(path), seq=8)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["--system", "h10", "--global-batch", "8"], 3, "unknown system 'h10' (closest: h100)"),
        (["--system", "h100", "--global-batch", "0"], 2, "from 1 to"),
        (["--system", "h100", "--global-batch", "8", "--devices", "x"], 2, "from 1 to"),
        (["--system", "h100", "--global-batch", "8", "--price-per-hour", "-1"], 2, "positive"),
        (["--system", "h100", "--global-batch", "8", "--compare", "h100:a"], 2, "SYSTEM:DEVICES"),
        (["--system", "h100", "--global-batch", "8", "--compare-devices", "4"], 3, "without --compare"),
        (["--system", "h100", "--global-batch", "8", "--compare", "h100:8", "--compare-devices", "4"], 3, "once"),
    ],
)  # fmt: skip
def test_bad_command_lines(capsys, argv: list[str], code: int, message: str) -> None:
    got, _, err = plan(capsys, SPEC, *argv)
    assert got == code and message in err


def test_a_global_batch_no_data_parallel_degree_divides(capsys) -> None:
    code, _, err = plan(
        capsys, SPEC, "--system", "trn3-gen2", "--devices", "144", "--global-batch", "64"
    )
    assert code == ExitCode.USER_ERROR
    assert "global batch 64 is not a multiple of any data-parallel degree of trn3-gen2 x 144" in err
    assert "(dp = 144 / (tp*pp*cp) = 9, 18, 36, 72, 144)" in err
    assert "fix: pick a global batch one of them divides: 63 or 72 are the nearest, 144 suit" in err


def test_no_plan_fits_in_memory(capsys, monkeypatch) -> None:
    real = planner.system

    def tiny_memory(name: str, devices: int | None = None) -> planner.System:
        return dataclasses.replace(real(name, devices=devices), hbm_bytes=4096)

    monkeypatch.setattr(planner, "system", tiny_memory)
    code, _, err = plan(capsys, SPEC, *H100)
    assert code == ExitCode.USER_ERROR
    assert "error: no plan of " in err and "on h100 x 8 fits in 4.0 KiB per device" in err
    assert "the smallest of " in err and "fix: more devices (--devices)" in err
