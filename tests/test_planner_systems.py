"""portable.planner.system: every system loads from systems.toml with hardware.md's figures, the
Trn3 link-rate spread is carried, level_for picks the right link, errors are typed with a fix,
and portable.jobs.peaks reads the same chip table without changing a value."""

from __future__ import annotations

import copy
import math
import tomllib
from importlib import resources
from pathlib import Path

import pytest
import torch

from portable import planner
from portable.errors import PlannerError
from portable.jobs.peaks import PEAKS
from portable.planner.systems import FORMATS, LEVELS, _parse, chips, system, systems

NAMES = (
    "trn1",
    "trn2",
    "trn2-ultraserver",
    "trn3-gen1",
    "trn3-gen2",
    "a100-80gb",
    "h100",
    "h200",
    "b200",
    "gb200-nvl72",
)
T, GIB = 1e12, 1 << 30


def test_every_system_loads_and_is_consistent():
    assert systems() == NAMES
    assert planner.system is system
    for name in NAMES:
        s = system(name)
        assert s.name == name and s.chip in chips()
        assert set(s.peak_flops) <= set(FORMATS) and {"float32", "bfloat16"} <= set(s.peak_flops)
        assert all(math.isfinite(v) and v > 0 for v in s.peak_flops.values())
        assert s.hbm_bytes > 0 and s.hbm_bandwidth > 0
        levels = [link.level for link in s.links]
        assert levels[-1] == "network" and s.links[-1].devices == 0
        assert [LEVELS.index(x) for x in levels] == sorted({LEVELS.index(x) for x in levels})
        assert s.devices == s.links[-2].devices == s.scale_up_devices
        for link in s.links:
            assert link.bandwidth > 0 and 0 < link.latency_s < 1e-3 and link.source
        eff = s.efficiency
        assert set(eff.link) == set(levels) and all(0 < f <= 1 for f in eff.link.values())
        assert 0 < eff.matmul <= 1 and 0 < eff.memory <= 1 and eff.kernel_overhead_s > 0
        if name in ("a100-80gb", "trn1"):  # fitted to planner-validation.md's runs
            assert eff.calibrated is True and "planner-validation.md" in eff.source
        else:
            assert eff.calibrated is False and "assumed" in eff.source
        assert s.price_per_device_hour is None


def test_default_devices_are_one_scale_up_domain():
    domains = {"trn1": 16, "trn2": 16, "trn2-ultraserver": 64, "trn3-gen1": 64}
    domains |= {"trn3-gen2": 144, "a100-80gb": 8, "h100": 8, "gb200-nvl72": 72}
    for name, devices in domains.items():
        assert system(name).devices == devices


# hardware.md's figures (and planner-validation.md's for A100 / Trainium1), by value
@pytest.mark.parametrize(
    "name, fmt, tflops",
    [
        ("trn2", "bfloat16", 667),
        ("trn2", "float8", 1299),
        ("trn2", "float32", 181),
        ("trn3-gen2", "bfloat16", 671),
        ("trn3-gen1", "mxfp8", 2517),
        ("trn3-gen2", "mxfp4", 2517),
        ("trn3-gen2", "float32", 183),
        ("h100", "bfloat16", 989),
        ("h200", "float8", 1979),
        ("b200", "bfloat16", 2250),
        ("b200", "mxfp4", 9000),
        ("gb200-nvl72", "bfloat16", 2500),
        ("gb200-nvl72", "float4", 10000),
        ("a100-80gb", "bfloat16", 312),
        ("trn1", "bfloat16", 190),
    ],
)
def test_peaks_are_the_published_figures(name, fmt, tflops):
    assert system(name).peak(fmt) == tflops * T


def test_memory_and_links_are_the_published_figures():
    trn3 = system("trn3-gen2")
    assert trn3.hbm_bytes == 144 * GIB and trn3.hbm_bandwidth == 4.9e12
    assert system("trn2").hbm_bytes == 96 * GIB and system("trn2").hbm_bandwidth == 2.9e12
    assert system("h100").hbm_bytes == 80e9 and system("h100").hbm_bandwidth == 3.35e12
    assert system("h200").hbm_bytes == 141e9 and system("b200").hbm_bandwidth == 8e12
    assert system("a100-80gb").hbm_bandwidth == 2.039e12 and system("trn1").hbm_bytes == 32 * GIB
    # NVLink: NVIDIA's per-GPU figures are bidirectional totals, modelled one way
    assert system("h100").link("node").bandwidth == 450e9  # 900 GB/s
    assert system("a100-80gb").link("node").bandwidth == 300e9  # 600 GB/s
    assert system("gb200-nvl72").link("rack").bandwidth == 900e9  # 1.8 TB/s, 72-GPU domain
    assert system("gb200-nvl72").link("rack").devices == 72
    # scale-out: per-node totals over the node's devices
    assert system("a100-80gb").link("network").bandwidth == 25e9  # 8 x 200 Gb/s per 8 GPUs
    assert system("h100").link("network").bandwidth == 50e9  # 400 Gb/s per GPU
    assert system("trn1").link("network").bandwidth == 800e9 / 8 / 16  # 800 Gbps per instance
    assert system("trn2").link("network").bandwidth == 3.2e12 / 8 / 16
    assert system("trn3-gen2").link("network").bandwidth == 200e9 / 8  # 28.8 Tbps / 144
    # Trn2: 1,024 GB/s inside an instance + 256 GB/s across the UltraServer = 1.28 TB/s
    us = system("trn2-ultraserver")
    assert us.link("node").bandwidth + us.link("ultraserver").bandwidth == 1.28e12


def test_trn3_link_rate_spread_is_carried():
    for name in ("trn3-gen1", "trn3-gen2"):
        s = system(name)
        scale_up = [link for link in s.links if link.level != "network"]
        assert all(link.bandwidth == 2.56e12 for link in scale_up)  # hardware.md
        assert all(link.bandwidth_alt is not None for link in scale_up)
        assert all(link.bandwidth_alt < link.bandwidth for link in scale_up)  # type: ignore[operator]
        assert any("spread" in note for note in s.notes)
    assert system("trn3-gen1").link("ultraserver").bandwidth_alt == 2048 * GIB
    gen2 = system("trn3-gen2")
    assert gen2.link("node").bandwidth_alt == 128e9  # 256 GB/s bidirectional
    assert gen2.link("ultraserver").bandwidth_alt == 160e9  # 320 GB/s bidirectional
    assert "alternative figure" in gen2.link("node").source
    # other systems carry a single figure
    assert all(link.bandwidth_alt is None for link in system("h100").links)


def test_level_for_picks_node_or_network_by_span():
    h100 = system("h100", devices=1024)
    assert h100.level_for(1).level == "node"
    assert h100.level_for(8).level == "node"  # TP=8: one node
    assert h100.level_for(16).level == "network"  # two nodes
    assert h100.level_for(1024).level == "network"
    assert h100.level_for(4 * 2).level == "node"  # 4 ranks at stride 2
    assert h100.level_for(3).level == "network"  # groups of 3 straddle 8-GPU nodes
    trn2 = system("trn2-ultraserver", devices=256)
    assert [trn2.level_for(n).level for n in (16, 32, 64, 128)] == [
        "node",
        "ultraserver",
        "ultraserver",
        "network",
    ]
    gen2 = system("trn3-gen2", devices=288)
    assert [gen2.level_for(n).level for n in (4, 8, 144, 288)] == [
        "node",
        "ultraserver",
        "ultraserver",
        "network",
    ]
    assert system("gb200-nvl72", devices=144).level_for(72).level == "rack"


def test_with_devices_and_multi_node():
    s = system("h100", devices=1024)
    assert s.devices == 1024 and s.peak("bf16") == 989 * T
    assert s.with_devices(16).devices == 16 and s.with_devices(16).links == s.links
    assert system("trn1", devices=512).devices == 512  # 32 trn1.32xlarge nodes
    assert hash(s) == hash(system("h100", devices=1024)) and s == system("h100", devices=1024)


def test_peak_aliases():
    s = system("trn3-gen2")
    assert s.peak("bf16") == s.peak("bfloat16") == s.peak(torch.bfloat16) == 671 * T
    assert s.peak("fp8") == s.peak(torch.float8_e4m3fn) == 2517 * T
    assert system("h100").peak("tf32") == 494.5 * T
    assert system("b200").peak("fp4") == 9000 * T


def test_unknown_system_lists_the_known_ones():
    with pytest.raises(
        PlannerError, match=r"unknown system 'trn3-gen3' \(closest: trn3-gen"
    ) as exc:
        system("trn3-gen3")
    assert exc.value.fix is not None and all(name in exc.value.fix for name in NAMES)


@pytest.mark.parametrize("devices", [0, -8, 2.5, True, "8"])
def test_bad_device_counts(devices):
    with pytest.raises(PlannerError, match="device count of at least 1") as exc:
        system("h100", devices=devices)
    assert exc.value.fix and "devices=N" in exc.value.fix


def test_missing_format_and_bad_span():
    with pytest.raises(PlannerError, match=r"h100 \(h100\) has no peak rate for 'mxfp8'") as exc:
        system("h100").peak("mxfp8")
    assert exc.value.fix == "use one of float32, tfloat32, bfloat16, float16, float8"
    with pytest.raises(
        PlannerError, match=r"a100-80gb \(a100\) has no peak rate for 'fp8' \(float8\)\n"
    ):
        system("a100-80gb").peak("fp8")  # Ampere has no FP8
    with pytest.raises(PlannerError, match="does not fit h100 x 8") as exc:
        system("h100").level_for(16)
    assert exc.value.fix and "1 to 8" in exc.value.fix
    with pytest.raises(PlannerError, match="no 'rack' link level"):
        system("h100").link("rack")


def _data() -> dict:
    text = resources.files("portable.planner").joinpath("systems.toml").read_text()
    return tomllib.loads(text)


def test_malformed_data_is_refused_with_the_entry_named():
    data = _data()
    data["chips"]["h100"]["peak_tflops"]["int8"] = 1979
    with pytest.raises(PlannerError, match=r"chips\.h100: unknown number formats \['int8'\]"):
        _parse(data)
    data = _data()
    data["systems"]["h100"]["links"][0]["rate"] = "900 GBps"
    with pytest.raises(PlannerError, match=r"systems\.h100\.links\[0\]: '900 GBps' is not") as e:
        _parse(data)
    assert e.value.fix and "systems.toml" in e.value.fix
    data = _data()
    data["systems"]["h100"]["links"].reverse()
    with pytest.raises(PlannerError, match="links must end with level 'network'"):
        _parse(data)
    data = _data()
    data["systems"]["trn1"]["efficiency"]["matmul"] = 1.5
    with pytest.raises(PlannerError, match=r"efficiency\.matmul: an efficiency factor"):
        _parse(data)
    data = _data()
    del data["systems"]["h100"]["efficiency"]["link"]["network"]
    with pytest.raises(PlannerError, match="link factors for"):
        _parse(data)
    for bad in ([256], [256, 0], "256x128"):
        data = _data()
        data["chips"]["a100"]["gemm_tile"] = bad
        with pytest.raises(PlannerError, match=r"chips\.a100\.gemm_tile"):
            _parse(data)
    good = _parse(_data())
    assert good.systems["h100"] == system("h100")


def test_wave_quantization_data():
    a100 = system("a100-80gb")
    assert (a100.gemm_units, a100.gemm_tile) == (108, (256, 128))
    # Trainium: one systolic array, tile padding only
    assert (system("trn1").gemm_units, system("trn1").gemm_tile) == (1, (128, 128))


# --- one source of truth: portable.jobs.peaks reads the same chips ---------------------------

# PEAKS before it read systems.toml (TFLOPS; HBM bytes): every value must stay the same
_PEAKS_BEFORE: dict[str, tuple[dict[str, float], int]] = {
    "trn1": ({"float32": 47.5, "tfloat32": 190, "bfloat16": 190, "float16": 190, "float8": 190}, 32 * GIB),
    "trn2": ({"float32": 181, "tfloat32": 667, "bfloat16": 667, "float16": 667, "float8": 1299}, 96 * GIB),
    "trn3": (
        {"float32": 183, "tfloat32": 671, "bfloat16": 671, "float16": 671, "float8": 2517,
         "mxfp8": 2517, "mxfp4": 2517},
        144 * GIB,
    ),
    "h100": ({"float32": 67, "bfloat16": 989, "float16": 989, "float8": 1979}, 80 * 10**9),
    "h200": ({"float32": 67, "bfloat16": 989, "float16": 989, "float8": 1979}, 141 * 10**9),
    "b200": (
        {"float32": 75, "bfloat16": 2250, "float16": 2250, "float8": 4500, "mxfp8": 4500,
         "mxfp4": 9000, "float4": 9000},
        180 * 10**9,
    ),
    "gb200": (
        {"float32": 80, "bfloat16": 2500, "float16": 2500, "float8": 5000, "mxfp8": 5000,
         "mxfp4": 10000, "float4": 10000},
        186 * 10**9,
    ),
}  # fmt: skip
# what the shared table added: the GPUs' TF32 tensor-core rates (dense)
_ADDED: dict[str, dict[str, float]] = {"h100": {"tfloat32": 494.5}, "h200": {"tfloat32": 494.5}}
_ADDED |= {"b200": {"tfloat32": 1100}, "gb200": {"tfloat32": 1250}}


def test_peaks_are_unchanged_and_read_from_the_chip_table():
    assert set(PEAKS) == set(_PEAKS_BEFORE)
    for kind, (tflops, hbm) in _PEAKS_BEFORE.items():
        expected = {k: v * T for k, v in (tflops | _ADDED.get(kind, {})).items()}
        assert PEAKS[kind].flops == expected, kind
        assert PEAKS[kind].hbm_bytes == hbm and isinstance(PEAKS[kind].hbm_bytes, int)
        assert PEAKS[kind].flops == dict(chips()[kind].peak_flops)
    assert system("trn3-gen2").peak_flops == chips()["trn3"].peak_flops
    assert "a100" in chips() and "a100" not in PEAKS  # jobs do not detect A100s


def test_the_data_file_is_not_changed_by_a_parse():
    data = _data()
    before = copy.deepcopy(data)
    _parse(data)
    assert data == before


# --- docs/planner.md's tables are the data ---------------------------------------------------

DOCS = Path(__file__).resolve().parents[1] / "docs" / "planner.md"


def _rows(heading: str) -> list[list[str]]:
    section = DOCS.read_text().split(heading, 1)[1].split("\n### ", 1)[0]
    lines = [x for x in section.splitlines() if x.startswith("|") and not x.startswith("|---")]
    return [[c.strip().strip("`") for c in x.strip("|").split("|")] for x in lines[1:]]


def _number(cell: str) -> float | None:
    head = cell.split(" ")[0].replace(",", "")
    return None if head in ("", "-") else float(head)


def test_docs_chip_table_is_the_data():
    rows = _rows("### Chips: dense peak TFLOPS per number format, HBM")
    assert [r[0] for r in rows] == list(chips())
    for row in rows:
        peaks = {f: _number(c) for f, c in zip(FORMATS, row[1:9], strict=True)}
        chip = chips()[row[0]]
        assert {f: v * T for f, v in peaks.items() if v is not None} == chip.peak_flops, row[0]
        assert _number(row[10]) == chip.hbm_bandwidth / T


def test_docs_link_table_is_the_data():
    rows = _rows("### Systems: links by level")
    seen: dict[str, list[list[str]]] = {}
    name = ""
    for row in rows:
        name = row[0] or name
        seen.setdefault(name, []).append(row)
    assert tuple(seen) == systems()
    for name, links in seen.items():
        s = system(name)
        assert links[0][1] == s.chip and int(links[0][2]) == s.devices
        assert [r[3] for r in links] == [link.level for link in s.links]
        for row, link in zip(links, s.links, strict=True):
            assert row[4] == (str(link.devices) if link.devices else "all")
            assert _number(row[6]) == pytest.approx(link.bandwidth / 1e9), (name, link.level)
            alt = _number(row[7])
            assert (alt is None) == (link.bandwidth_alt is None)
            if alt is not None:
                assert alt == pytest.approx(link.bandwidth_alt / 1e9, abs=0.5)  # type: ignore[operator]
            assert _number(row[8]) == pytest.approx(link.latency_s * 1e6)
